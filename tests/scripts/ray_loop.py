"""A runtime-API loop that checkpoints every 3 steps with rt.save and resumes with rt.resume, paced so
that a node can be lost mid-run: the training of checks.dist.train_lockstep (EPOCHS, default 2; 103
samples, global batch 16, shuffled). Arguments: FOLDER OUT PROGRESS [EPOCHS]. Rank 0 writes
"step world_size time" to PROGRESS after each step, and at the end the weights, the steps and the
world size to OUT. When Ray announces that a node will be reclaimed, it checkpoints at once and
trains on."""

import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import lockstep  # noqa: E402
from checks import dist as checks  # noqa: E402

folder, out, progress = sys.argv[1:4]
EPOCHS = int(sys.argv[4]) if len(sys.argv) > 4 else 2

rt = lockstep.Runtime(seed=0)
model = checks.make_model()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = rt.setup(model, optimizer)
loader = rt.loader(checks.make_data(103), batch_size=16, shuffle=True, num_workers=0)
state = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0}
found = rt.resume(folder, state)
step = state["step"]
rt.print(f"the caller's RUN_LABEL: {os.environ.get('RUN_LABEL')}; PATH from the caller: "
         f"{os.environ.get('PATH') == os.environ.get('CALLER_PATH')}")
rt.print(f"resumed from {found.path} at step {step} on {rt.world_size} processes" if found else
         f"started on {rt.world_size} processes on {rt.num_nodes} node(s)")
while step < EPOCHS * len(loader):  # each pass over the loader is the next epoch (or the rest of one)
    for x, y in loader:
        rt.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        step += 1
        if step % 3 == 0:
            state["step"] = step
            rt.save(os.path.join(folder, f"step={step:04d}"), state, metadata={"step": step})
        elif rt.should_checkpoint():  # Ray will reclaim a node: a checkpoint now, and on
            state["step"] = step
            rt.save(os.path.join(folder, f"step={step:04d}-preempted"), state, metadata={"step": step})
            rt.print(f"a node will be reclaimed: checkpoint at step {step}")
        if rt.is_global_zero:
            with open(progress, "a") as handle:
                handle.write(f"{step} {rt.world_size} {time.time():.1f}\n")
        time.sleep(float(os.environ.get("RAY_LOOP_PACE", "0.3")))
if rt.is_global_zero:
    torch.save({"weights": checks.flat_weights(model), "steps": step, "world_size": rt.world_size}, out)
