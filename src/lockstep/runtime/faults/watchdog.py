"""Where each rank is, kept in the rendezvous store, to explain a collective that fails or times out.

Before each collective that lockstep issues, a rank writes "<collective> #<n> at <file:line>" to the
store, with the loader position (epoch, batch) and the hook it is in. A daemon thread also writes a
heartbeat with the current position every few seconds. When a collective fails (a timeout, a peer
that left), the error names the ranks that did not arrive, where they last were, and whether they
are still alive (a recent heartbeat: stuck in their own code) or silent (dead or frozen).

In debug mode (``LOCKSTEP_DEBUG=1`` or ``Runtime(debug=True)``) the ranks also compare, before
each collective, which collective they are in and the shapes they pass, and a mismatch is an
error that names the ranks and their source lines.
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from lockstep.env.lines import printable
from lockstep.errors import CollectiveError
from lockstep.runtime._torch_compat import default_store
from lockstep.runtime.faults.root_cause import collective_failed, lost_a_peer
from lockstep.runtime.faults.stragglers import COLLECTIVE, TICK_S, Stragglers
from lockstep.runtime.tree import flatten

_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # lockstep/
_SKIPPED = (_PACKAGE + os.sep, os.path.abspath(contextlib.__file__))
# Where a rank's own code is: the innermost frame outside lockstep, installed packages and the standard library.
_NOT_THE_USERS = (_PACKAGE + os.sep, os.path.dirname(os.path.dirname(os.path.abspath(torch.__file__))) + os.sep,
                  os.path.dirname(os.path.abspath(os.__file__)) + os.sep)
_ENDED = "ended the script (Runtime.close)"  # what a rank that closed its Runtime leaves in the store


def _outside(frame: FrameType | None, skipped: tuple[str, ...]) -> FrameType | None:
    """The first frame from ``frame`` outward whose file is not under one of ``skipped``."""
    while frame is not None and _absolute(frame.f_code.co_filename).startswith(skipped):
        frame = frame.f_back
    return frame


@functools.lru_cache(maxsize=4096)
def _absolute(filename: str) -> str:
    """A code object's file name made absolute, once per file (every collective walks a dozen frames)."""
    return os.path.abspath(filename)


def _where(frame: FrameType) -> str:
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


def caller() -> str:
    """``file:line in function`` of the first frame outside lockstep (the user's call site)."""
    frame = _outside(sys._getframe(1), _SKIPPED)
    return _where(frame) if frame is not None else "?"


def current_line(thread_id: int | None) -> str:
    """``file:line in function`` where the thread ``thread_id`` runs its own code now: the innermost frame
    outside lockstep, torch and the standard library (the innermost of all when every frame is theirs)."""
    innermost = sys._current_frames().get(thread_id) if thread_id is not None else None
    frame = _outside(innermost, _NOT_THE_USERS) or innermost
    return _where(frame) if frame is not None else ""


def _printable(text: str, limit: int) -> str:
    """``text`` as a report may quote it: its lines' printable characters, at most ``limit`` of them."""
    kept = printable(text, len(text), lines=True)
    return kept if len(kept) <= limit else kept[:limit] + "..."


class _StepCollectives:
    """Around the step's own collectives (``Watchdog.step``): a collective's failure inside becomes the
    hang report, the model's own errors pass through. A class, not a generator: it runs every step."""

    __slots__ = ("watchdog",)

    def __init__(self, watchdog: Watchdog) -> None:
        self.watchdog = watchdog

    def __enter__(self) -> None:
        clock = self.watchdog.clock
        if clock is not None:
            clock.enter(self.watchdog.op)

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: object) -> None:
        clock = self.watchdog.clock
        if clock is not None:
            clock.leave()
        report = self.watchdog.explain_step(error) if isinstance(error, RuntimeError) else None
        if report is not None:
            raise report from None  # the report quotes the collective's error; its torch trace is noise


def signature(data: Any, exact_shapes: bool) -> str:
    """The tensors' dtypes and shapes (or only dimensions, where shapes may differ by rank)."""
    parts: list[str] = []
    for leaf in flatten(data)[0]:
        if isinstance(leaf, torch.Tensor):
            shape = list(leaf.shape) if exact_shapes else f"{leaf.dim()}-d"
            parts.append(f"{str(leaf.dtype).removeprefix('torch.')}{shape}")
        else:
            parts.append(type(leaf).__name__)
    return ", ".join(parts) if len(parts) < 12 else ", ".join(parts[:12]) + f", ... ({len(parts)} leaves)"


class _Stopped(Exception):
    pass


def _raise_stopped(signum: int, frame: FrameType | None) -> None:
    raise _Stopped


def _sleep_unless_stopped(seconds: float) -> bool:
    """Sleep ``seconds``; False when a SIGTERM cut the sleep short. A launcher stops every rank with
    TERM once one has left (a peer that folded on losing its connection to this one): the report this
    rank is writing is then raised at once, rather than lost with the process."""
    if threading.current_thread() is not threading.main_thread():
        time.sleep(seconds)
        return True
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        time.sleep(seconds)
        return True
    except _Stopped:
        return False
    finally:
        signal.signal(signal.SIGTERM, previous)


class Watchdog:
    """One per Runtime; inactive (free) with a single process.

    A process has one heartbeat, the newest Runtime's: a later Runtime in the same process (a second
    Trainer, a notebook cell run again) ends an earlier one's, so heartbeat threads do not pile up and
    the rank's heartbeat in the store tells where the Runtime in use is, never a stale one.
    """

    _beating: Watchdog | None = None  # the watchdog whose thread writes this process's heartbeat
    _handover = threading.Lock()

    def __init__(self, rank: int, world_size: int, timeout_s: float, debug: bool,
                 stragglers: Stragglers | None = None) -> None:
        self.rank, self.world_size, self.timeout_s, self.debug = rank, world_size, timeout_s, debug
        self.count = 0
        self.op = ""  # the step's scope being entered (forward, backward, ...)
        self.last = "no collective yet"
        # Where this rank is, set cheaply by the loaders and the Trainer; read by mark and the heartbeat.
        self.batch: tuple[str, int, int] | None = None  # (loader kind, epoch, batch index)
        self.stage = ""
        self.store: Any = None
        self._published = self.last  # the ``last`` the store holds for this rank (nothing yet: none)
        self._writing = threading.Lock()  # one writer of this rank's position at a time
        self._thread = threading.get_ident()  # the thread that runs the training loop
        self._step = _StepCollectives(self)
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        if world_size > 1 and dist.is_initialized():
            with contextlib.suppress(Exception):  # without the store, errors just lack the positions
                self.store = default_store()
        self.interval_s = min(5.0, max(0.5, timeout_s / 10))
        self.stragglers = stragglers if self.store is not None else None
        self.clock = self.stragglers.clock if self.stragglers is not None else None
        if self.store is not None:
            with Watchdog._handover:
                if Watchdog._beating is not None:  # superseded: a later stop writes nothing, the rank has not left
                    Watchdog._beating._end_heartbeat()
                Watchdog._beating = self
                self._beat = threading.Thread(target=self._heartbeat, name="lockstep-heartbeat", daemon=True)
                self._beat.start()

    def _key(self, rank: int, kind: str = "where") -> str:
        return f"lockstep/{kind}/{rank}"

    def position(self) -> str:
        """This rank's position: the hook it is in and the batch its loader handed out last."""
        parts = [f"in {self.stage}"] if self.stage else []
        if self.batch is not None:
            kind, epoch, index = self.batch
            parts.append(f"epoch {epoch}, batch {index}" if kind == "train" else f"evaluation batch {index}")
        return ", ".join(parts)

    def mark(self, text: str) -> None:
        """Before a collective lockstep issues: this rank is there (written to the store at once)."""
        with self._writing:
            self.last = text
            self._publish()

    def step(self, op: str) -> _StepCollectives:
        """Around the step's own collectives (the backward's gradient reduction, a sharded forward,
        clipping): this rank is there, in one attribute write that the heartbeat carries to the store;
        their failure is explained as lockstep's own collectives' is."""
        self.count += 1
        self.last = f"{op} #{self.count}"
        self.op = op
        return self._step

    def _publish(self) -> None:
        if self.store is not None:
            text = self.last
            with contextlib.suppress(Exception):
                self.store.set(self._key(self.rank), f"{text}\n{self.position()}")
                self._published = text

    def _heartbeat(self) -> None:
        beat, due = 0, 0.0
        # The step times travel with the heartbeat every TICK_S seconds; the liveness beat stays at interval_s.
        tick = min(self.interval_s, TICK_S) if self.stragglers is not None else self.interval_s
        while True:
            try:
                if time.monotonic() >= due:
                    due, beat = time.monotonic() + self.interval_s - tick / 2, beat + 1
                    if self.last != self._published:  # a step's collective noted since the last beat
                        with self._writing:
                            self._publish()
                    now = current_line(self._thread)
                    position = ", ".join(p for p in (self.position(), f"now at {now}" if now else "") if p)
                    self.store.set(self._key(self.rank, "alive"), f"{beat} {position}")
                if self.stragglers is not None:
                    self.stragglers.beat(self.store)
            except Exception:  # noqa: BLE001 - the store is gone (shutdown, the agent stopped)
                return
            if self._stop.wait(tick):
                return

    def _end_heartbeat(self) -> None:
        """End this watchdog's heartbeat (when its Runtime closes, or a newer one in the process takes over)."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=2 * self.interval_s)

    def stop(self) -> None:
        """Record that this rank left and end the heartbeat (before the group and its store go)."""
        if self._stop.is_set():
            return
        failed = getattr(sys, "last_value", None)  # set while an uncaught exception ends the process
        self.mark(f"failed with {type(failed).__name__} after {self.last}" if failed is not None
                  else f"{_ENDED} after {self.last}")
        self._end_heartbeat()

    @contextlib.contextmanager
    def watch(self, op: str, data: Any = None, exact_shapes: bool = True) -> Iterator[None]:
        """Around one collective: record where this rank is, check in debug mode, explain failures."""
        if self.world_size == 1:
            yield
            return
        self.count += 1
        where = caller()
        self.mark(f"{op} #{self.count} at {where}")
        if self.debug:
            self._compare(op, signature(data, exact_shapes), where)
        timed = self.clock is not None and self.clock.enter(COLLECTIVE)  # a wait for the others, as the backward's
        try:
            yield
        except CollectiveError:
            raise
        except RuntimeError as error:
            raise self.explain(error) from error
        finally:
            if timed:
                self.clock.leave()  # type: ignore[union-attr]

    def explain_step(self, error: BaseException) -> CollectiveError | None:
        """For an error raised inside the step's own collectives (``step``): the report, when
        it is a collective's failure (a timeout, a lost peer), else None (the model's own error)."""
        if self.world_size == 1 or isinstance(error, CollectiveError) or not collective_failed(error):
            return None
        return self.explain(error, op=f"{self.last} at {current_line(threading.get_ident())}")

    def _compare(self, op: str, sig: str, where: str) -> None:
        mine = (op, self.count, sig, where)
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, mine)
        if all(entry[:3] == mine[:3] for entry in everyone):
            return
        lines = [f"  rank {r}: {o} #{n} with ({s}) at {w}" for r, (o, n, s, w) in enumerate(everyone)]
        raise CollectiveError(
            "the ranks disagree about this collective (LOCKSTEP_DEBUG): every rank must call the same "
            "collectives in the same order, with the same shapes.\n" + "\n".join(lines)
        )

    def positions(self, kind: str = "where") -> dict[int, str]:
        """What each rank last wrote under ``kind`` (ranks that never wrote are missing)."""
        found: dict[int, str] = {}
        if self.store is None:
            return found
        for rank in range(self.world_size):
            key = self._key(rank, kind)
            with contextlib.suppress(Exception):
                if self.store.check([key]):  # read as untrusted: what a report quotes, bounded and printable
                    found[rank] = _printable(self.store.get(key)[:8192].decode(errors="replace"), 1000)
        return found

    def _liveness(self, ranks: list[int]) -> dict[int, str]:
        """'; alive (...), in training_step, ...' or '; no heartbeat for 7.5s ...' for each of ``ranks``.

        Heartbeats are counters, read twice on this rank's clock, so that no other node's clock is
        compared with this one's: skewed clocks can neither fake a silent rank nor hide one.
        """
        first = self.positions("alive")
        if not any(rank in first for rank in ranks):
            return {}
        wait = 1.5 * self.interval_s
        if not _sleep_unless_stopped(wait):
            return {}  # the launcher stops this rank (a peer left): the report now, without the heartbeats
        second = self.positions("alive")
        found = {}
        for rank in ranks:
            if rank not in second:
                continue
            count, _, position = second[rank].partition(" ")
            if first.get(rank, "").partition(" ")[0] != count:
                found[rank] = f"; alive (a heartbeat within {wait:g}s)" + (f", {position}" if position else "")
            else:
                found[rank] = f"; no heartbeat for {wait:g}s (the process died or is frozen)"
        return found

    def explain(self, error: BaseException, op: str | None = None) -> CollectiveError:
        """A CollectiveError naming the ranks that are not where this rank is, and where they were."""
        here = op or self.last
        positions = self.positions()
        elsewhere: dict[int, str] = {}
        level: dict[int, str] = {}  # the ranks as far as this one: inside a step's scope, maybe still in their own code
        for r, entry in positions.items():
            text, _, where = entry.partition("\n")  # as ``mark`` stored it
            if r != self.rank:
                (elsewhere if text != self.last else level)[r] = f"{text} ({where})" if where else text
        silent = [r for r in range(self.world_size) if r not in positions and r != self.rank]
        reason = str(error).splitlines()[0][:200]
        lost = lost_a_peer(str(error))
        lines = [f"rank {self.rank}: {here} failed ({reason})."]
        ended = sorted(r for r, text in elsewhere.items() if text.startswith(_ENDED))
        if ended:
            lines.append(f"Rank{'s' if len(ended) > 1 else ''} {', '.join(map(str, ended))} ended the script while "
                         "this rank still waits in a collective: every rank must run the same collectives. Code "
                         "under `if rank == 0:` that validates, saves or syncs a metric is the usual cause; so is a "
                         "collective inside a loop over rt.eval_loader, whose shards differ in length by rank "
                         "(gather once, after the loop: rt.gather(outputs)).")
        elif lost:
            lines.append("A peer closed its connection: it crashed or was killed; its own error names the cause.")
        if elsewhere or silent:
            # a peer that just closed its connection beat a moment ago: no heartbeat to read then
            beats = {} if lost else self._liveness(sorted(elsewhere) + silent)
            lines.append("These ranks did not arrive at it:")
            lines += [f"  rank {r}: last at {p}{beats.get(r, '')}" for r, p in sorted(elsewhere.items())]
            lines += [f"  rank {r}: never reached a lockstep collective{beats.get(r, '')}" for r in silent]
        else:
            # A step's scope (a forward, a backward) also runs the rank's own code: a rank stuck there has the
            # same mark as this one, but its heartbeat says where it is now.
            beats = {} if lost else self._liveness(sorted(level))
            if beats:
                lines.append(f"Every rank got as far as {self.last}, whose scope also runs each rank's own code. "
                             "Where the others are now:")
                lines += [f"  rank {r}: last at {level[r]}{beats[r]}" for r in sorted(beats)]
            else:
                lines.append("Every rank reached this collective: a rank may have died inside it, or the "
                             "network between the nodes failed.")
        lines.append(f"Collectives wait at most {self.timeout_s:g}s (Runtime(timeout=...), LOCKSTEP_TIMEOUT). "
                     "Every rank must call the same collectives in the same order; LOCKSTEP_DEBUG=1 checks it.")
        return CollectiveError("\n".join(lines))

