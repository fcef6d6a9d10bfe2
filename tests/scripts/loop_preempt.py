"""A runtime-API loop (no Trainer) that checkpoints, requeues and exits when SLURM preempts it.

Same training as dist_checks.train_lockstep (2 epochs, 103 samples, global batch 16, shuffled);
rank 0 writes MARKER once step 5 is done; the loop is slowed down so the signal lands mid-run.
"""

import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import lockstep  # noqa: E402
from checks import dist as checks  # noqa: E402

checkpoint, out, marker = sys.argv[1], sys.argv[2], sys.argv[3]
EPOCHS = 2

rt = lockstep.Runtime(accelerator="cpu", seed=0)
model = checks.make_model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = rt.setup(model, optimizer)
loader = rt.loader(checks.make_data(103), batch_size=16, shuffle=True, num_workers=0)
step = 0
if os.path.exists(checkpoint):  # the requeued job: continue where the preempted one stopped
    state = torch.load(checkpoint, weights_only=True)
    lockstep.unwrap(model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    loader.load_state_dict(state["loader"])
    step = state["step"]
    rt.print(f"resumed from step {step}")
while step < EPOCHS * len(loader):  # each pass over the loader is the next epoch (or the rest of one)
    for x, y in loader:
        rt.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        time.sleep(0.3)
        if step == 5 and rt.is_global_zero and not os.path.exists(marker):
            open(marker, "w").write(os.environ.get("SLURM_JOB_ID", ""))
        if rt.should_stop():  # every rank calls it at every step; True everywhere once any rank got the signal
            if rt.is_global_zero:
                torch.save({"model": lockstep.unwrap(model).state_dict(), "optimizer": optimizer.state_dict(),
                            "loader": loader.state_dict(), "step": step}, checkpoint + ".partial")
                os.replace(checkpoint + ".partial", checkpoint)
            rt.barrier()
            rt.print(f"preempted at step {step}; {rt.requeue()}")
            raise SystemExit(0)
if rt.is_global_zero:
    torch.save({"weights": checks.flat_weights(model), "steps": step,
                "restarts": os.environ.get("SLURM_RESTART_COUNT", "0")}, out)
