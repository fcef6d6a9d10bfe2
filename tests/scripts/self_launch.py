"""Asks for 2 devices in code: under plain `python` it starts its own 2 processes."""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import lockstep  # noqa: E402
from checks import dist as checks  # noqa: E402

print(f"started pid={os.getpid()}", flush=True)  # printed by the launching process and each worker
rt = lockstep.Runtime(accelerator="cpu", devices=2, seed=0)
weights = checks.train_lockstep(rt, checks.make_data(103), 16, epochs=2, shuffle=True)
if rt.is_global_zero:
    torch.save({"weights": weights, "world_size": rt.world_size, "launcher": rt.env.launcher}, sys.argv[1])
