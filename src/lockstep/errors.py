"""Every error lockstep raises on purpose, under one base: ``except lockstep.LockstepError`` catches them all.

Each also keeps the standard base it had before (``ValueError``, ``RuntimeError``, ...), so an
``except`` written for that base still catches it. The message of each says what to change.
This module imports nothing: every layer may raise these.
"""

from __future__ import annotations

import pickle


class LockstepError(Exception):
    """The base of every error lockstep raises on purpose."""


class ConfigError(LockstepError, ValueError):
    """An argument, option or setting that cannot work (an unknown strategy, degrees that do not fit
    the world size, a batch size that does not divide, float8 on hardware without it, empty data);
    the message says what to change."""


class UsageError(LockstepError, TypeError):
    """A value of the wrong kind was given (e.g. a model that did not come from ``rt.setup``); the
    message says what to give instead."""


class StateError(LockstepError, RuntimeError):
    """A call came at a moment it cannot work (a module not attached to a Trainer, ``self.log``
    outside a step, many processes asked for from an interactive session)."""


class RendezvousError(LockstepError, RuntimeError):
    """The ranks could not meet: the rendezvous store cannot be opened or reached, or a process group
    of another job is in the way; the message names the address and what to check."""


class MissingExtraError(LockstepError, ImportError):
    """An optional integration is used without its package; the message names the extra to install."""


class EnvError(ConfigError):
    """The launcher's environment is inconsistent; the message says what to change."""


class CollectiveError(LockstepError, RuntimeError):
    """A collective failed, timed out or the ranks disagree about it. The message is the hang report:
    which ranks arrived, where each of the others was (its last ``rt.mark`` stage and call site),
    and which rank failed first when one did."""


class CheckpointError(LockstepError, ValueError):
    """A checkpoint cannot be saved or used; the message says why and what to do."""


class NoSuchCheckpointError(CheckpointError):
    """The checkpoint folder named (``rt.latest_checkpoint(path, exact=True)``) does not exist."""


class UnsafeCheckpointError(LockstepError, pickle.UnpicklingError):
    """A checkpoint file names something other than the data a checkpoint holds (it would run code)."""


class WorkerError(LockstepError, RuntimeError):
    """A worker process failed; ``rank`` names it and the message holds its traceback."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank

    def __reduce__(self) -> tuple[type, tuple[str, int]]:  # pickled across processes (Ray): both arguments
        return type(self), (str(self), self.rank)


class NoRouteError(LockstepError, OSError):
    """No network interface of this node reaches the given address; the message names those seen."""


class PreflightError(ConfigError):
    """``lockstep run`` refuses a request that cannot work; the message is one line saying what to fix."""


__all__ = ["CheckpointError", "CollectiveError", "ConfigError", "EnvError", "LockstepError", "MissingExtraError",
           "NoRouteError", "PreflightError", "RendezvousError", "StateError", "UnsafeCheckpointError", "UsageError",
           "WorkerError"]
