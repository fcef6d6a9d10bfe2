"""A runtime loop with plain SGD (an optimizer without state) that resumes from its checkpoint folder and saves
a checkpoint there after step 2, whatever its world size. Under lockstep verify the two runs share the folder
(they share the script's arguments): the run on N processes must not resume from the one-process run's
checkpoint. And DCP creates an optimizer's empty state by calling its step() at lr 0, which must not count as a
training step (lockstep verify recorded it as a step without loss). argv: FOLDER."""

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import lockstep  # noqa: E402
from checks import dist as checks  # noqa: E402

folder = sys.argv[1]
rt = lockstep.Runtime(seed=0)
model = checks.make_model()
model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
loader = rt.loader(checks.make_data(64), batch_size=16, num_workers=0)
state = {"model": model, "optimizer": optimizer, "loader": loader}
rt.resume(folder, state)
for step, (x, y) in enumerate(loader, 1):
    rt.backward(F.cross_entropy(model(x), y))
    optimizer.step()
    optimizer.zero_grad()
    if step == 2:
        rt.save(os.path.join(folder, "step-2"), state)
