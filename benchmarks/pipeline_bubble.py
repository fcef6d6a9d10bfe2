"""The pipeline bubble on the CPU: step time against the number of micro-batches, per schedule.

A chain of 8 blocks (Linear 512 -> 512, ReLU) between an input and an output layer trains on 64 rows per
step with SGD. One process runs the whole model (the reference); 2 processes of 1 thread each run it as
pp=2 through ``rt.forward_backward``, for every torch schedule and 2, 4, 8 and 16 micro-batches. With
perfect overlap 2 stages take half the reference's time; ``efficiency`` is reference / (2 × pp step), so
1 - efficiency is the bubble plus the sends. For GPipe and 1F1B the same step written with
``torch.distributed.pipelining`` alone runs in the same round, for a ratio.

    python benchmarks/pipeline_bubble.py [--steps 30] [--rounds 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

ROWS, WIDTH, BLOCKS, WARMUP = 64, 512, 8, 5
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def _model():  # type: ignore[no-untyped-def]
    import torch
    from torch import nn

    class Chain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(64, WIDTH)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(BLOCKS))
            self.last = nn.Linear(WIDTH, 10)

        def forward(self, x):  # type: ignore[no-untyped-def]
            x = self.first(x)
            for block in self.blocks:
                x = block(x)
            return self.last(x)

    torch.manual_seed(0)
    return Chain()


def _loss(output, batch):  # type: ignore[no-untyped-def]
    import torch.nn.functional as F

    return F.cross_entropy(output, batch[1])


def timed(schedule: str | None, microbatches: int, steps: int) -> float:
    """Seconds per step after the warm-up (rank 0's; the reference when ``schedule`` is None)."""
    import torch

    import lockstep

    torch.set_num_threads(1)
    layout = ({"strategy": "single"} if schedule is None else
              {"strategy": "fsdp", "parallel": lockstep.Parallel(pp=2, pp_schedule=schedule,
                                                                 pp_microbatches=microbatches)})
    rt = lockstep.Runtime(accelerator="cpu", seed=0, **layout)
    model = _model()
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(ROWS, 64, generator=g), torch.randint(0, 10, (ROWS,), generator=g))
    stamps = []
    for _ in range(WARMUP + steps):
        rt.forward_backward(model, batch, _loss)
        optimizer.step()
        optimizer.zero_grad()
        stamps.append(time.perf_counter())
    return (stamps[-1] - stamps[WARMUP - 1]) / steps


def hand_timed(schedule: str, microbatches: int, steps: int) -> float:
    """The same pp=2 step written with ``torch.distributed.pipelining`` alone: two ``nn.Sequential`` stages,
    ``PipelineStage`` and the schedule's class (a Runtime only makes the process group)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import get_schedule_class

    import lockstep

    torch.set_num_threads(1)
    lockstep.Runtime(accelerator="cpu", seed=0, strategy="ddp")  # the Gloo group of 2
    rank, whole = dist.get_rank(), _model()
    half = BLOCKS // 2
    stage_module = (nn.Sequential(whole.first, *whole.blocks[:half]) if rank == 0 else
                    nn.Sequential(*whole.blocks[half:], whole.last))
    optimizer = torch.optim.SGD(stage_module.parameters(), lr=0.01)
    stage = PipelineStage(stage_module, rank, 2, torch.device("cpu"))
    run = get_schedule_class(schedule)(stage, microbatches, loss_fn=F.cross_entropy)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(ROWS, 64, generator=g), torch.randint(0, 10, (ROWS,), generator=g)
    stamps = []
    for _ in range(WARMUP + steps):
        if rank == 0:
            run.step(x)
        else:
            run.step(target=y)
        optimizer.step()
        optimizer.zero_grad()
        stamps.append(time.perf_counter())
    return (stamps[-1] - stamps[WARMUP - 1]) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    from lockstep.testing import run_ranks

    reference: list[float] = []
    times: dict[tuple[str, int], list[float]] = {}
    hand: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        reference.append(run_ranks(timed, 1, None, 1, args.steps)[0])
        for schedule in ("GPipe", "1F1B"):  # lockstep and the hand-written loop alternate, one after the other
            for microbatches in (2, 4, 8, 16):
                hand.setdefault((schedule, microbatches), []).append(
                    run_ranks(hand_timed, 2, schedule, microbatches, args.steps)[0])
        for schedule in SCHEDULES:
            for microbatches in (2, 4, 8, 16):
                if schedule in ("ZBVZeroBubble", "DualPipeV") and microbatches < 4:
                    continue  # they need at least as many micro-batches as stages (4 here), and say so
                times.setdefault((schedule, microbatches), []).append(
                    run_ranks(timed, 2, schedule, microbatches, args.steps)[0])
    one = statistics.median(reference)
    print(f"one process, whole model: {one * 1e3:.1f} ms/step ({ROWS} rows, {BLOCKS} blocks of {WIDTH})\n")
    print("| schedule | micro-batches | ms/step | efficiency | hand-written torch.distributed.pipelining, ms/step |")
    print("| --- | --- | --- | --- | --- |")
    for (schedule, microbatches), values in times.items():
        step = statistics.median(values)
        mine = hand.get((schedule, microbatches))
        plain = f"{statistics.median(mine) * 1e3:.1f}" if mine else ""
        print(f"| {schedule} | {microbatches} | {step * 1e3:.1f} | {one / (2 * step):.2f} | {plain} |")


if __name__ == "__main__":
    main()
