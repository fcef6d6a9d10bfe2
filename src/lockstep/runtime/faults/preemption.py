"""Preemption: a signal (SLURM's USR1 warning, or TERM) becomes a stop that every rank agrees on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from types import FrameType
from typing import Any

GRACE_S = 5.0


class Preemption:
    """Catches USR1, USR2 and TERM; ``should_stop`` turns a signal on any rank into a stop on every rank.

    ``requeue_job`` is the SLURM job id to requeue when USR1 (the time-limit warning) arrived. USR2 is
    what the ``lockstep slurm`` job script sends the tasks when the job itself gets TERM (srun would
    kill the tasks on TERM): a last-chance checkpoint, no requeue.

    A process that has never called ``should_stop`` when a signal comes gets ``GRACE_S`` seconds to
    call it; if it does not (a loop that does not poll), the signal takes the effect it would have
    without lockstep (TERM, USR1 and USR2 end the process). A loop that has polled before is trusted
    to poll again at its next step boundary, however long its steps.
    """

    def __init__(self, requeue_job: str | None, rank: int = 0) -> None:
        self.requeue_job, self.rank = requeue_job, rank
        self.received: int | None = None
        self.polled = False
        self._timer: threading.Timer | None = None
        self._previous: dict[int, Any] = {}
        for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals cannot be caught here
                pass

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum
        if self.polled or self._timer is not None:
            return
        # Nothing polls yet: from now on this signal acts as it would without lockstep, and this
        # one is delivered again unless should_stop() is called within the grace period.
        previous = self._previous.get(signum)
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._timer = threading.Timer(GRACE_S, self._expire, args=(signum,))
        self._timer.daemon = True
        self._timer.start()

    def _expire(self, signum: int) -> None:
        name = signal.Signals(signum).name
        print(f"lockstep: rank {self.rank} got {name} and nothing called rt.should_stop() within {GRACE_S:g}s: "
              f"ending the process as {name} does without lockstep (poll rt.should_stop() at each step, or "
              "use the Trainer, to checkpoint first).", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signum)

    def poll(self) -> None:
        """should_stop() was called: the loop polls, so the signal waits for it."""
        self.polled = True
        if self._timer is not None:
            self._timer.cancel()

    @property
    def local_flag(self) -> float:
        return 0.0 if self.received is None else float(self.received)

    def requeue(self, rank: int) -> str:
        """Rank 0 asks SLURM to requeue the job after USR1; returns what happened, for the log."""
        if self.received != signal.SIGUSR1 or self.requeue_job is None:
            return "not requeued"
        if rank == 0:
            done = subprocess.run(["scontrol", "requeue", self.requeue_job], capture_output=True, text=True,
                                  timeout=60)
            if done.returncode != 0:
                return f"scontrol requeue {self.requeue_job} failed: {done.stderr.strip()}"
        return f"job {self.requeue_job} requeued"


class ReclaimNotice:
    """An engine's notice that nodes of the job will be reclaimed at a deadline (Ray Train: a node being
    drained for preemption, e.g. a spot instance). The engine restarts the job from its newest checkpoint
    once the node is gone, so the answer is a checkpoint now, and training goes on: ``count`` is how many
    such nodes this rank has been told of; ``rt.should_checkpoint`` agrees on it across the ranks."""

    def __init__(self) -> None:
        self.handled = 0  # the notices already answered with a checkpoint (the same on every rank)
        self.unreadable = False

    def count(self) -> int:
        """The nodes this rank's worker has been told will be reclaimed. Ray's public
        ``ray.train.get_preemption_info()`` is a barrier through a Ray actor at every call; the worker's
        own copy of the notice (what that call broadcasts from rank 0) is read instead, and the ranks
        agree with one all-reduce on the job's own process group, as a signal under SLURM is agreed."""
        try:
            from ray.train.v2._internal.execution.context import get_train_context

            info = get_train_context().preemption_context.preemption_info
        except (ImportError, AttributeError, RuntimeError, ValueError) as error:  # Ray Train V1, or a Ray without it
            if not self.unreadable:
                print(f"lockstep: Ray's notice of a node's reclaim cannot be read here ({error}): no checkpoint will "
                      "be taken on it (Ray Train V2, Ray 2.50 or later, has it).", file=sys.stderr, flush=True)
            self.unreadable = True
            return 0
        return 0 if info is None else len(info.preempted_node_ids)
