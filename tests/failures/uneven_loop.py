"""Case 3: a hand-made loop where rank 0 has one batch more than rank 1."""
import torch

import lockstep

rt = lockstep.Runtime(accelerator="cpu")
batches = 5 if rt.rank == 0 else 4
for step in range(batches):
    rt.all_reduce(torch.tensor([float(step)]), op="sum")  # a per-batch metric sync
rt.barrier()
