"""The replica groups' pace: a group that the others wait for is named as a group.

Each rank measures its own time in a step: from the end of one cross-group gradient all-reduce to the
start of the next (its data, forward, backward and its group's own collectives; the vote and the quorum,
where every group stands together once the all-reduce has synchronised them). That time of the previous
step rides in the same all-reduce as the gradients: ``participants`` numbers more in the one tensor,
each participant's in its own slot, the others zero, so the sum holds every participant's. No extra
collective, and no host sync: on CUDA the numbers are read once their copy to the host is done.

The first participant's rank 0 judges the groups as the straggler report judges ranks
(``faults/stragglers.py``), and says a slow group in one line on its output.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from operator import attrgetter
from typing import Any

import torch

from lockstep.env.settings import straggler_summary_from_environ
from lockstep.runtime.faults.stragglers import KEPT, StragglerJudge, Times, _ms, _Rank


class GroupJudge(StragglerJudge):
    """The straggler judge over replica groups, which join and leave: it compares the groups of each step."""

    noun = "group"

    def __init__(self, factor: float, say: Callable[[str], None]) -> None:
        super().__init__(0, factor, say, straggler_summary_from_environ())

    def feed(self, step: int, own: dict[int, float]) -> None:
        """Each participating group's own time (seconds) in ``step``."""
        for group, seconds in own.items():
            known = self.ranks.setdefault(group, _Rank())
            known.steps[step] = Times(seconds, 0.0, 0.0, 0.0, 0.0)
            for old in sorted(known.steps)[:-KEPT]:
                del known.steps[old]
        if len(own) > 1:
            ratios = self._judge_group(sorted(own))
            if ratios:
                top, slowest = max(ratios)
                with self._lock:
                    self.latest = {"step_time/groups_max_over_median": top, "step_time/slowest_group": float(slowest)}

    def _who(self, rank: int) -> str:
        return f"replica group {rank}"

    def _explain(self, rank: int, others: list[int], steps: list[int]) -> tuple[str, str, float]:
        compared, label = self._compared(rank, others)
        own, peers = self._means(attrgetter("step"), rank, compared, steps)
        line = (f"lockstep: replica group {rank} is a straggler: the other groups wait for it in every step's "
                f"cross-group all-reduce. Its own step takes {_ms(own)} against {label} {_ms(peers)} (steps "
                f"{steps[0]}-{steps[-1]}); its own output names a slow rank inside it, if one is.")
        return "group", line, own - peers

    def report(self) -> dict[str, Any]:
        with self._lock:
            return {**self.latest, "group_stragglers": dict(self.named)}


class GroupPace:
    """One rank's part: its own time of the previous step into the all-reduce, the sum read back. Every
    participant appends its slots, the report on or off, so that the all-reduced tensors have one length."""

    def __init__(self, factor: float, say: Callable[[str], None], judges: bool) -> None:
        self.judge = GroupJudge(factor, say) if judges and factor else None
        self._say = say
        self._ended: float | None = None  # when the last cross-group all-reduce ended
        self._fed = -1  # the newest step judged (a step that did not commit comes again under its number)
        self._pending: deque[tuple[Any, torch.Tensor, list[int], int]] = deque()  # CUDA: copies not yet done

    def slots(self, participant: int, participants: int, like: torch.Tensor) -> torch.Tensor:
        """This rank's row: its own time in slot ``participant`` (0 before its first full step), made on
        the gradients' device without a copy from the host."""
        now = time.perf_counter()
        own = now - self._ended if self._ended is not None and self.judge is not None else 0.0
        row = torch.zeros(participants, dtype=like.dtype, device=like.device)
        row[participant] = min(own, 1e6)
        return row

    def reduced(self, summed: torch.Tensor, members: list[int], step: int, valid: bool) -> None:
        """After the all-reduce: ``summed`` holds every participant's time (``members``: their groups)."""
        self._ended = time.perf_counter()
        if self.judge is None or not valid:
            return
        try:
            if summed.device.type == "cpu":
                self._judge(summed.tolist(), members, step)
                return
            while self._pending and self._pending[0][0].query():
                _, values, members_then, step_then = self._pending.popleft()
                self._judge(values.tolist(), members_then, step_then)
            event, host = torch.cuda.Event(), summed.to("cpu", non_blocking=True)
            event.record()
            self._pending.append((event, host, members, step))
            while len(self._pending) > KEPT:
                self._pending.popleft()
        except Exception as error:  # noqa: BLE001 - the training step goes on: the report stops, said once
            self.judge = None
            self._say(f"lockstep: the replica groups' straggler report stopped ({type(error).__name__}: {error}); "
                      "training goes on.")

    def _judge(self, values: list[float], members: list[int], step: int) -> None:
        """The previous step's times (zero: a participant that has no full step yet)."""
        if self.judge is None or step - 1 <= self._fed:
            return
        self._fed = step - 1
        own = {group: value for group, value in zip(members, values, strict=False) if 0 < value < 1e6}
        self.judge.feed(step - 1, own)

    def report(self) -> dict[str, Any]:
        return self.judge.report() if self.judge is not None else {}
