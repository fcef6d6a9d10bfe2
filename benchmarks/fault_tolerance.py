"""The per-step cost of fault tolerance (a synchronous quorum before each step, the cross-group
all-reduce through torchft, the commit vote) against plain DDP, as ratios in one run.

Three loops train the same MLP (32 -> 64 -> 64 -> 10) on a global batch of 64, on 2 CPU processes
with 1 thread each:

- "hand-written DDP": ``DistributedDataParallel`` over a Gloo group of 2 (started by ``lockstep run``);
- "lockstep DDP": ``lockstep.Runtime`` on the same 2 processes (``rt.loader``, ``rt.setup``);
- "lockstep fault-tolerant": 2 replica groups of 1 process each (``lockstep run --fault-tolerant``).

Each round runs each loop as a job of its own (their order rotates by round) and takes its steady
steps/s (the first 20 steps left out); ratios are paired within a round, and the report gives their
median and quartiles over the rounds.

    python benchmarks/fault_tolerance.py [--rounds 7] [--steps 300]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WARMUP = 20
GLOBAL_BATCH = 64


def _model():  # type: ignore[no-untyped-def]
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def _data(steps: int):  # type: ignore[no-untyped-def]
    import torch
    from torch.utils.data import TensorDataset

    g = torch.Generator().manual_seed(0)
    n = GLOBAL_BATCH * steps
    return TensorDataset(torch.randn(n, 32, generator=g), torch.randint(0, 10, (n,), generator=g))


def worker(kind: str, steps: int, out: str) -> None:
    """One process of one loop: trains ``steps`` steps, writes its steady steps/s (rank 0)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    stamps: list[float] = []
    if kind == "hand":
        import torch.distributed as dist
        from torch.utils.data import DataLoader, DistributedSampler

        dist.init_process_group("gloo")
        data = _data(steps)
        model = torch.nn.parallel.DistributedDataParallel(_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        loader = DataLoader(data, batch_size=GLOBAL_BATCH // dist.get_world_size(),
                            sampler=DistributedSampler(data, shuffle=True))
        for x, y in loader:
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            stamps.append(time.perf_counter())
        rank = dist.get_rank()
        dist.destroy_process_group()
    else:
        import lockstep

        rt = lockstep.Runtime(accelerator="cpu", seed=0)
        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        model, optimizer = rt.setup(model, optimizer)
        loader = rt.loader(_data(steps), batch_size=GLOBAL_BATCH, shuffle=True)
        if rt.replication.fault_tolerant:
            rt.resume(os.path.join(os.path.dirname(out), "no-checkpoints"), {"model": model, "loader": loader})
        for x, y in loader:
            rt.backward(F.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            stamps.append(time.perf_counter())
        rank = rt.rank + (rt.replication.index or 0)
        rt.close()
    if rank == 0:
        steady = stamps[WARMUP:]
        Path(out).write_text(json.dumps({"steps_per_s": (len(steady) - 1) / (steady[-1] - steady[0])}))


def _job(kind: str, steps: int, folder: Path) -> float:
    out = folder / f"{kind}.json"
    out.unlink(missing_ok=True)
    launch = [sys.executable, "-m", "lockstep.cli.main", "run", "--devices", "2", "--accelerator", "cpu"]
    if kind == "ft":
        launch += ["--fault-tolerant", "--replicas", "2"]
    done = subprocess.run([*launch, __file__, "--worker", "hand" if kind == "hand" else "lockstep",
                           "--steps", str(steps), "--out", str(out)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        raise SystemExit(f"{kind} failed:\n{done.stderr[-3000:]}")
    return float(json.loads(out.read_text())["steps_per_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--worker", choices=["hand", "lockstep"])
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.steps, args.out)
        return
    kinds = ["hand", "ddp", "ft"]
    names = {"hand": "hand-written DDP", "ddp": "lockstep DDP", "ft": "lockstep fault-tolerant"}
    rates: dict[str, list[float]] = {kind: [] for kind in kinds}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            order = kinds[round_ % 3:] + kinds[:round_ % 3]
            for kind in order:
                rates[kind].append(_job(kind, args.steps, Path(tmp)))
            print(f"round {round_ + 1}: " + ", ".join(f"{names[k]} {rates[k][-1]:.0f} steps/s" for k in kinds),
                  flush=True)
    print(f"\n{args.rounds} rounds of {args.steps} steps (global batch {GLOBAL_BATCH}, 2 CPU processes)")
    for kind in kinds:
        ratios = [a / b for a, b in zip(rates[kind], rates["hand"], strict=True)]
        quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
        median_rate = statistics.median(rates[kind])
        print(f"  {names[kind]:<24} {median_rate:7.0f} steps/s  {1000 / median_rate:6.2f} ms/step  "
              f"x{statistics.median(ratios):.3f} of hand-written [{quartiles[0]:.3f}, {quartiles[2]:.3f}]")
    extra = [1000 / f - 1000 / d for f, d in zip(rates["ft"], rates["ddp"], strict=True)]
    print(f"  fault tolerance's own cost per step (ft - lockstep DDP): median {statistics.median(extra):.2f} ms")


if __name__ == "__main__":
    main()
