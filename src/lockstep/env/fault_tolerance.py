"""Fault tolerance's side of the launcher <-> worker contract: what ``lockstep run --fault-tolerant``
tells each replica group's processes, and the one step timeout every other wait derives from.
The groups themselves are ``lockstep.runtime.fault_tolerance.groups``; the lighthouse and the
supervisor of the groups, ``lockstep.runtime.launch.replicas``."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from lockstep.errors import ConfigError, MissingExtraError

#: What ``lockstep run --fault-tolerant`` hands each replica group's processes.
ENV_ON, ENV_GROUP, ENV_LIGHTHOUSE = "LOCKSTEP_FAULT_TOLERANT", "LOCKSTEP_REPLICA_GROUP", "LOCKSTEP_LIGHTHOUSE"
ENV_MIN_REPLICAS, ENV_STEP_TIMEOUT = "LOCKSTEP_MIN_REPLICAS", "LOCKSTEP_STEP_TIMEOUT"
ENV_START_WITH = "LOCKSTEP_REPLICA_START_WITH"  # the groups a group's first quorum waits for


@dataclass(frozen=True)
class Timeouts:
    """Every wait of a fault-tolerant job, in seconds, derived from the one step timeout."""

    quorum: float     # a step waits this long for at least ``min_replicas`` live groups, then fails naming them
    collective: float  # the cross-group all-reduce, the commit vote and a state transfer to a joining group
    connect: float    # reaching the lighthouse and the group's manager
    heartbeat: float  # a group whose heartbeats stop this long is dropped from the next quorum
    join: float       # the lighthouse waits this long for a live group that has not asked for the quorum


@dataclass(frozen=True)
class FaultTolerance:
    """Replica groups that may die and join while the others train on (``Runtime(fault_tolerance=...)``).

    Args:
        min_replicas: the fewest live groups a step may run with; with fewer, a step waits up to
            ``step_timeout`` and then the job ends with an error naming the missing groups.
        step_timeout: seconds one step may wait for anything (the other groups, a collective, a
            state transfer); every torchft timeout derives from it (``timeouts``).
        replica_group: this group's index (default ``LOCKSTEP_REPLICA_GROUP``, which ``lockstep run
            --fault-tolerant`` sets).
        lighthouse: the lighthouse's address (default ``LOCKSTEP_LIGHTHOUSE``).
        start_with: the groups this group's first quorum waits for, up to ``step_timeout``, before it
            trains with fewer and says so (``LOCKSTEP_REPLICA_START_WITH``). ``lockstep run
            --fault-tolerant`` sets every group of the job for the groups it starts together, so that a
            group slow to start is not left out of step 0 (and healed at step 1), and 2 for a replacement
            of a group that died: a live group, rather than training alone.
    """

    min_replicas: int = 1
    step_timeout: float = 30.0
    replica_group: int | None = None
    lighthouse: str | None = None
    start_with: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.min_replicas, int) or isinstance(self.min_replicas, bool) or self.min_replicas < 1:
            raise ConfigError(f"FaultTolerance(min_replicas={self.min_replicas!r}): a whole number of at least 1.")
        if not isinstance(self.start_with, int) or isinstance(self.start_with, bool) or self.start_with < 1:
            raise ConfigError(f"FaultTolerance(start_with={self.start_with!r}): a whole number of at least 1.")
        if not isinstance(self.step_timeout, (int, float)) or not self.step_timeout > 0:
            raise ConfigError(f"FaultTolerance(step_timeout={self.step_timeout!r}): a positive number of seconds.")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> FaultTolerance | None:
        """What ``lockstep run --fault-tolerant`` asked for, or None when it did not."""
        env = os.environ if environ is None else environ
        if env.get(ENV_ON, "") != "1":
            return None
        try:
            return cls(min_replicas=int(env.get(ENV_MIN_REPLICAS, "1")),
                       step_timeout=float(env.get(ENV_STEP_TIMEOUT, "30")),
                       start_with=int(env.get(ENV_START_WITH, "1")))
        except ValueError as error:
            raise ConfigError(f"{ENV_MIN_REPLICAS}, {ENV_STEP_TIMEOUT} or {ENV_START_WITH} is not a number: "
                              f"{error}") from None

    def timeouts(self) -> Timeouts:
        """The derivation: every wait that can end a step is the step timeout itself; a dead group is
        found by its heartbeats (sent every 0.1 s), within a twentieth of it (at least 1 s, at most
        5 s: 1.5 s for the default 30 s), which is most of the stall a death costs the others.

        The lighthouse waits up to half the step timeout for every live (heartbeating) group to ask for
        the quorum, and forms it at once when all have. Its wait counts from the first group that asked,
        which may be one left out of the last quorum and waiting since: with a wait shorter than a step,
        that group and the first other to ask would form the next quorum at once, leaving out the third,
        and so on at every step (each step a group healing from a peer; seen with a wait of 0.5 s and
        steps of 0.6 s). Steps must therefore be shorter than half the step timeout, as they are with
        any sensible one; a group still not asking after that is left out and heals at the next step."""
        step = float(self.step_timeout)
        heartbeat = min(max(step / 20, 1.0), 5.0)
        return Timeouts(quorum=step, collective=step, connect=step, heartbeat=heartbeat, join=step / 2)

    def resolved(self, environ: Mapping[str, str] | None = None) -> FaultTolerance:
        """With the replica group and the lighthouse filled in from the environment; an error naming
        what is missing."""
        env = os.environ if environ is None else environ
        group, lighthouse = self.replica_group, self.lighthouse or env.get(ENV_LIGHTHOUSE)
        if group is None:
            raw = env.get(ENV_GROUP)
            try:
                group = int(raw) if raw is not None else None
            except ValueError:
                raise ConfigError(f"{ENV_GROUP}={raw!r}: a replica group's index is a whole number.") from None
        if group is None or group < 0 or not lighthouse:
            raise ConfigError(
                "fault tolerance needs this replica group's index and the lighthouse's address: start the job "
                f"with `lockstep run --fault-tolerant`, or set {ENV_GROUP} (0, 1, ...) and {ENV_LIGHTHOUSE} "
                "(host:port of a lighthouse, lockstep.runtime.launch.replicas.Lighthouse), or give "
                "FaultTolerance(replica_group=..., lighthouse=...).")
        if "://" not in lighthouse:
            lighthouse = f"http://{lighthouse}"
        return FaultTolerance(self.min_replicas, self.step_timeout, group, lighthouse, self.start_with)


def import_torchft() -> Any:
    """torchft, its lighthouse's and managers' per-step log lines and its warnings silenced: lockstep
    says each event in one line (set ``RUST_LOG``, or the ``torchft`` logger's level, to see them)."""
    os.environ.setdefault("RUST_LOG", "warn")
    try:
        import torchft
    except ImportError as error:
        raise MissingExtraError("fault tolerance needs torchft: pip install 'lockstep[ft]'") from error
    quiet = logging.getLogger("torchft")
    if quiet.level == logging.NOTSET:
        quiet.setLevel(logging.CRITICAL)
    warnings.filterwarnings("ignore", module=r"torchft(\.|$)")
    return torchft
