"""Two experts, each row routed to one of them by its first feature, as a router that sends a whole share to
one expert: under ``lockstep run --fault-tolerant --replicas 2`` group 0's rows of each step all go to expert
``a`` and group 1's to expert ``b``, so each group's backward leaves the other expert without a gradient.
Without LOCKSTEP_FAULT_TOLERANT: the one-process reference.

    python ft_experts.py OUT     # {group} in OUT: the replica group's index
"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

import lockstep


class TwoExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(2, 1, bias=False), nn.Linear(2, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = x[:, 0] > 0
        out = torch.zeros(len(x), 1)
        if routed.any():
            out[routed] = self.a(x[routed])
        if (~routed).any():
            out[~routed] = self.b(x[~routed])
        return out


out_path = sys.argv[1].replace("{group}", os.environ.get("LOCKSTEP_REPLICA_GROUP", "0"))
rt = lockstep.Runtime(accelerator="cpu", seed=0)
torch.manual_seed(0)
model = TwoExperts()
optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
model, optimizer = rt.setup(model, optimizer)
# global batches of 4: rows 0-1 (group 0's share) route to a, rows 2-3 (group 1's) to b
first = torch.tensor([1.0, 1.0, -1.0, -1.0] * 3)
data = torch.utils.data.TensorDataset(torch.stack([first, torch.linspace(-1, 1, 12)], 1), torch.linspace(0, 2, 12))
loader = rt.loader(data, batch_size=4, num_workers=0)
state = {"model": model, "optimizer": optimizer, "loader": loader}
rt.resume(os.path.join(os.path.dirname(out_path) or ".", "no-checkpoints"), state)
steps = 0
for x, y in loader:
    rt.backward(((model(x).squeeze(1) - y) ** 2).mean())
    optimizer.step()
    optimizer.zero_grad()
    steps += int(rt.step_committed)
plain = lockstep.unwrap(model)
torch.save({"a": plain.a.weight.detach().clone(), "b": plain.b.weight.detach().clone(), "steps": steps}, out_path)
rt.close()
