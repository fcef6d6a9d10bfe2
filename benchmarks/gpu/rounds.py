"""What the GPU benchmarks share: a measurement in a fresh process (its peak memory its own), handed back
as one ``RESULT {json}`` line on standard output, and a median with the range of its rounds."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
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


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def commit() -> str:
    """The commit measured: ``LOCKSTEP_COMMIT`` (the GPU machine gets the tree without its ``.git``), else git's."""
    if os.environ.get("LOCKSTEP_COMMIT"):
        return os.environ["LOCKSTEP_COMMIT"]
    done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.abspath(__file__)))
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def record(path: str | None, update: Callable[[dict[str, Any]], None]) -> None:
    """Put a benchmark's results into the results file ``path`` (``benchmarks/gpu/results.json``), beside what
    the other benchmarks of the same stay wrote there, with the date, card, torch and commit they ran on. A file
    that does not parse as a JSON object is started anew. Written whole to a temporary file, then renamed, so
    that a run cut short leaves the last complete file."""
    if not path:
        return
    import torch

    try:
        with open(path) as old:
            results = json.load(old)
    except (OSError, ValueError):
        results = {}
    if not isinstance(results, dict):
        results = {}
    results.update(date=datetime.date.today().isoformat(),
                   card=torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU",
                   torch=torch.__version__, commit=commit())
    update(results)
    with open(path + ".tmp", "w") as out:
        json.dump(results, out, indent=1)
        out.write("\n")
    os.replace(path + ".tmp", path)
