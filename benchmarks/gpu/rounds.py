"""What the GPU benchmarks share: a measurement in a fresh process (its peak memory its own), handed back
as one ``RESULT {json}`` line on standard output, and a median with the range of its rounds."""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any


def measured(command: list[str], label: str) -> dict[str, Any] | None:
    """Run ``command`` (a child that calls ``report``); its result, or None after one line saying why not.
    Either way one line says what it gave and how long the child took, so that a run cut short keeps its
    finished measurements in its log."""
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    took = f"{time.perf_counter() - start:.0f} s"
    if done.returncode or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-4:]
        print(f"{label}: failed (exit {done.returncode}, {took}): {' | '.join(tail)}", flush=True)
        return None
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
    print(f"{label} ({took}): {json.dumps(result)}", flush=True)
    return result


def report(measure: Callable[[], dict[str, Any]]) -> None:
    """In the child: run ``measure`` with everything it prints sent to standard error, then its result."""
    with contextlib.redirect_stdout(sys.stderr):
        result = measure()
    print("RESULT " + json.dumps(result), flush=True)


def spread(values: list[float], form: str) -> str:
    """The median of ``values`` and, for several, their range: ``1.00 [0.97, 1.02]``."""
    if not values:
        return "-"
    middle = format(statistics.median(values), form)
    return middle if len(values) == 1 else f"{middle} [{format(min(values), form)}, {format(max(values), form)}]"
