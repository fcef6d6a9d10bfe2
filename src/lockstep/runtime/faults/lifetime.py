"""Processes that end with the process that started them, however it ends (even by SIGKILL).

Used by ``lockstep.launch``'s workers (they die with the launcher), by workers of a torch elastic
agent (``lockstep run``, self-launch, torchrun: they die with the agent) and by DataLoader workers
(they die with their rank). ``PR_SET_PDEATHSIG`` and torch's DataLoader watchdog both watch the
*parent*, which is a forkserver when workers are forked from one, and a forkserver lives as long
as any of its children: a worker could then never learn that its rank is gone. These watch the
process that matters, by its pid.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from lockstep.runtime.faults.root_cause import record_uncaught_exceptions

STOP_CHILDREN_GRACE_S = 2.0
EXIT_HANDLERS_S = 10.0


def die_with(pid: int, name: str = "lockstep-death-watch") -> None:
    """End this process (SIGKILL) as soon as process ``pid`` has exited, whatever the reason.

    A daemon thread waits on the pid's pidfd (Linux 5.3+), or checks it twice a second. Returns
    at once; if ``pid`` is already gone, this process ends here.
    """
    try:
        pidfd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None
    except ProcessLookupError:
        os.kill(os.getpid(), signal.SIGKILL)
    except OSError:  # a kernel without pidfd_open
        pidfd = None

    def watch() -> None:
        if pidfd is not None:  # readable once the process has exited
            poller = select.poll()
            poller.register(pidfd, select.POLLIN)
            poller.poll()
        else:
            while alive(pid):
                time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name=name, daemon=True).start()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, and another user's
        pass
    return True


def on_parent_death(signum: int, parent: int) -> None:
    """Deliver ``signum`` to this process when its parent ends (Linux's ``PR_SET_PDEATHSIG``), in a child just
    started: a ``preexec_fn``, a forked worker. ``parent``: its pid, read before the fork; a parent already gone
    (this process adopted by another) sends it at once. A parent that is pid 1 (a container's entrypoint) is
    one too."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signum)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os.kill(os.getpid(), signum)


class DieWithParent:
    """A DataLoader ``worker_init_fn`` that first makes the worker die with the process that created
    the loader (its rank), then calls the user's own ``worker_init_fn``. Picklable, for any start method."""

    def __init__(self, owner: int, then: Callable[[int], Any] | None) -> None:
        self.owner, self.then = owner, then

    def __call__(self, worker_id: int) -> None:
        die_with(self.owner, name="lockstep-loader-worker-watch")
        if self.then is not None:
            self.then(worker_id)


def stop_children(grace_s: float = STOP_CHILDREN_GRACE_S) -> None:
    """End this process's ``multiprocessing`` children (DataLoader workers, above all): SIGTERM, then
    SIGKILL after ``grace_s``. For a process about to leave with ``os._exit``, which runs no finalizer."""
    children = multiprocessing.active_children()
    for child in children:
        with contextlib.suppress(Exception):
            child.terminate()
    end = time.monotonic() + grace_s
    for child in children:
        child.join(max(0.0, end - time.monotonic()))
        if child.is_alive():
            with contextlib.suppress(Exception):
                child.kill()
            child.join(1.0)


def run_exit_handlers(handlers_s: float = EXIT_HANDLERS_S) -> None:
    """Python's ``atexit`` handlers now, once (they are removed as they run), for at most ``handlers_s``
    seconds: a hanging one is left behind in its daemon thread."""
    runner = threading.Thread(target=atexit._run_exitfuncs, name="lockstep-exit", daemon=True)
    runner.start()
    runner.join(handlers_s)


def exit_now(code: int, handlers_s: float = EXIT_HANDLERS_S) -> None:
    """Leave this process with ``code``, without the interpreter's teardown (C++ static destructors of
    still-joinable backend threads can ``abort()`` a finished process there), yet with Python's own
    exit work: the ``atexit`` handlers, for at most ``handlers_s`` seconds (they shut DataLoader
    workers down, wait for an async save, release multiprocessing's semaphores), then whatever
    child process is left is stopped."""
    run_exit_handlers(handlers_s)
    stop_children()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def as_elastic_worker() -> None:
    """In a worker of a torch elastic agent (torchrun, lockstep run, self-launch): record an uncaught
    exception for the agent's report, and end with the agent. An agent killed itself stops nothing:
    without the watch its workers would train on, orphaned, into the checkpoints."""
    record_uncaught_exceptions()
    die_with(os.getppid(), name="lockstep-agent-watch")
