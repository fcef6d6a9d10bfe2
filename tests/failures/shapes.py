"""Case 7: tensors of different shapes passed to one all_reduce (caught in debug mode)."""
import torch

import lockstep

rt = lockstep.Runtime(accelerator="cpu")
rt.all_reduce(torch.ones(3 if rt.rank == 0 else 4))
