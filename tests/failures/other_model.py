"""Case 12: a checkpoint loaded into another model (each rank's DCP error would repeat every rank's trace)."""
import sys

import torch

import lockstep

folder = sys.argv[1]
rt = lockstep.Runtime(accelerator="cpu")
small = rt.setup(torch.nn.Linear(4, 8))
rt.save(f"{folder}/small.ckpt", {"model": small})
wide = rt.setup(torch.nn.Linear(4, 16))
rt.load(f"{folder}/small.ckpt", {"model": wide})
