"""A runtime-API loop under srun that polls rt.should_stop() ("poll") or never does ("nopoll").

Each rank writes its pid to FOLDER/RANK.pid once it runs. With "poll", rank 0 saves a checkpoint
when a signal comes, and every rank exits cleanly.
"""

import os
import sys
import time

import torch

import lockstep

folder, mode = sys.argv[1], sys.argv[2]
rt = lockstep.Runtime(accelerator="cpu")
with open(os.path.join(folder, f"{rt.rank}.tmp"), "w") as handle:
    handle.write(str(os.getpid()))
os.replace(os.path.join(folder, f"{rt.rank}.tmp"), os.path.join(folder, f"{rt.rank}.pid"))
weights = torch.zeros(4)
step = 0
while step < 3000:  # about 5 minutes: far longer than the test waits
    weights += rt.all_reduce(torch.ones(4), op="sum")
    step += 1
    time.sleep(0.1)
    if mode == "poll" and rt.should_stop():
        if rt.is_global_zero:
            torch.save({"weights": weights, "step": step}, os.path.join(folder, "checkpoint.pt"))
        rt.barrier()
        rt.print(f"checkpointed at step {step}")
        raise SystemExit(0)
