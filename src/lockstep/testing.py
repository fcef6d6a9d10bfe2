"""Multi-process test harness: run a function on N ranks over Gloo on loopback, bounded in time.

    from lockstep.testing import run_ranks

    def check(scale):
        rt = lockstep.Runtime(accelerator="cpu")
        return rt.all_reduce(torch.tensor(float(rt.rank)) * scale, op="sum")

    assert [float(v) for v in run_ranks(check, 3, 2.0)] == [6.0, 6.0, 6.0]

Each rank runs in a fresh spawned process with a ready Gloo process group on a free loopback
port. The function may be a closure or a lambda (it travels by value).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lockstep.runtime.launch.spawn import RankOutcome, spawn

DEFAULT_TIMEOUT_S = 120.0


class RanksFailed(AssertionError):
    """One or more ranks failed; ``outcomes`` holds every rank's result or traceback."""

    def __init__(self, outcomes: list[RankOutcome]) -> None:
        self.outcomes = outcomes
        parts = [f"--- rank {o.rank} ---\n{o.error}" for o in outcomes if not o.ok]
        super().__init__(f"{len(parts)} of {len(outcomes)} ranks failed:\n" + "\n".join(parts))


def rank_outcomes(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S
) -> list[RankOutcome]:
    """Every rank's outcome (value or traceback), indexed by rank; never raises for a rank's failure."""
    return spawn(fn, world_size, args, backend="gloo", timeout=timeout, keep_all=True)


def run_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = DEFAULT_TIMEOUT_S
) -> list[Any]:
    """Every rank's return value, indexed by rank; raises ``RanksFailed`` if any rank failed."""
    outcomes = rank_outcomes(fn, world_size, *args, timeout=timeout)
    if not all(o.ok for o in outcomes):
        raise RanksFailed(outcomes)
    return [o.value for o in outcomes]
