"""What lockstep's imports cost: each case in a fresh interpreter, rounds alternating between the
cases, medians of the wall time from the process's start to its end.

- ``python -c pass``: the interpreter alone (subtract it to compare imports);
- ``import torch``: the reference;
- ``import lockstep``: loads no torch (names load on first use);
- ``from lockstep import Runtime`` and ``from lockstep import Runtime, Trainer``: torch plus
  lockstep's runtime (and the Trainer with its loggers), compared with ``import torch``;
- ``lockstep --help`` and ``lockstep run --help``: the console script, which imports no torch.

The start-up of ``import torch`` itself varies by a second between runs on a loaded machine, so
the cost lockstep adds is also measured inside one process: ``import torch`` first, then the
clock around ``from lockstep import Runtime, Trainer``. It also lists the heavy torch subsystems
(FSDP, DTensor, DCP) each import loaded.

    python benchmarks/import_time.py [--rounds 11]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

HEAVY = ("torch.distributed.fsdp", "torch.distributed.tensor", "torch.distributed.checkpoint")
CASES = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "import torch": [sys.executable, "-c", "import torch"],
    "import lockstep": [sys.executable, "-c", "import lockstep"],
    "from lockstep import Runtime": [sys.executable, "-c", "from lockstep import Runtime"],
    "from lockstep import Runtime, Trainer": [sys.executable, "-c", "from lockstep import Runtime, Trainer"],
}


def _console_script() -> str:
    found = shutil.which("lockstep", path=os.path.dirname(sys.executable)) or shutil.which("lockstep")
    if found is None:
        raise SystemExit("the lockstep console script is not installed: pip install -e .")
    return found


def _timed(command: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def _heavy_modules(statement: str) -> list[str]:
    loaded = f"sorted({{m.split('.')[2] for m in sys.modules if m.startswith({HEAVY!r})}})"
    probe = f"{statement}\nimport sys\nprint({loaded})"
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    return eval(out)  # noqa: S307 - our own probe's printed list


def _added_after_torch() -> float:
    """Seconds that ``from lockstep import Runtime, Trainer`` takes in a process that imported torch."""
    probe = ("import time, torch\nstart = time.perf_counter()\nfrom lockstep import Runtime, Trainer\n"
             "print(time.perf_counter() - start)")
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    return float(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11)
    args = parser.parse_args()
    script = _console_script()
    cases = {**CASES, "lockstep --help": [script, "--help"], "lockstep run --help": [script, "run", "--help"]}
    for command in cases.values():  # warm the file cache
        _timed(command)
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, command in cases.items():
            times[name].append(_timed(command))
    medians = {name: statistics.median(values) for name, values in times.items()}
    torch_s = medians["import torch"]
    print(f"{args.rounds} rounds, median wall time of a fresh process:")
    for name, value in medians.items():
        spread = max(times[name]) - min(times[name])
        versus = f"  ({value - torch_s:+.3f} s against import torch)" if "lockstep import" in name else ""
        print(f"  {name:<40} {value:6.3f} s  (range {spread:.3f} s){versus}")
    added = [_added_after_torch() for _ in range(args.rounds)]
    print(f"  lockstep's own import after torch's (Runtime, Trainer): median {statistics.median(added):.3f} s, "
          f"max {max(added):.3f} s")
    for statement in ("import lockstep", "from lockstep import Runtime, Trainer"):
        print(f"  heavy torch subsystems after `{statement}`: {_heavy_modules(statement) or 'none'}")


if __name__ == "__main__":
    main()
