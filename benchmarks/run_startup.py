"""Start-up of ``lockstep run`` against ``torchrun``: both start N CPU workers of the same plain-torch script
(join a Gloo group, all-reduce one number, end); the wall time of the whole command, from its start to
its exit. A third arm is ``lockstep run`` with its fork server off (``PYTHON_EXEC`` set to the
interpreter: each worker imports torch itself, as under torchrun), to tell the server's share from the
rest of lockstep's launch.

Rounds alternate between the arms; medians, with the fastest and slowest round of each.

    python benchmarks/run_startup.py [--processes 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SCRIPT = """
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
dist.all_reduce(torch.ones(1))
dist.destroy_process_group()
"""


def _timed(command: list[str], environment: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(command, env=environment, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    n = str(args.processes)
    plain = {key: value for key, value in os.environ.items() if key != "PYTHON_EXEC"}
    plain.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.processes)))  # as both set it
    with tempfile.TemporaryDirectory() as folder:
        script = str(Path(folder, "allreduce.py"))
        Path(script).write_text(SCRIPT)
        arms = {
            "torchrun": ([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", n, script], plain),
            "lockstep run": ([sys.executable, "-m", "lockstep.cli.main", "run", "--devices", n, "--accelerator",
                              "cpu", script], plain),
            "lockstep run, no fork server": ([sys.executable, "-m", "lockstep.cli.main", "run", "--devices", n,
                                              "--accelerator", "cpu", script],
                                             {**plain, "PYTHON_EXEC": sys.executable}),
        }
        times: dict[str, list[float]] = {name: [] for name in arms}
        for _ in range(args.rounds):
            for name, (command, environment) in arms.items():
                times[name].append(_timed(command, environment))
    import torch

    print(f"{n} processes, {args.rounds} rounds, {os.cpu_count()} CPUs, torch {torch.__version__}")
    base = statistics.median(times["torchrun"])
    for name, values in times.items():
        median = statistics.median(values)
        print(f"{name:30s} median {median:6.2f} s  (min {min(values):.2f}, max {max(values):.2f})  "
              f"{median / base:.2f}x torchrun's")


if __name__ == "__main__":
    main()
