"""Node-level liveness for ``lockstep run`` on several nodes: heartbeats and failure notices.

Each node's launcher (the torch elastic agent's process) runs one NodeWatch thread. Through the
rendezvous store it

- bumps a counter of its own every ``INTERVAL_S`` (its heartbeat);
- reads the other nodes' counters, and notes with its *own* monotonic clock when each last
  changed. A node whose counter has not changed for ``WINDOW_S`` is lost. No wall clock of
  another node is ever compared with this node's, so skewed clocks cannot fake or hide a loss;
- publishes this node's failure (the root cause its agent reported), and watches for another
  node's.

With a job secret (``LOCKSTEP_JOB_SECRET``, else the SLURM job id), every value this watch writes
carries an HMAC of its key and value: a notice that does not is ignored, so whoever else reaches
the store cannot stop the job, or hide a lost node, with a forged one.

A failure elsewhere, or the loss of the store itself, calls ``on_stop(verdict)``: this node
cannot go on. A silent node calls ``on_lost(verdict, since_s)``, where ``since_s`` is how long
ago it was last heard of: a fixed-size job stops too (every node exits non-zero, naming the
cause); an elastic job ends this node's workers so that the agent re-forms the group without it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import hmac
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from lockstep.runtime.comm.network import listening

INTERVAL_S = 1.0
WINDOW_S = 10.0
_PREFIX = "lockstep/nodes"


class NodeWatch:
    """One node's heartbeat and watch over the others (see the module docstring)."""

    def __init__(self, host: str, port: int, label: str, on_stop: Callable[[str], None],
                 on_lost: Callable[[str, float], None], hosts_store: bool = False,
                 interval_s: float = INTERVAL_S, window_s: float = WINDOW_S, secret: bytes | None = None) -> None:
        """``label`` names this node in the others' messages, e.g. ``node 1 (gpu7, 10.0.0.2)``;
        ``hosts_store``: this node's process hosts the store, which ends with it; ``secret``: the
        job's secret, which signs and checks every message (None: messages are not signed)."""
        self._secret = secret
        self._forged_seen = False
        self.host, self.port, self.name, self.hosts_store = host, port, label, hosts_store
        self._finished = False  # the job ended well: the store may go away
        self.on_stop, self.on_lost = on_stop, on_lost
        self.interval_s, self.window_s = interval_s, window_s
        self.index: int | None = None
        self.store: Any = None
        self.connected = threading.Event()
        self._seen: dict[int, tuple[str, float]] = {}  # node index -> (last counter seen, local time)
        self._reported: set[int] = set()
        self.verdict = ""  # what ended the watch: another node's failure or loss
        self._silent_for = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lockstep-node-watch", daemon=True)

    def start(self) -> NodeWatch:
        self._thread.start()
        return self

    def stop(self, done: bool) -> None:
        """End the watch; ``done``: this node finished, so the others must not count it as lost.

        The node hosting the store says the job finished and waits two heartbeats, so that the
        others do not take the store's end for a lost node while they finish too.
        """
        self._stop.set()
        if done and self.store is not None and self.index is not None:
            self._bounded(lambda: self._put(f"{self.index}/beat", "done"))
            if self.hosts_store and self._bounded(lambda: self._put("finished", "1")):
                time.sleep(2 * self.interval_s)

    def publish_failure(self, cause: str) -> None:
        """Tell the other nodes that this node's workers failed, and why (one line).

        Waits two heartbeats before returning: the node hosting the store keeps it up until the
        others have read the cause, rather than leaving them with a lost connection.
        """
        notice = f"{self.name}: {cause}"
        self.connected.wait(self.window_s)  # a node that fails at once may not have reached the store yet
        if self.store is not None and self._bounded(lambda: self._put("failed", notice)):
            time.sleep(2 * self.interval_s)

    def failure_elsewhere(self, wait_s: float) -> str:
        """Another node's failure notice, waiting up to ``wait_s`` for it ('' when none came)."""
        found: list[str] = []

        def poll() -> None:
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                text = self._read("failed")
                if text is not None:
                    if not text.startswith(self.name + ":"):
                        found.append(text)
                    return
                time.sleep(0.1)

        if self.store is not None:
            self._bounded(poll, wait_s + 1)
        return found[0] if found else ""

    def _bounded(self, operation: Callable[[], object], limit_s: float | None = None) -> bool:
        """Run store operations for at most ``limit_s`` (the window; see ``_run``); True when they succeeded."""
        done = threading.Event()

        def attempt() -> None:
            with contextlib.suppress(Exception):
                operation()
                done.set()

        threading.Thread(target=attempt, daemon=True).start()
        return done.wait(limit_s or self.window_s)

    # -- the thread ------------------------------------------------------------------------
    def _connect(self) -> bool:
        import torch.distributed as dist

        while not self._stop.is_set():
            if not listening(self.host, self.port, 2 * self.interval_s):  # quiet, where torch's tries log traces
                self._stop.wait(self.interval_s)
                continue
            try:
                store = dist.TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                                      timeout=timedelta(seconds=2 * self.interval_s))  # short tries
                store.set_timeout(timedelta(seconds=self.window_s))
                self.store = store
                self.index = int(self.store.add(f"{_PREFIX}/count", 1)) - 1
                self._put(f"{self.index}/name", self.name)
                self.connected.set()
                return True
            except Exception:  # noqa: BLE001 - the store is not up yet (the master starts later)
                self._stop.wait(self.interval_s)
        return False

    def _run(self) -> None:
        if not self._connect():
            return
        # A store operation over a link that went down can block for good, whatever the store's
        # timeout: each round runs in a helper thread, and a round with no answer within the
        # window is a lost connection.
        rounds = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="lockstep-node-beat")
        beat = 0
        while not self._stop.is_set():
            beat += 1
            try:
                verdict = rounds.submit(self._round, beat).result(timeout=self.window_s)
            except Exception as error:  # noqa: BLE001 - the store's host is gone or unreachable
                if self._stop.is_set() or self._finished:
                    break
                reason = str(error).splitlines()[0][:120] if str(error) else f"no answer for {self.window_s:g}s"
                verdict = (f"lost the connection to the rendezvous store at {self.host}:{self.port} "
                           f"({reason}): the node hosting it died or the network to it failed")
                self._silent_for = 0.0
            if verdict and self._stop.is_set():  # this node's launcher is ending the watch (its workers are
                break  # done): a late verdict must not stop it, nor raise in it after its run returned
            if verdict:
                self._stop.set()
                self.verdict = verdict
                if self._silent_for:
                    self.on_lost(verdict, self._silent_for)
                else:
                    self.on_stop(verdict)
                break
            self._stop.wait(self.interval_s)
        rounds.shutdown(wait=False)

    def _round(self, beat: int) -> str:
        self._put(f"{self.index}/beat", str(beat))
        return self._check()

    def _check(self) -> str:
        """'' while all is well, else what went wrong elsewhere, in one line."""
        if self._read("finished") is not None:
            self._finished = True
            return ""
        text = self._read("failed")
        if text is not None and not text.startswith(self.name + ":"):
            return text
        now = time.monotonic()
        count = int(self.store.add(f"{_PREFIX}/count", 0))
        for index in range(count):
            if index == self.index or index in self._reported:
                continue
            value = self._read(f"{index}/beat")
            if value is None:
                continue
            previous = self._seen.get(index)
            if value == "done":
                self._reported.add(index)
            elif previous is None or _newer(value, previous[0]):
                self._seen[index] = (value, now)
            elif now - previous[1] > self.window_s:
                self._reported.add(index)
                self._silent_for = now - previous[1]
                name = self._read(f"{index}/name") or f"node watch {index}"
                return (f"{name} sent no heartbeat for {now - previous[1]:.0f}s (window "
                        f"{self.window_s:g}s): its launcher died, or the network to it failed")
        return ""

    # -- signed messages -------------------------------------------------------------------
    def _put(self, key: str, value: str) -> None:
        self.store.set(f"{_PREFIX}/{key}", value if self._secret is None else f"{value}|{self._mac(key, value)}")

    def _read(self, key: str) -> str | None:
        """The value at ``key``; None when there is none, or when it does not carry this job's
        signature (said once: somebody else writes into the job's store)."""
        if not self.store.check([f"{_PREFIX}/{key}"]):
            return None
        raw = self.store.get(f"{_PREFIX}/{key}").decode(errors="replace")
        if self._secret is None:
            return raw
        value, _, mac = raw.rpartition("|")
        if hmac.compare_digest(mac, self._mac(key, value)):
            return value
        if not self._forged_seen:
            self._forged_seen = True
            print(f"lockstep: ignored a message in the rendezvous store ({key}) that is not signed with this "
                  f"job's secret: something other than this job writes to {self.host}:{self.port}.",
                  file=sys.stderr, flush=True)
        return None

    def _mac(self, key: str, value: str) -> str:
        assert self._secret is not None
        return hmac.new(self._secret, f"{key}\0{value}".encode(), hashlib.sha256).hexdigest()


def _newer(value: str, previous: str) -> bool:
    """A heartbeat counter that moved on (a replayed older value does not count)."""
    try:
        return int(value) > int(previous)
    except ValueError:
        return value != previous
