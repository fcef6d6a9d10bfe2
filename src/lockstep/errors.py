"""Every error lockstep raises on purpose, under one base: ``except lockstep.LockstepError`` catches them all.

Each also keeps the standard base it had before (``ValueError``, ``RuntimeError``, ...), so an
``except`` written for that base still catches it. The message of each says what to change.
This module imports nothing: every layer may raise these.
"""

from __future__ import annotations

import pickle


class LockstepError(Exception):
    """The base of every error lockstep raises on purpose."""


class EnvError(LockstepError, ValueError):
    """The launcher's environment is inconsistent; the message says what to change."""


class CollectiveError(LockstepError, RuntimeError):
    """A collective failed, timed out or the ranks disagree about it. The message is the hang report:
    which ranks arrived, where each of the others was (its last ``rt.mark`` stage and call site),
    and which rank failed first when one did."""


class CheckpointError(LockstepError, ValueError):
    """A checkpoint cannot be saved or used; the message says why and what to do."""


class UnsafeCheckpointError(LockstepError, pickle.UnpicklingError):
    """A checkpoint file names something other than the data a checkpoint holds (it would run code)."""


class WorkerError(LockstepError, RuntimeError):
    """A worker process failed; ``rank`` names it and the message holds its traceback."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


class NoRouteError(LockstepError, OSError):
    """No network interface of this node reaches the given address; the message names those seen."""


class PreflightError(LockstepError):
    """``lockstep run`` refuses a request that cannot work; the message is one line saying what to fix."""


__all__ = ["CheckpointError", "CollectiveError", "EnvError", "LockstepError", "NoRouteError", "PreflightError",
           "UnsafeCheckpointError", "WorkerError"]
