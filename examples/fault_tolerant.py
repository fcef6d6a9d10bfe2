"""A loop of your own that trains on when a replica group dies (docs/fault-tolerance.md).

    lockstep run --fault-tolerant --replicas 2 --devices 2 examples/fault_tolerant.py
    lockstep run --fault-tolerant --replicas 2 --devices 4 --strategy fsdp examples/fault_tolerant.py

Kill one group's process (``kill -9``): the other trains on, and `lockstep run` starts a replacement
that takes its state from the live group. Started again after every group died, the job resumes from
the newest checkpoint in --checkpoints.
"""

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import lockstep


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--checkpoints", default="runs/fault_tolerant")
    args = parser.parse_args()

    rt = lockstep.Runtime(seed=0)  # fault tolerance: what `lockstep run --fault-tolerant` set
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4096, 20, generator=generator)
    y = (x[:, :10].sum(dim=1) > 0).long()
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    model, optimizer = rt.setup(model, optimizer)
    loader = rt.loader(TensorDataset(x, y), batch_size=64, shuffle=True)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    state = {"model": model, "optimizer": optimizer, "loader": loader, "scheduler": scheduler, "step": 0}
    rt.resume(args.checkpoints, state)  # the newest checkpoint, then (fault-tolerant) the live groups' state
    while state["step"] < args.steps:
        for xb, yb in loader:
            loss = F.cross_entropy(model(xb), yb)
            rt.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if not rt.step_committed:  # a group died during this step: nobody took it, its batch comes again
                continue
            scheduler.step()
            state["step"] += 1
            if state["step"] % 50 == 0:
                rt.save(f"{args.checkpoints}/step={state['step']}", state, metadata={"step": state["step"]})
                rt.print(f"step {state['step']}: loss {loss.item():.4f}")
            if state["step"] == args.steps:
                break


if __name__ == "__main__":
    main()
