"""One replica group of a fault-tolerant job (or, without LOCKSTEP_FAULT_TOLERANT, the one-process reference).

    python ft_replica.py OUT [--die-at STEP --die-when start|backward|random] [--checkpoints DIR --save-every N]
                             [--plain-loader]

``{group}`` and ``{rank}`` in OUT and ``--log``: the replica group's index (under ``lockstep run --fault-tolerant``)
and the rank inside the group.

Trains a small MLP that draws a random number each step (``RandomResidual``) with SGD on 240 samples,
global batch 24, 2 epochs (20 steps), and writes to OUT
(torch.save): the final weights, each committed step's dataset indices of this group, its PID.
``--die-at``: SIGKILL itself in step STEP: before the forward (start), inside the backward, inside the
cross-group all-reduce (after sending its part), or at a random moment between the forward and the commit
vote (a timer thread). ``--slow``: sleep this long per step. ``--log``: append each committed step's
indices to this JSON-lines file as it goes (a killed group's too), and each share before its vote.
``--marks DIR``: each process leaves a file there just before its first quorum; with ``--hold-at STEP
--hold-for N`` a group waits at that step until N processes of rank 0 have (the replacement of a killed
group, a group started later is asking to join), so that the others are still training when it comes,
however long it takes to start.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import threading
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import lockstep  # noqa: E402
from checks.fault_tolerance import hold_until_started, mark_start  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--die-at", type=int, default=-1)
parser.add_argument("--die-when", default="start", choices=["start", "backward", "allreduce", "random"])
parser.add_argument("--log", default="")
parser.add_argument("--die-group", type=int, default=-1, help="only this replica group dies (default: any)")
parser.add_argument("--checkpoints", default="")
parser.add_argument("--save-every", type=int, default=0)
parser.add_argument("--slow", type=float, default=0.0)
parser.add_argument("--slow-group", type=int, default=-1, help="only this replica group is slow (default: all)")
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--hidden", type=int, default=16)
parser.add_argument("--marks", default="")
parser.add_argument("--hold-at", type=int, default=-1)
parser.add_argument("--hold-for", type=int, default=0)
parser.add_argument("--plain-loader", action="store_true", help="batches from a torch DataLoader (refused)")
args = parser.parse_args()
group = int(os.environ.get("LOCKSTEP_REPLICA_GROUP", "0"))
rank = os.environ.get("RANK", "0")  # a group of several processes: each rank writes its own files
args.out = args.out.replace("{group}", str(group)).replace("{rank}", rank)
args.log = args.log.replace("{group}", str(group)).replace("{rank}", rank)
if args.die_group not in (-1, group):
    args.die_at = -1
if args.slow_group not in (-1, group):
    args.slow = 0.0


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


g = torch.Generator().manual_seed(0)
x, y = torch.randn(240, 8, generator=g), torch.randint(0, 4, (240,), generator=g)
data = torch.utils.data.TensorDataset(torch.arange(240), x, y)

rt = lockstep.Runtime(accelerator="cpu", seed=args.seed)


class RandomResidual(nn.Module):
    """``x + layer(x) * u``, ``u`` drawn from torch's generator at each training forward (as stochastic
    depth draws): the one-process run draws one number a step, and so must every group, also when a step is
    drawn again after a death and in a group that joined later (it receives the random states)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.layer = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.layer(x) * torch.rand(()) if self.training else x + self.layer(x) * 0.5


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, args.hidden), nn.ReLU(), RandomResidual(args.hidden), nn.Linear(args.hidden, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = rt.setup(model, optimizer)
loader = rt.loader(data, batch_size=24, shuffle=True)
state = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0, "random": rt.random_states()}
if args.plain_loader:
    loader = torch.utils.data.DataLoader(data, batch_size=12)
    del state["loader"]
total = args.epochs * len(loader)
if args.marks:
    mark_start(args.marks, group, rank)
if args.checkpoints or rt.replication.fault_tolerant:
    rt.resume(args.checkpoints or os.path.join(os.path.dirname(args.out) or ".", "no-checkpoints"), state)

record: dict[int, list[int]] = {}
started = time.monotonic()
timer: threading.Timer | None = None
if rt.replication.fault_tolerant and args.die_at >= 0:
    replicas = rt.replication
    all_reduce, should_commit = replicas._all_reduce, replicas.manager.should_commit

    def all_reduce_then_die(tensor, average):
        if state["step"] == args.die_at and args.die_when == "allreduce":
            threading.Timer(0.005, die).start()  # while the all-reduce waits for the others, or runs
        return all_reduce(tensor, average)

    def vote(*a, **k):
        if timer is not None:
            timer.cancel()
        return should_commit(*a, **k)

    replicas._all_reduce, replicas.manager.should_commit = all_reduce_then_die, vote
log = open(args.log, "a") if args.log else None
while state["step"] < total:
    for index, xb, yb in loader:
        step = state["step"]
        if step == args.die_at and args.die_when == "start":
            die()
        if step == args.hold_at and args.marks:
            hold_until_started(args.marks, args.hold_for)
        if step == args.die_at and args.die_when == "random":
            timer = threading.Timer(random.uniform(0.0, max(args.slow, 0.005)), die)
            timer.start()
        loss = F.cross_entropy(model(xb), yb)
        if step == args.die_at and args.die_when == "backward":
            loss.register_hook(lambda grad: die())
        rt.backward(loss)
        if args.slow:
            time.sleep(args.slow)
        if log is not None:  # this share's gradient may count even if the group dies before the vote
            log.write(json.dumps({"step": step, "indices": index.tolist(), "size": rt.data_parallel_size,
                                  "committed": False}) + "\n")
            log.flush()
        optimizer.step()
        optimizer.zero_grad()
        if rt.step_committed:
            record[step] = index.tolist()
            if log is not None:
                log.write(json.dumps({"step": step, "indices": record[step], "size": rt.data_parallel_size,
                                      "committed": True}) + "\n")
                log.flush()
            state["step"] = step + 1
            if args.save_every and state["step"] % args.save_every == 0:
                rt.save(os.path.join(args.checkpoints, f"step={state['step']}"), state,
                        metadata={"step": state["step"]})
            if state["step"] == total:
                break

full = rt.full_state_dict(model, rank0_only=False)  # FSDP's shards gathered (every rank of the group calls it)
weights = torch.cat([full[name].flatten() for name, _ in lockstep.unwrap(model).named_parameters()])
torch.save({"weights": weights, "record": record, "pid": os.getpid(), "seconds": time.monotonic() - started,
            "step": state["step"], "step_times": rt.step_times()}, args.out)
rt.close()
