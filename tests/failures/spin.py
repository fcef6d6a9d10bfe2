"""Case 5b: rank 1 spins in an endless Python loop while the others wait in a collective."""
import lockstep

rt = lockstep.Runtime(accelerator="cpu")
rt.all_reduce(1.0)
if rt.rank == 1:
    while True:  # stuck in Python: it will never reach the next collective
        pass
rt.barrier()
