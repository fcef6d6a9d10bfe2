"""What failures mean: uncaught exceptions handed to torch elastic, and errors of a lost peer."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import TracebackType

from lockstep.env import cache_dir_from_environ
from lockstep.runtime.files import write_atomic


def record_uncaught_exceptions() -> None:
    """Write uncaught exceptions to ``TORCHELASTIC_ERROR_FILE``, in torch elastic's format.

    Under ``lockstep run`` or ``torchrun`` the agent then reports the failing rank with its
    traceback, without the script decorating its entry point with ``@record``. Idempotent.
    """
    previous = sys.excepthook
    if getattr(previous, "_lockstep_records", False):
        return

    def hook(kind: type[BaseException], error: BaseException, trace: TracebackType | None) -> None:
        path = os.environ.get("TORCHELASTIC_ERROR_FILE")
        text = "".join(traceback.format_exception(kind, error, trace))
        if path:
            data = {"message": {"message": f"{kind.__name__}: {error}", "extraInfo": {
                "py_callstack": text, "timestamp": str(int(time.time())),
            }}}
            _write_whole(path, json.dumps(data))
        if lost_a_peer(str(error)) and _fold(kind, error, text):
            return
        previous(kind, error, trace)

    hook._lockstep_records = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _write_whole(path: str, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all: the agent reads the file of every worker it
    stopped, and a worker stopped while writing would leave it empty, which the agent cannot parse."""
    with contextlib.suppress(OSError):  # the launcher still reports the exit code
        write_atomic(Path(path), lambda handle: handle.write(text.encode()))


_TRACEBACKS_KEPT = 100


def _fold(kind: type[BaseException], error: BaseException, text: str) -> bool:
    """A rank that only lost a peer prints one line, not its traceback: the peer's failure is the
    cause, and the job's report shows it whole. The traceback goes to a file the line names."""
    rank = os.environ.get("RANK", "?")
    folder = cache_dir_from_environ() / "tracebacks"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        kept = sorted(folder.glob("*.traceback"), key=lambda p: p.stat().st_mtime)
        for old in kept[:-_TRACEBACKS_KEPT]:  # the newest are kept, not every job's
            old.unlink(missing_ok=True)
        handle, path = tempfile.mkstemp(prefix=f"rank{rank}-{time.strftime('%Y%m%d-%H%M%S')}-",
                                        suffix=".traceback", dir=folder)
        with os.fdopen(handle, "w") as file:
            file.write(text)
    except OSError:
        return False  # nowhere to keep it: print it whole
    first = (str(error).strip().splitlines() or [""])[0][:240]
    print(f"lockstep: rank {rank} stopped because a peer failed first ({kind.__name__}: {first}); the job's "
          f"report names that peer. This rank's traceback: {path}", file=sys.stderr, flush=True)
    return True


# What a rank's error says when it only lost a peer that failed first.
_LOST_PEER = ("connection closed by peer", "connection reset by peer", "broken pipe", "socket closed")


# What a collective's own failure says (Gloo, NCCL, the process group), besides a lost peer.
_COLLECTIVE_FAILED = ("timed out waiting", "gloo", "nccl", "processgroup", "watchdog caught collective")


def collective_failed(error: BaseException) -> bool:
    """True when ``error`` is a collective's failure (``torch.distributed.DistError``, or a RuntimeError
    that autograd or a module hook passed on from one), not an error of the model's own code."""
    import torch.distributed as dist

    if isinstance(error, dist.DistError):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and (lost_a_peer(text) or any(p in text for p in _COLLECTIVE_FAILED))


def lost_a_peer(text: str) -> bool:
    """True when an error text says a peer closed its connection (it crashed or was killed)."""
    lowered = text.lower()
    return any(phrase in lowered for phrase in _LOST_PEER)
