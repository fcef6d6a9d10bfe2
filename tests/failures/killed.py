"""Case 13: rank 1 is killed (SIGKILL) at step 5; the others lose their peer in the next collective."""
import os
import signal

import torch

import lockstep

rt = lockstep.Runtime(accelerator="cpu")
model = torch.nn.Linear(4, 1)
model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
for step in range(100):
    if rt.rank == 1 and step == 5:
        os.kill(os.getpid(), signal.SIGKILL)
    rt.backward(model(torch.randn(8, 4)).sum())
    optimizer.step()
    optimizer.zero_grad()
    rt.all_reduce(1.0)
