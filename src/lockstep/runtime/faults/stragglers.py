"""Stragglers: a rank slower than its peers, found from every rank's step times and named while the job runs.

Each rank times its training steps without synchronising anything (``StepClock``): the step (from one
training batch handed out to the next), the wait for the next batch, the forward and the backward. On
CUDA the forward and backward are device times, from events read once they are done (a step or more
later), never a synchronize. The heartbeat thread writes the newest steps to the rendezvous store with
the seconds the training thread spent runnable but not running (``/proc``'s run-queue time: a busy
host), and on rank 0 reads every rank's and judges (``StragglerJudge``).

The judge compares each rank's own work in a step (the step less its wait for the other ranks' gradients
at the backward's end) with the median of the ranks of its pipeline stage (in a pair: the other rank).
A rank above ``factor`` times that median, by more than a few percent of the step, for ``PATIENCE``
consecutive steps, is named in one line on rank 0: who (rank, host, local rank), its own work against
the median, and where the extra time goes: data loading, its forward, waiting for a CPU (a busy host),
or its own code between steps. Said again only when it changes; ``LOCKSTEP_STRAGGLER_FACTOR=0`` turns
the whole report off (docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import json
import socket
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from itertools import takewhile
from operator import attrgetter
from pathlib import Path
from typing import Any, NamedTuple

import torch

from lockstep.env.lines import printable
from lockstep.env.settings import straggler_factor_from_environ, straggler_summary_from_environ
from lockstep.runtime.files import write_atomic

PATIENCE = 4  # consecutive slow steps before a rank is named
KEPT = 32  # the newest steps each rank publishes, and the judge compares
TICK_S = 0.5  # how often the heartbeat publishes steps (and rank 0 judges) while steps are timed
JUDGE_SHARE_INVERSE = 100  # rank 0 judges again only after 100 times the CPU its last judgement took (1 %)
MIN_EXCESS = 0.05  # a slow step's excess must also be this share of the median step (and 1 ms): not noise
COLLECTIVE = "collective"  # a span of lockstep's own collectives (``Watchdog.watch``)


def run_queue_s(thread_id: int | None) -> float | None:
    """Seconds the thread waited runnable for a CPU since it started (Linux schedstat), None elsewhere."""
    if thread_id is None:
        return None
    try:
        fields = Path(f"/proc/self/task/{thread_id}/schedstat").read_text().split()
        return int(fields[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class StepClock:
    """This rank's step times: written by the training thread, read by the heartbeat thread.

    A record is ``(n, step_s, data_s, forward_s, backward_s, wait_s, collective_s)`` for the n-th step timed.
    ``wait_s`` is the part of the backward after the model's last gradient was computed: the wait for the
    other ranks' gradients (the whole backward where that moment is not seen: no gradient hook, as under FSDP).
    ``collective_s``: the step's time in lockstep's other collectives (``rt.all_reduce`` of a logged loss, a
    gather, a checkpoint's barrier), where a rank waits for a slower one too.
    A pass's end (an epoch, validation in between) is not a step: the next pass starts the clock again.
    """

    def __init__(self, cuda: bool) -> None:
        self.records: deque[tuple[float, ...]] = deque(maxlen=KEPT)
        self.count = 0
        self.thread = threading.get_native_id()  # the training thread, whose run-queue time is read
        self._cuda = cuda
        self._pending: deque[tuple[int, float, list[Any]]] = deque()  # CUDA: steps whose events are not done
        self._loader: object = None
        self._handed = 0.0  # when the current batch was handed out (host)
        self._waited = 0.0  # the loader's wait then
        self._spans = [0.0] * 4  # forward, backward, the backward's wait, other collectives (host) of the step
        self._events: list[Any] = []  # CUDA: the handout, then each span's (kind, start, end, last gradient)
        self._opened = 0.0
        self._open = -1  # the span being timed: 0 forward, 1 backward, 3 another collective, -1 none
        self._gradient: Any = None  # when the newest gradient was computed (host time; a CUDA event)
        self._hooks: list[Any] = []  # until the first backward ends: a hook on each parameter's gradient
        self._last_hooked = -1  # the index of the parameter whose gradient came last
        self._watched = False
        self.first_queued: float | None = None

    def watch_gradients(self, parameters: list[torch.nn.Parameter]) -> None:
        """Hook the parameters' gradients: the first backward finds whose comes last, which stays hooked.
        Only the first model set up is watched (a later one's backward is timed whole)."""
        if self._watched:
            return
        self._watched = True

        def hook(index: int) -> Callable[[Any], None]:
            def ready(_: Any) -> None:
                self._gradient = _event() if self._cuda else time.perf_counter()
                self._last_hooked = index
            return ready

        self._hooks = [p.register_post_accumulate_grad_hook(hook(i)) for i, p in enumerate(parameters)]

    def batch(self, loader: Any) -> None:
        """A training batch was handed out: the previous one's step ends here."""
        now, waited = time.perf_counter(), loader.wait_s
        if loader is self._loader:
            self.count += 1
            if self._cuda:
                self._step_on_device(waited - self._waited)
            else:
                self.records.append((self.count, now - self._handed, waited - self._waited, *self._spans))
        else:  # a pass starts: what was timed before it is no step's
            self._events = [_event()] if self._cuda else []
            if self.first_queued is None:  # the run-queue time when steps start: the first reading
                self.first_queued = run_queue_s(self.thread)
        self._loader, self._handed, self._waited, self._spans = loader, now, waited, [0.0] * 4

    def pass_ended(self) -> None:
        self._loader, self._events = None, []

    def enter(self, op: str) -> bool:
        """A span begins (``COLLECTIVE``: one of lockstep's other collectives); False where it is not timed."""
        span = 0 if op == "forward" else 1 if op == "backward" else 3 if op == COLLECTIVE else -1
        if span < 0 or self._open >= 0 or (span < 3 and not torch.is_grad_enabled()):  # another scope, inside
            return False  # one, evaluation
        self._open, self._opened, self._gradient = span, time.perf_counter(), None
        if self._cuda:
            self._events.append(_event())
        return True

    def leave(self) -> None:
        if self._open < 0:
            return
        now, span = time.perf_counter(), self._open
        self._spans[span] += now - self._opened
        if span == 1:
            gradient = self._gradient
            self._spans[2] += now - (gradient if isinstance(gradient, float) else self._opened)
            if self._hooks:  # the first backward: keep the hook whose gradient came last
                for index, handle in enumerate(self._hooks):
                    if index != self._last_hooked:
                        handle.remove()
                self._hooks = []
        if self._cuda:
            self._events.append((span, _event(), self._gradient if span == 1 else None))
        self._open = -1

    def _step_on_device(self, data_s: float) -> None:
        """CUDA: the step's spans are device times, taken from its events once they are done."""
        handout = _event()
        if self._events:
            self._pending.append((self.count, data_s, [*self._events, handout]))
        self._events = [handout]
        while self._pending and self._pending[0][2][-1].query():
            n, data, events = self._pending.popleft()
            spans = [0.0] * 4
            try:
                for start, (span, end, gradient) in zip(events[1:-1:2], events[2:-1:2], strict=False):
                    spans[span] += start.elapsed_time(end) / 1e3
                    if span == 1:
                        spans[2] += (gradient or start).elapsed_time(end) / 1e3
                self.records.append((n, events[0].elapsed_time(events[-1]) / 1e3, data, *spans))
            except RuntimeError:  # events of another device or stream: that step is not timed
                continue
        while len(self._pending) > KEPT:  # events that never complete (a stalled stream): not kept forever
            self._pending.popleft()

    def payload(self, host: str, local_rank: int, group: int, queued: list[tuple[int, float]]) -> str:
        """What the heartbeat publishes: who this rank is, its newest run-queue readings (steps counted,
        seconds), its newest steps."""
        steps = [[n, *(round(x, 6) for x in rest)] for n, *rest in list(self.records)]
        return json.dumps({"host": host, "local_rank": local_rank, "group": group, "queued": queued, "steps": steps})

    def mine(self) -> list[dict[str, float]]:
        """The newest steps, as ``rt.step_times()`` gives them."""
        names = ("step", "step_s", "data_s", "forward_s", "backward_s", "wait_s", "collective_s")
        return [dict(zip(names, record, strict=True)) for record in list(self.records)]


def _event() -> Any:
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


class _Rank:
    """What the judge knows of one rank: its published steps and run-queue readings."""

    def __init__(self) -> None:
        self.steps: dict[int, Times] = {}
        self.conflicted: set[int] = set()  # step numbers published with two different times: judged on neither
        self.host, self.local_rank, self.group = "?", -1, 0
        self.queued: list[tuple[int, float]] = []  # (steps counted, run-queue seconds), oldest first

    def take(self, payload: dict[str, Any]) -> None:
        """A rank's published entry, read as untrusted: only bounded numbers and printable text are kept."""
        self.host = printable(payload.get("host", "?"), 64)
        self.local_rank, self.group = _count(payload.get("local_rank"), -1), _count(payload.get("group"), 0)
        for entry in list(payload.get("steps", []))[-KEPT:]:
            n, *times = entry if isinstance(entry, list) and entry else (None,)
            if not isinstance(n, int) or n in self.conflicted:
                continue
            if len(times) not in (5, 6) or not all(_seconds(t) for t in times):  # 5: no other collectives timed
                continue
            reading = Times(*(float(t) for t in times))
            if not reading.consistent():  # parts longer than the whole: not a clock's reading
                continue
            known = self.steps.get(n)
            if known is not None and known != reading:  # a step's times never change: one of them is forged
                del self.steps[n]
                self.conflicted = {*sorted(self.conflicted)[-4 * KEPT:], n}
            elif known is None:
                self.steps[n] = reading
        for n in sorted(self.steps)[:-KEPT]:
            del self.steps[n]
        readings = payload.get("queued")
        if isinstance(readings, list) and 2 <= len(readings) <= KEPT and all(
                isinstance(r, list) and len(r) == 2 and _count(r[0], -1) >= 0 and _seconds(r[1]) for r in readings):
            taken = [(int(n), float(q)) for n, q in readings]
            if all(a[0] < b[0] and a[1] <= b[1] for a, b in zip(taken, taken[1:], strict=False)):
                self.queued = taken

    def queued_per_step(self, first: int, last: int) -> float | None:
        """Run-queue seconds a step over steps ``first``-``last``: between the readings nearest the end of
        the step before ``first`` and the end of ``last`` (readings come at heartbeats, not at every step)."""
        before = [r for r in self.queued if r[0] < first] or self.queued[:1]
        if not before:
            return None
        start = before[-1]
        after = [r for r in self.queued if start[0] < r[0] <= last] or [r for r in self.queued if r[0] > start[0]][:1]
        if not after:
            return None
        end = after[-1]
        return (end[1] - start[1]) / (end[0] - start[0])

    def who(self, rank: int) -> str:
        return f"rank {rank} (host {self.host}, local rank {self.local_rank})"


class Times(NamedTuple):
    """One step of one rank, in seconds."""

    step: float
    data: float
    forward: float
    backward: float
    wait: float  # the backward's wait for the other ranks
    collective: float = 0.0  # the step's time in lockstep's other collectives (where it waits for them too)

    @property
    def own(self) -> float:
        """The rank's own work: the step less its waits for the others."""
        return self.step - self.wait - self.collective

    @property
    def compute(self) -> float:
        return self.forward + self.backward - self.wait

    def consistent(self) -> bool:
        """Whether the parts fit in the whole, as a clock's readings do (the wait is part of the backward;
        the forward and the backward, and the data's wait, lie within the step)."""
        slack = 1e-4 + 1e-3 * self.step
        return (self.wait <= self.backward + slack and self.forward + self.backward + self.collective <= self.step
                + slack and self.data <= self.step + slack)


def _seconds(value: Any) -> bool:
    """A number of seconds a real step could take (no bool, NaN, infinity or absurd size)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1e7


def _count(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**40 else default


class StragglerJudge:
    """Rank 0's view of every rank's steps: names a rank whose own work stays above its peers' median."""

    noun = "rank"  # what is judged, as the lines say it

    def __init__(self, world_size: int, factor: float, say: Callable[[str], None],
                 summary: str | None = None) -> None:
        self.world_size, self.factor, self.say, self.summary = world_size, factor, say, summary
        self.ranks = {rank: _Rank() for rank in range(world_size)}
        self.named: dict[int, str] = {}  # rank -> its cause, as last said
        self.latest: dict[str, float] = {}  # step_time/max_over_median and the slowest rank, newest judged steps
        self._worst: float | None = None  # the largest excess named in the run (its line is the summary)
        self._lock = threading.Lock()

    def read(self, store: Any) -> None:
        """Every rank's newest steps from the store, then a judgement."""
        keys = [f"lockstep/steps/{rank}" for rank in range(self.world_size)]
        if not store.check(keys):  # a rank has not published yet
            return
        for rank, raw in enumerate(store.multi_get(keys)):
            if len(raw) > 64 * KEPT * 16:  # far more than KEPT steps take: not a rank's entry
                continue
            try:
                self.ranks[rank].take(json.loads(raw))
            except Exception:  # noqa: BLE001 - a damaged or hostile entry: that rank waits for its next one
                continue
        self.judge()

    def judge(self) -> None:
        groups: dict[int, list[int]] = {}
        for rank, known in self.ranks.items():
            groups.setdefault(known.group, []).append(rank)
        ratios: list[tuple[float, int]] = []
        for members in groups.values():
            if len(members) > 1:
                ratios += self._judge_group(members)
        if ratios:
            top, slowest = max(ratios)
            with self._lock:
                self.latest = {"step_time/max_over_median": top, "step_time/slowest_rank": float(slowest)}

    def _judge_group(self, members: list[int]) -> list[tuple[float, int]]:
        """Name (or clear) the ranks of ``members`` over their newest common steps. Returns each rank's
        ratio of own work to its peers' median over the newest ``PATIENCE`` steps (their median). The
        peers' median is the other rank's value in a pair, else the group's median (one sort a step: the
        judge's cost grows as ranks x log ranks)."""
        common = sorted(set.intersection(*(set(self.ranks[r].steps) for r in members)))[-2 * PATIENCE:]
        if len(common) < PATIENCE:
            return []
        own = {n: [self.ranks[r].steps[n].own for r in members] for n in common}
        middle = {n: (statistics.median(values), statistics.median(self.ranks[r].steps[n].step for r in members))
                  for n, values in own.items()}
        newest: list[tuple[float, int]] = []
        for index, rank in enumerate(members):
            def peers(n: int, index: int = index) -> float:
                return own[n][1 - index] if len(members) == 2 else middle[n][0]

            newest.append((statistics.median(own[n][index] / peers(n) if peers(n) > 0 else 1.0
                                             for n in common[-PATIENCE:]), rank))
            slow = [own[n][index] > self.factor * peers(n)
                    and own[n][index] - peers(n) > max(1e-3, MIN_EXCESS * middle[n][1]) for n in common]
            run = sum(1 for _ in takewhile(bool, reversed(slow)))  # the newest slow steps in a row
            if run >= PATIENCE:
                self._name(rank, members, common[-run:])
            elif rank in self.named and not any(slow[-PATIENCE:]):  # as many steps in a row to be cleared
                with self._lock:
                    del self.named[rank]
                self.say(f"lockstep: {self._who(rank)} keeps up with its peers again (step {common[-1]}).")
        return newest

    def _name(self, rank: int, members: list[int], steps: list[int]) -> None:
        cause, line, excess = self._explain(rank, [r for r in members if r != rank], steps)
        if self.named.get(rank) == cause:
            return
        with self._lock:
            self.named[rank] = cause
        self.say(line)
        if self._worst is None or excess > self._worst:
            self._worst = excess
            if self.summary:
                _write_atomically(Path(self.summary), line.removeprefix("lockstep: "))

    def _compared(self, rank: int, others: list[int]) -> tuple[list[int], str]:
        """Whom ``rank`` is compared with, as the judgement did (the other of a pair, else the group's median,
        itself included), and how the line says it."""
        if len(others) == 1:
            return others, f"{self.noun} {others[0]}'s"
        return [rank, *others], f"the median of the {len(others) + 1} {self.noun}s compared"

    def _means(self, part: Callable[[Times], float], rank: int, compared: list[int],
               steps: list[int]) -> tuple[float, float]:
        """``part`` of ``rank``'s steps and the median of ``compared``'s, each averaged over ``steps``."""
        return (statistics.fmean(part(self.ranks[rank].steps[n]) for n in steps),
                statistics.fmean(statistics.median(part(self.ranks[r].steps[n]) for r in compared) for n in steps))

    def _explain(self, rank: int, others: list[int], steps: list[int]) -> tuple[str, str, float]:
        """The cause of ``rank``'s extra time over ``steps``, the line that names it, and the excess."""
        compared, label = self._compared(rank, others)
        (own, own_peers), (data, data_peers), (compute, compute_peers), (forward, forward_peers) = (
            self._means(attrgetter(part), rank, compared, steps) for part in ("own", "data", "compute", "forward"))
        excess = own - own_peers
        queued = self.ranks[rank].queued_per_step(steps[0], steps[-1])
        peers_queued = [q for q in (self.ranks[r].queued_per_step(steps[0], steps[-1]) for r in compared)
                        if q is not None]
        queued_peers = statistics.median(peers_queued) if peers_queued else None
        parts = {"data": data - data_peers, "compute": compute - compute_peers}
        parts["own code"] = excess - parts["data"] - parts["compute"]
        if queued is not None and queued_peers is not None and queued - queued_peers >= 0.5 * excess:
            cause, where = "host", (
                f"its training thread waited {_ms(queued)} a step for a CPU (against {_ms(queued_peers)}): "
                "another process busies its cores. Give each rank cores of its own, or move the other work off "
                "this host.")
        else:
            cause = max(parts, key=lambda k: parts[k])
            where = {
                "data": f"it waits {_ms(data)} for each batch (against {_ms(data_peers)}): its data loading is "
                        "slow. Raise num_workers, make __getitem__ cheaper, or check its storage.",
                "compute": f"its forward and backward compute for {_ms(compute)} (against {_ms(compute_peers)}; "
                           f"the forward {_ms(forward)} against {_ms(forward_peers)}): its device computes slower "
                           "(throttled or shared), or it is given more work (longer rows).",
                "own code": f"its own code between the model's steps takes {_ms(parts['own code'])} more (the "
                            "optimizer step, logging or saving on this rank only, a callback).",
            }[cause]
        line = (f"lockstep: {self._who(rank)} is a straggler: the other ranks wait for it in every step's "
                f"collectives. Its own work takes {_ms(own)} a step against {label} {_ms(own_peers)} (steps "
                f"{steps[0]}-{steps[-1]}); {where}")
        return cause, line, excess

    def _who(self, rank: int) -> str:
        return self.ranks[rank].who(rank)

    def report(self) -> dict[str, Any]:
        with self._lock:
            return {**self.latest, "stragglers": {rank: cause for rank, cause in self.named.items()}}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms"


def _write_atomically(path: Path, text: str) -> None:
    with contextlib.suppress(OSError):  # the summary is a courtesy: the line was said already
        write_atomic(path, lambda handle: handle.write((text + "\n").encode()))


class Stragglers:
    """A rank's part in the report: its clock; on rank 0 also the judge. The heartbeat thread calls ``beat``."""

    def __init__(self, rank: int, world_size: int, local_rank: int, group: int, factor: float, cuda: bool,
                 summary: str | None, say: Callable[[str], None]) -> None:
        self.rank, self.local_rank, self.group = rank, local_rank, group  # group: the ranks compared (a pipeline stage)
        self.clock = StepClock(cuda)
        self.judge = StragglerJudge(world_size, factor, say, summary) if rank == 0 else None
        self._say = say
        self._host = socket.gethostname()
        self._published = -1
        self._readings: deque[tuple[int, float]] = deque(maxlen=KEPT)  # run-queue readings at the newest beats
        self._next_judgement = 0.0  # monotonic time of rank 0's next judgement

    def beat(self, store: Any) -> None:
        """Publish this rank's newest steps (when there are new ones); on rank 0, judge every rank's."""
        if not self._readings and self.clock.first_queued is not None:
            self._readings.append((0, self.clock.first_queued))
        queued = run_queue_s(self.clock.thread)
        if queued is not None and self._readings and self.clock.count > self._readings[-1][0]:
            self._readings.append((self.clock.count, queued))  # a reading at each beat with new steps
        if self.clock.count != self._published:
            self._published = self.clock.count
            readings = list(self._readings) if len(self._readings) >= 2 else []
            store.set(f"lockstep/steps/{self.rank}",
                      self.clock.payload(self._host, self.local_rank, self.group, readings))
        if self.judge is not None and time.monotonic() >= self._next_judgement:
            try:
                started = time.thread_time()
                self.judge.read(store)
                # The judgement's computing holds the GIL that rank 0's training thread needs: at most 1 % of its
                # time. This thread's CPU time, not the wall time: waiting for the store holds no GIL.
                self._next_judgement = time.monotonic() + JUDGE_SHARE_INVERSE * (time.thread_time() - started)
            except Exception as error:  # noqa: BLE001 - never the heartbeat's end: the report stops, said once
                self.judge = None
                self._say(f"lockstep: the straggler report stopped ({type(error).__name__}: {error}); training and "
                          "hang reports go on.")

    def report(self) -> dict[str, Any]:
        """``rt.step_times()``: this rank's newest steps; on rank 0 also the judge's view."""
        found = {"steps": self.clock.mine()}
        return {**found, **self.judge.report()} if self.judge is not None else found


def stragglers_for(rank: int, world_size: int, local_rank: int, device_type: str, group: int) -> Stragglers | None:
    """A rank's part of the straggler report; None on one process or with ``LOCKSTEP_STRAGGLER_FACTOR=0``.
    ``group``: the ranks compared with each other (the pipeline stage). Rank 0 says what it finds on stderr."""
    factor = straggler_factor_from_environ()
    if world_size == 1 or not factor:
        return None
    return Stragglers(rank, world_size, local_rank, group, factor, device_type == "cuda",
                      straggler_summary_from_environ(), lambda line: print(line, file=sys.stderr, flush=True))
