"""Preemption: a signal (SLURM's USR1 warning, or TERM) becomes a stop that every rank agrees on."""

from __future__ import annotations

import signal
import subprocess
from types import FrameType
from typing import Any


class Preemption:
    """Catches USR1, USR2 and TERM; ``should_stop`` turns a signal on any rank into a stop on every rank.

    ``requeue_job`` is the SLURM job id to requeue when USR1 (the time-limit warning) arrived. USR2 is
    what the ``lockstep slurm`` job script sends the tasks when the job itself gets TERM (srun would
    kill the tasks on TERM): a last-chance checkpoint, no requeue.
    """

    def __init__(self, requeue_job: str | None) -> None:
        self.requeue_job = requeue_job
        self.received: int | None = None
        self._previous: dict[int, Any] = {}
        for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals cannot be caught here
                pass

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum

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
