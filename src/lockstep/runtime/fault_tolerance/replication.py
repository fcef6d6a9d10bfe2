"""Replication: how this job's data-parallel ranks relate to other copies of the job. The Runtime chooses
one at construction: ``NoReplicas`` (the job alone) or ``groups.ReplicaGroups`` (one replica group of a
fault-tolerant job, over torchft), and asks it, without an ``if``, what a step, a save, a resume and the
loaders need."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from lockstep.errors import UsageError
from lockstep.runtime.parallel.mesh import Membership

#: ``Checkpoints.save``: (path, state, blocking, metadata, on_commit) -> the seconds it blocked
Save = Callable[[Any, dict[str, Any], bool, "dict[str, Any] | None", "Callable[[], None] | None"], float]


class Replication(Protocol):
    @property
    def fault_tolerant(self) -> bool: ...
    @property
    def index(self) -> int | None: ...  # this replica group's number

    @property
    def gate(self) -> Callable[[Any, int], int] | None: ...  # the step a training loader draws next
    @property
    def in_step(self) -> bool: ...  # a step's gradients still go across the groups and its commit is open
    @property
    def step_committed(self) -> bool: ...

    def evaluation_membership(self, membership: Membership) -> Membership | None: ...
    def sum(self, value: torch.Tensor) -> torch.Tensor: ...
    def reduce_gradients(self, parameters: list[torch.Tensor]) -> None: ...
    def commit(self) -> bool: ...
    def save(self, save: Save, path: str | Path, state: dict[str, Any], blocking: bool,
             metadata: dict[str, Any] | None, on_commit: Callable[[], None] | None) -> float: ...
    def resumed(self, state: dict[str, Any], metadata: dict[str, Any] | None, step: int) -> None: ...
    def join(self, state: dict[str, Any], step: int) -> None: ...
    def step_times(self) -> dict[str, Any]: ...  # the groups' pace, as ``rt.step_times()`` adds it
    def close(self) -> None: ...


class NoReplicas:
    """The job alone: its data-parallel ranks are every rank there is."""

    fault_tolerant = False
    index = None
    gate = None
    in_step = False
    step_committed = True

    def evaluation_membership(self, membership: Membership) -> Membership | None:
        return None  # evaluation follows the training membership, which never changes

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def reduce_gradients(self, parameters: list[torch.Tensor]) -> None:
        return None

    def commit(self) -> bool:
        return True

    def save(self, save: Save, path: str | Path, state: dict[str, Any], blocking: bool,
             metadata: dict[str, Any] | None, on_commit: Callable[[], None] | None) -> float:
        return save(path, state, blocking, metadata, on_commit)

    def resumed(self, state: dict[str, Any], metadata: dict[str, Any] | None, step: int) -> None:
        return None  # nothing to join

    def join(self, state: dict[str, Any], step: int) -> None:
        raise UsageError("rt.join is for a fault-tolerant job: give Runtime(fault_tolerance=...) or start it "
                         "with `lockstep run --fault-tolerant`.")

    def step_times(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        return None


def replication_for(fault_tolerance: Any, membership: Membership, rank: int, world_size: int, device: torch.device,
                    say: Callable[[str], None], seed: int) -> Replication:
    """The job alone (no ``fault_tolerance``), or one replica group of a fault-tolerant job, whose data-parallel
    membership then spans the live replica groups of each step: chosen once, when the Runtime starts."""
    if fault_tolerance is None:
        return NoReplicas()
    from lockstep.runtime.fault_tolerance.groups import ReplicaGroups  # torchft: only where it runs

    return ReplicaGroups(fault_tolerance, membership, rank, world_size, device, say, seed)
