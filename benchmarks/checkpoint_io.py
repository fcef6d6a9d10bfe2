"""Checkpoint cost: lockstep's sharded folder checkpoints against plain ``torch.save``/``torch.load``,
and the training loop's speed with sync and async saves.

The model is an MLP stack (12 blocks of Linear(512, 2048) -> GELU -> Linear(2048, 512), 25.2 M
parameters) with AdamW, after one step, so a checkpoint holds weights plus two moments: 302 MB in
all, split over N CPU processes (Gloo) by the strategy (FSDP by default). One thread per process.

1. Throughput, over ``--rounds`` alternating rounds after a warm-up round (medians reported):
   - ``rt.save(path, {"model", "optimizer"})`` (blocking) and ``rt.load`` of the same folder, with
     the files' checksums written and verified (the default), and without them ("no sums");
   - the checksum work alone: each rank's checksum of the bytes it writes (what a save adds: it
     is taken as they are written) and ``verify`` (what a load adds: every file read back);
   - the plain equivalent: every rank ``torch.save``s its own tensors (model and optimizer state
     dicts, local shards) to a file and fsyncs it (DCP's writer fsyncs its files too), then
     ``torch.load(weights_only=True)`` and copies them back into the live tensors.
   MB/s is the state's total bytes over the slowest rank's seconds (page cache warm: a second write
   of the same files; the numbers are those of this machine's disk and memory).
2. The loop: ``--steps`` training steps (batch 16 per process), a checkpoint every ``--every``
   steps, with no checkpoint, ``blocking=True`` and ``blocking=False``. Reports steps/s and the
   seconds each save blocked the loop (``rt.save``'s return value; an async save blocks while it
   copies the state and while it waits for the previous save to finish).

    python benchmarks/checkpoint_io.py [--processes 2] [--strategy fsdp] [--rounds 3] [--steps 20] [--every 10]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import xxhash
from fsdp_memory import MLPStack
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree

import lockstep

MB = 1e6
WIDTH, BLOCKS, BATCH = 512, 12, 16


def _local(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


def _plain_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Any:
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    return pytree.tree_map(_local, state, is_leaf=lambda v: isinstance(v, DTensor))


def _tensor_bytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor))


def plain_save(model, optimizer, path: Path) -> None:
    with open(path, "wb") as handle:
        torch.save(_plain_state(model, optimizer), handle)
        handle.flush()
        os.fsync(handle.fileno())


def plain_load(model, optimizer, path: Path) -> None:
    loaded = torch.load(path, weights_only=True)
    live = [t for t in pytree.tree_leaves(_plain_state(model, optimizer)) if isinstance(t, torch.Tensor)]
    saved = [t for t in pytree.tree_leaves(loaded) if isinstance(t, torch.Tensor)]
    with torch.no_grad():
        for target, source in zip(live, saved, strict=True):
            target.copy_(source)


def _timed(rt: lockstep.Runtime, action) -> float:
    """Seconds of the slowest rank."""
    rt.barrier()
    start = time.perf_counter()
    action()
    seconds = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds)


def throughput(rt, model, optimizer, folder: Path, rounds: int) -> dict[str, list[float]]:
    ours, bare = folder / "ours", folder / "bare"
    plain = folder / f"plain-{rt.rank}.pt"
    state = {"model": model, "optimizer": optimizer}

    def without_checksums(action):
        def run():
            rt.checkpointer.checksums = False
            try:
                action()
            finally:
                rt.checkpointer.checksums = True
        return run

    actions = {
        "lockstep save": lambda: rt.save(ours, state),
        "lockstep load": lambda: rt.load(ours, state),
        "save, no sums": without_checksums(lambda: rt.save(bare, state)),
        "load, no sums": without_checksums(lambda: rt.load(bare, state)),
        "torch.save": lambda: plain_save(model, optimizer, plain),
        "torch.load": lambda: plain_load(model, optimizer, plain),
        "checksums": lambda: [xxhash.xxh3_64(blob).hexdigest() for blob in written],
        "verify": lambda: rt.checkpointer.verify(ours),
    }
    rt.save(ours, state)
    # What a save adds: the checksum of the bytes each rank writes, taken as they are written.
    written = [path.read_bytes() for path in sorted(ours.glob(f"__{rt.rank}_*"))]
    seconds: dict[str, list[float]] = {name: [] for name in actions}
    families = [["lockstep save", "checksums", "verify", "lockstep load"], ["save, no sums", "load, no sums"],
                ["torch.save", "torch.load"]]
    for round_index in range(rounds + 1):  # round 0 warms up
        # saves come before their loads; which family goes first rotates
        shift = round_index % len(families)
        order = [name for family in families[shift:] + families[:shift] for name in family]
        for name in order:
            took = _timed(rt, actions[name])
            if round_index:
                seconds[name].append(took)
    return seconds


def loop(rt, model, optimizer, folder: Path, steps: int, every: int, mode: str) -> tuple[float, list[float]]:
    blocked = []
    x = torch.randn(BATCH, WIDTH, generator=torch.Generator().manual_seed(rt.rank))
    rt.barrier()
    start = time.perf_counter()
    for step in range(1, steps + 1):
        rt.backward(model(x).square().mean())
        optimizer.step()
        optimizer.zero_grad()
        if mode != "none" and step % every == 0:
            state = {"model": model, "optimizer": optimizer, "step": step}
            blocked.append(rt.save(folder / f"loop-{step}", state, blocking=mode == "sync"))
    rt.checkpointer.wait()
    rt.barrier()
    return steps / (time.perf_counter() - start), blocked


def measure(strategy: str, rounds: int, steps: int, every: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    rt = lockstep.Runtime(accelerator="cpu", strategy=strategy, seed=0)
    torch.manual_seed(0)
    model = MLPStack(BLOCKS, WIDTH)
    model = rt.setup(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rt.backward(model(torch.randn(BATCH, WIDTH)).square().mean())
    optimizer.step()
    optimizer.zero_grad()
    total = torch.tensor(_tensor_bytes(_plain_state(model, optimizer)), dtype=torch.float64)
    if rt.strategy.name == "fsdp":  # shards add up; a replicated strategy's copies do not
        dist.all_reduce(total)
    shared: list[Any] = [Path(tempfile.mkdtemp(prefix="lockstep-ckpt-bench-")) if rt.rank == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(shared)
    folder = shared[0]
    result: dict[str, Any] = {"MB": float(total) / MB, "seconds": throughput(rt, model, optimizer, folder, rounds)}
    loops: dict[str, list[tuple[float, list[float]]]] = {"none": [], "sync": [], "async": []}
    names = list(loops)
    for round_index in range(rounds + 1):
        for name in names[round_index % 3:] + names[: round_index % 3]:
            outcome = loop(rt, model, optimizer, folder, steps, every, name)
            if round_index:
                loops[name].append(outcome)
    result["loops"] = loops
    rt.barrier()
    if rt.rank == 0:
        shutil.rmtree(folder)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--strategy", default="fsdp")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--every", type=int, default=10)
    args = parser.parse_args()
    result = lockstep.launch(measure, nprocs=args.processes,
                             args=(args.strategy, args.rounds, args.steps, args.every))
    size = result["MB"]
    print(f"{args.processes} CPU processes, {args.strategy}, state {size:.0f} MB (weights + AdamW moments), "
          f"{args.rounds} rounds")
    print(f"{'action':<16}{'median s':>10}{'MB/s':>8}   all rounds (s)")
    for name, values in result["seconds"].items():
        median = statistics.median(values)
        print(f"{name:<16}{median:>10.3f}{size / median:>8.0f}   " + " ".join(f"{v:.3f}" for v in values))
    print(f"\nloop: {args.steps} steps, a checkpoint every {args.every} steps")
    print(f"{'saves':<8}{'median steps/s':>16}{'ratio':>8}{'median blocked s/save':>24}")
    base = statistics.median(rate for rate, _ in result["loops"]["none"])
    for name, outcomes in result["loops"].items():
        rate = statistics.median(r for r, _ in outcomes)
        blocked = [b for _, bs in outcomes for b in bs]
        shown = f"{statistics.median(blocked):>24.3f}" if blocked else f"{'-':>24}"
        print(f"{name:<8}{rate:>16.2f}{rate / base:>8.3f}{shown}")


if __name__ == "__main__":
    main()
