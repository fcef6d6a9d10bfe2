"""lockstep's training loader against a plain ``DataLoader`` + ``DistributedSampler``.

1. Throughput: one shuffled epoch of a map-style dataset (20,000 items of 64 floats, each made
   from its index: cheap items (about 10 us each here), and "decoded" items (about 26 us) that stand for
   reading and decoding a small record), global batch 128 on 2 CPU processes
   (64 per process for the plain loader), with 0 and with 2 workers per process (persistent for
   both). The two loaders alternate in rounds (the order rotates); the loop only touches each
   batch. Reports the median samples/s over all ranks and the ratio lockstep/plain.
2. Start of an epoch, n = 10^6, 10^8, 10^9: seconds from creating the loader to its first batch,
   and the growth of the process's peak resident memory (VmHWM), each case in a fresh process (one process for
   lockstep, whose start does not depend on the world size; rank 0 of 2 for DistributedSampler).
   ``DistributedSampler`` materialises ``randperm(n).tolist()``; at 10^9 that would be 8 GB of
   int64 and about 36 GB of Python ints, more than this machine has, so that case is not run.

    python benchmarks/data_loading.py [--rounds 7] [--processes 2] [--skip-start]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import lockstep

N, GLOBAL_BATCH = 20_000, 128


class Records(Dataset):
    """``n`` items of 64 floats made from the index; ``work`` > 0 adds a decode-like cost per item."""

    def __init__(self, n: int, work: int = 0) -> None:
        self.n, self.work = n, work

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x = torch.full((64 + self.work,), float(i % 1000)).mul_(0.5)
        if self.work:
            x = x.sin_().cumsum(0)
        return x[:64], i % 10


def epoch_rate(rt: lockstep.Runtime, loader, sampler: DistributedSampler | None, epoch: int) -> float:
    if sampler is not None:
        sampler.set_epoch(epoch)
    rt.barrier()
    start = time.perf_counter()
    for x, _ in loader:
        x.sum()
    rt.barrier()
    return N / (time.perf_counter() - start)


def measure(rounds: int, workers: int, work: int) -> dict[str, list[float]]:
    from data_loading import Records  # by module name, so that spawned workers can unpickle it

    torch.set_num_threads(1)
    rt = lockstep.Runtime(accelerator="cpu", seed=0)
    data = Records(N, work)
    ours = rt.loader(data, batch_size=GLOBAL_BATCH, shuffle=True, num_workers=workers)
    sampler = DistributedSampler(data, num_replicas=rt.world_size, rank=rt.rank, shuffle=True, seed=0)
    plain = DataLoader(data, batch_size=GLOBAL_BATCH // rt.world_size, sampler=sampler, num_workers=workers,
                       persistent_workers=workers > 0)
    loops = {"plain": (plain, sampler), "lockstep": (ours, None)}
    rates: dict[str, list[float]] = {name: [] for name in loops}
    for index in range(rounds + 1):  # round 0 warms up (and starts the workers)
        for name in (list(loops) if index % 2 == 0 else list(reversed(loops))):
            rate = epoch_rate(rt, *loops[name], index)
            if index:
                rates[name].append(rate)
    return rates


_START = """
import json, sys, time
import torch
from torch.utils.data import DistributedSampler
sys.path.insert(0, "benchmarks")
from data_loading import Records

def peak_mb():
    with open("/proc/self/status") as status:
        return int(next(l for l in status if l.startswith("VmHWM")).split()[1]) / 1024

kind, n = sys.argv[1], int(sys.argv[2])
before = peak_mb()
start = time.perf_counter()
if kind == "lockstep":
    import lockstep
    from lockstep import DistEnv
    rt = lockstep.Runtime(accelerator="cpu", env=DistEnv(), seed=0)  # its start does not depend on the world size
    batches = iter(rt.loader(Records(n), batch_size=128, shuffle=True, num_workers=0))
else:
    batches = iter(DistributedSampler(Records(n), num_replicas=2, rank=0, shuffle=True, seed=0))
first = next(batches)  # the iterator stays alive, as in a training loop
print(json.dumps({"seconds": time.perf_counter() - start, "extra_mb": peak_mb() - before}))
"""


def epoch_start(kind: str, n: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-c", _START, kind, str(n)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--skip-start", action="store_true", help="only the throughput part")
    args = parser.parse_args()
    print(f"{args.processes} CPU processes, {N} items, global batch {GLOBAL_BATCH}, {args.rounds} rounds")
    sys.path.insert(0, str(Path(__file__).parent))
    for work, label in ((0, "cheap items"), (4096, "decoded items")):
        for workers in (0, 2):
            rates = lockstep.launch(measure, nprocs=args.processes, args=(args.rounds, workers, work))
            base = statistics.median(rates["plain"])
            for name, values in rates.items():
                median = statistics.median(values)
                print(f"{label:<14} workers={workers}  {name:<9}{median:>10.0f} samples/s{median / base:>8.3f}   "
                      + " ".join(f"{v:.0f}" for v in values))
    if args.skip_start:
        return
    print("start of an epoch: seconds to the first batch, growth of the peak resident memory")
    for n in (10**6, 10**8, 10**9):
        for kind in ("lockstep", "DistributedSampler"):
            if kind == "DistributedSampler" and n == 10**9:
                print(f"n={n:.0e}  {kind:<19} not run: randperm(n).tolist() needs about 44 GB")
                continue
            result = epoch_start(kind, n)
            print(f"n={n:.0e}  {kind:<19}{result['seconds']:>8.3f} s{result['extra_mb']:>10.1f} MB")


if __name__ == "__main__":
    main()
