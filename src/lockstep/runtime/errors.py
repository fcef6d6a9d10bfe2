"""Hand a worker's uncaught exception to torch elastic, so the launcher can print its traceback."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from types import TracebackType


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
        if path:
            data = {"message": {"message": f"{kind.__name__}: {error}", "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(kind, error, trace)),
                "timestamp": str(int(time.time())),
            }}}
            try:
                with open(path, "w") as handle:
                    json.dump(data, handle)
            except OSError:
                pass  # the launcher still reports the exit code
        previous(kind, error, trace)

    hook._lockstep_records = True  # type: ignore[attr-defined]
    sys.excepthook = hook
