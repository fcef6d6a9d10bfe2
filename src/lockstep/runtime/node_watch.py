"""Node-level liveness for ``lockstep run`` on several nodes: heartbeats and failure notices.

Each node's launcher (the torch elastic agent's process) runs one NodeWatch thread. Through the
rendezvous store it

- bumps a counter of its own every ``INTERVAL_S`` (its heartbeat);
- reads the other nodes' counters, and notes with its *own* monotonic clock when each last
  changed. A node whose counter has not changed for ``WINDOW_S`` is lost. No wall clock of
  another node is ever compared with this node's, so skewed clocks cannot fake or hide a loss;
- publishes this node's failure (the root cause its agent reported), and watches for another
  node's.

What a loss or a failure elsewhere does is the caller's ``on_lost``: a fixed-size job stops
(every node exits non-zero, naming the cause); an elastic job ends this node's workers so that
the agent re-forms the group without the lost node.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

INTERVAL_S = 1.0
WINDOW_S = 10.0
_PREFIX = "lockstep/nodes"


class NodeWatch:
    """One node's heartbeat and watch over the others (see the module docstring)."""

    def __init__(self, host: str, port: int, label: str, on_lost: Callable[[str], None],
                 interval_s: float = INTERVAL_S, window_s: float = WINDOW_S) -> None:
        """``label`` names this node in the others' messages, e.g. ``node 1 (gpu7, 10.0.0.2)``."""
        self.host, self.port, self.name, self.on_lost = host, port, label, on_lost
        self.interval_s, self.window_s = interval_s, window_s
        self.index: int | None = None
        self.store: Any = None
        self.connected = threading.Event()
        self._seen: dict[int, tuple[str, float]] = {}  # node index -> (last counter seen, local time)
        self._reported: set[int] = set()
        self.verdict = ""  # what ended the watch: another node's failure or loss
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lockstep-node-watch", daemon=True)

    def start(self) -> NodeWatch:
        self._thread.start()
        return self

    def stop(self, done: bool) -> None:
        """End the watch; ``done``: this node finished, so the others must not count it as lost."""
        self._stop.set()
        if done and self.store is not None and self.index is not None:
            with contextlib.suppress(Exception):
                self.store.set(f"{_PREFIX}/{self.index}/beat", "done")

    def publish_failure(self, cause: str) -> None:
        """Tell the other nodes that this node's workers failed, and why (one line).

        Waits two heartbeats before returning: the node hosting the store keeps it up until the
        others have read the cause, rather than leaving them with a lost connection.
        """
        if self.store is None:
            return
        with contextlib.suppress(Exception):
            self.store.set(f"{_PREFIX}/failed", f"{self.name}: {cause}")
            time.sleep(2 * self.interval_s)

    # -- the thread ------------------------------------------------------------------------
    def _connect(self) -> bool:
        import torch.distributed as dist

        while not self._stop.is_set():
            try:
                self.store = dist.TCPStore(self.host, self.port, is_master=False, wait_for_workers=False,
                                           timeout=timedelta(seconds=self.window_s))
                self.index = int(self.store.add(f"{_PREFIX}/count", 1)) - 1
                self.store.set(f"{_PREFIX}/{self.index}/name", self.name)
                self.connected.set()
                return True
            except Exception:  # noqa: BLE001 - the store is not up yet (the master starts later)
                self._stop.wait(self.interval_s)
        return False

    def _run(self) -> None:
        if not self._connect():
            return
        beat = 0
        while not self._stop.is_set():
            beat += 1
            try:
                self.store.set(f"{_PREFIX}/{self.index}/beat", str(beat))
                verdict = self._check()
            except Exception as error:  # noqa: BLE001 - the store's host is gone or unreachable
                if self._stop.is_set():
                    return
                verdict = (f"lost the connection to the rendezvous store at {self.host}:{self.port} "
                           f"({str(error).splitlines()[0][:120]}): the node hosting it died or the "
                           "network to it failed")
            if verdict:
                self._stop.set()
                self.verdict = verdict
                self.on_lost(verdict)
                return
            self._stop.wait(self.interval_s)

    def _check(self) -> str:
        """'' while all is well, else what went wrong elsewhere, in one line."""
        if self.store.check([f"{_PREFIX}/failed"]):
            text = self.store.get(f"{_PREFIX}/failed").decode()
            if not text.startswith(self.name + ":"):
                return text
        now = time.monotonic()
        count = int(self.store.add(f"{_PREFIX}/count", 0))
        for index in range(count):
            if index == self.index or index in self._reported:
                continue
            key = f"{_PREFIX}/{index}/beat"
            if not self.store.check([key]):
                continue
            value = self.store.get(key).decode()
            previous = self._seen.get(index)
            if value == "done":
                self._reported.add(index)
            elif previous is None or previous[0] != value:
                self._seen[index] = (value, now)
            elif now - previous[1] > self.window_s:
                self._reported.add(index)
                name = self.store.get(f"{_PREFIX}/{index}/name").decode()
                return (f"{name} sent no heartbeat for {now - previous[1]:.0f}s (window "
                        f"{self.window_s:g}s): its launcher died, or the network to it failed")
        return ""
