"""Start-up of a local launch: ``lockstep.launch`` against ``torch.multiprocessing.start_processes``
with the ``spawn`` start method (``mp.spawn``), both starting N CPU processes that join a Gloo group,
all-reduce one number and end.

Rounds alternate between the two; the first lockstep launch of the process (which starts its fork
server) is reported apart. Medians of the wall time of each launch, from the call to its return.

    python benchmarks/launch_startup.py [--processes 2] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

import lockstep
from lockstep.runtime.comm.network import free_port


def _plain(rank: int, world_size: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    dist.all_reduce(torch.ones(1))
    dist.destroy_process_group()


def _lockstep() -> float:
    rt = lockstep.Runtime(accelerator="cpu")
    return float(rt.all_reduce(torch.ones(1)))


def _timed(launch) -> float:
    start = time.perf_counter()
    launch()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    n = args.processes
    plain = lambda: tmp.start_processes(_plain, args=(n, free_port()), nprocs=n, start_method="spawn")  # noqa: E731
    ours = lambda: lockstep.launch(_lockstep, nprocs=n)  # noqa: E731
    first = _timed(ours)
    times: dict[str, list[float]] = {"mp.spawn": [], "lockstep.launch": []}
    for _ in range(args.rounds):
        times["mp.spawn"].append(_timed(plain))
        times["lockstep.launch"].append(_timed(ours))
    medians = {name: statistics.median(values) for name, values in times.items()}
    print(f"{n} processes, {args.rounds} rounds, {os.cpu_count()} CPUs, torch {torch.__version__}")
    print(f"first lockstep.launch (starts the fork server): {first:.2f} s")
    for name, values in times.items():
        print(f"{name:16s} median {medians[name]:.3f} s  (min {min(values):.3f}, max {max(values):.3f})")
    print(f"lockstep.launch / mp.spawn: {medians['lockstep.launch'] / medians['mp.spawn']:.3f}")


if __name__ == "__main__":
    main()
