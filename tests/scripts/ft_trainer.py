"""A Trainer fit as one replica group of a fault-tolerant job (or, without LOCKSTEP_FAULT_TOLERANT, the
one-process reference): 2 epochs of 6 steps; ``--die-at STEP --die-group G`` SIGKILLs group G before
that step's forward; ``--slow S`` sleeps S seconds per step; ``--marks DIR --hold-at STEP --hold-for N``:
as ft_replica.py's. Writes OUT ({group} replaced) with the
weights and the step count."""

import argparse
import os
import signal
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
import lockstep  # noqa: E402
from checks import dist as checks  # noqa: E402
from checks import trainer as tc  # noqa: E402
from checks.fault_tolerance import hold_until_started, mark_start  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--die-at", type=int, default=-1)
parser.add_argument("--die-group", type=int, default=-1)
parser.add_argument("--slow", type=float, default=0.0)
parser.add_argument("--marks", default="")
parser.add_argument("--hold-at", type=int, default=-1)
parser.add_argument("--hold-for", type=int, default=0)
args = parser.parse_args()
group = int(os.environ.get("LOCKSTEP_REPLICA_GROUP", "0"))


class Chaos(lockstep.Callback):
    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if trainer.global_step == args.die_at and group == args.die_group:
            os.kill(os.getpid(), signal.SIGKILL)
        if trainer.global_step == args.hold_at and args.marks:
            hold_until_started(args.marks, args.hold_for)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        time.sleep(args.slow)


module = tc.Classifier()
trainer = tc.quiet_trainer(max_epochs=2, callbacks=[Chaos()])
if args.marks:
    mark_start(args.marks, group, os.environ.get("RANK", "0"))
trainer.fit(module, checks.make_data(96), batch_size=16)
if trainer.is_global_zero:
    torch.save({"weights": checks.flat_weights(module), "steps": trainer.global_step},
               args.out.replace("{group}", str(group)))
