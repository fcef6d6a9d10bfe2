"""Case 5b: rank 1 spins in an endless Python loop while the others wait in a collective."""
import lockstep

rt = lockstep.Runtime(accelerator="cpu")
for batch in rt.loader(list(range(16)), batch_size=2):
    rt.mark("my_step")
    rt.all_reduce(1.0)
    if rt.rank == 1 and batch.tolist() == [9]:  # batch 4 of epoch 0
        while True:  # stuck in Python: it will never reach the next collective
            pass
