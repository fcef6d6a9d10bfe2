"""A training script as a user writes it: no launcher logic, run by `lockstep run` or torchrun."""

import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 2)[0])  # tests/, for checks.dist
import lockstep  # noqa: E402
from checks import dist as checks  # noqa: E402

rt = lockstep.Runtime(seed=0)
weights = checks.train_lockstep(rt, checks.make_data(103), 16, epochs=2, shuffle=True)
if rt.is_global_zero:
    torch.save({"weights": weights, "world_size": rt.world_size, "precision": rt.precision.name,
                "accelerator": rt.placement.accelerator}, sys.argv[1])
