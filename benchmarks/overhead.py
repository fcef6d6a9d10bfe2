"""Overhead of lockstep against a hand-written PyTorch DDP loop, measured as ratios in one run.

The same tiny MLP (32 -> 64 -> 64 -> 10), batch 32 per process, 500 steps, 1 thread per process,
2 CPU processes (Gloo), each process bound to a core of its own where there are enough. The loops
alternate in rounds (the order rotates each round). The report gives, for each loop, the median
steps/s, and its ratio to the hand-written loop of the same round: the median of those paired
ratios, with their quartiles (half of the rounds fall between them) and a 95 % confidence interval
of that median (distribution-free, from the order statistics). Pairing within a round
cancels the machine's slow and fast spells, which on a shared 2-core machine move a whole loop by
10-20 %; the median of many rounds is what a claim should rest on.

The Trainer logs the mean training loss every 50 steps (its default), an all-reduce that the plain
hand-written loop does not do; "hand-written, logging" is that loop with the same logging done by
hand (a running sum, all-reduced every 50 steps), the fair reference for a Trainer that logs.

lockstep's loader fetches a ``TensorDataset``'s batch by one index of each tensor, where a plain
DataLoader fetches 32 items one by one and stacks them. "hand-written, batched" is the plain loop
given the same fetch (``DataLoader(data, sampler=BatchSampler(...), batch_size=None)``): the
reference that leaves only lockstep's own per-step cost in the ratio; "hand-written, batched+log" is
that loop with the Trainer's default logging added by hand: the same work as the Trainer's defaults.

    python benchmarks/overhead.py [--rounds 7] [--steps 500] [--processes 2] [--variants]

``--variants`` adds two Trainer loops that show where its time goes: without the throughput
monitor, and without it and without logging (``log_every_n_steps`` beyond the run); and a
calibration: the batched loop with 40 µs of main-thread CPU added after each step (a busy wait),
whose paired wall-time difference says what a µs of CPU per step costs in steps/s on this machine.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

import lockstep

PER_PROCESS_BATCH = 32


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def make_data(samples: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(samples, 32, generator=generator), torch.randint(0, 10, (samples,),
                                                                                       generator=generator))


def hand_written(data: TensorDataset, steps: int, log_every: int = 0, batched: bool = False,
                 busy_us: float = 0.0) -> float:
    model = nn.parallel.DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    sampler = DistributedSampler(data, shuffle=True)
    if batched:  # data[list of indices]: one index per tensor, as lockstep's loader fetches a TensorDataset
        loader = DataLoader(data, batch_size=None, sampler=BatchSampler(sampler, PER_PROCESS_BATCH, drop_last=False))
    else:
        loader = DataLoader(data, batch_size=PER_PROCESS_BATCH, sampler=sampler)
    window = torch.zeros((), dtype=torch.float64)
    dist.barrier()
    start, cpu = time.perf_counter(), time.thread_time()
    for step, (x, y) in enumerate(loader, 1):
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if log_every:
            window += loss.detach()
            if step % log_every == 0:
                dist.all_reduce(window)
                LOGGED.append(window.item() / (log_every * dist.get_world_size()))
                window.zero_()
        if busy_us:  # a known amount of main-thread CPU per step, after it, where the Trainer's own work is
            until = time.thread_time() + busy_us / 1e6
            while time.thread_time() < until:
                pass
    dist.barrier()
    return _timed(steps, time.perf_counter() - start, time.thread_time() - cpu)


LOGGED: list[float] = []  # what the logging hand-written loop "logs"
CPU_US: list[float] = []  # the main thread's CPU time per step of the last loop run, in µs


def _timed(steps: int, seconds: float, cpu_seconds: float) -> float:
    """Steps per second; the main thread's CPU µs per step kept in CPU_US."""
    CPU_US[:] = [1e6 * cpu_seconds / steps]
    return steps / seconds


def hand_written_logging(data: TensorDataset, steps: int) -> float:
    return hand_written(data, steps, log_every=50)


def hand_written_batched(data: TensorDataset, steps: int) -> float:
    return hand_written(data, steps, batched=True)


def hand_written_batched_logging(data: TensorDataset, steps: int) -> float:
    return hand_written(data, steps, log_every=50, batched=True)


BUSY_US = 40.0  # the calibration loop's added CPU per step
BUSY_LOOP = f"batched +{BUSY_US:.0f} µs CPU"


def hand_written_batched_busy(data: TensorDataset, steps: int) -> float:
    return hand_written(data, steps, batched=True, busy_us=BUSY_US)


def runtime_api(data: TensorDataset, steps: int) -> float:
    rt = lockstep.Runtime(accelerator="cpu")
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = rt.setup(model, optimizer)
    loader = rt.loader(data, batch_size=PER_PROCESS_BATCH * rt.world_size, shuffle=True, num_workers=0)
    rt.barrier()
    start, cpu = time.perf_counter(), time.thread_time()
    for x, y in loader:
        rt.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    rt.barrier()
    return _timed(steps, time.perf_counter() - start, time.thread_time() - cpu)


class Classifier(lockstep.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = make_model()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Clock(lockstep.Callback):
    """Times the training loop itself, from the first batch to the last step (set-up excluded)."""

    def on_train_epoch_start(self, trainer, module):
        trainer.runtime.barrier()
        self.start, self.cpu = time.perf_counter(), time.thread_time()

    def on_train_end(self, trainer, module):
        trainer.runtime.barrier()
        self.seconds, self.cpu = time.perf_counter() - self.start, time.thread_time() - self.cpu


def trainer_loop(data: TensorDataset, steps: int, **options: object) -> float:
    clock = Clock()
    trainer = lockstep.Trainer(max_steps=steps, accelerator="cpu", loggers=(), enable_progress_bar=False,
                               num_workers=0, callbacks=[clock], **options)
    trainer.fit(Classifier(), data, batch_size=PER_PROCESS_BATCH * dist.get_world_size())
    return _timed(steps, clock.seconds, clock.cpu)


def trainer_without_monitor(data: TensorDataset, steps: int) -> float:
    return trainer_loop(data, steps, enable_throughput_monitor=False)


def trainer_without_monitor_or_logging(data: TensorDataset, steps: int) -> float:
    return trainer_loop(data, steps, enable_throughput_monitor=False, log_every_n_steps=steps + 1)


LOOPS = {"hand-written DDP": hand_written, "lockstep runtime": runtime_api,
         "hand-written, logging": hand_written_logging, "lockstep Trainer": trainer_loop,
         "hand-written, batched": hand_written_batched, "hand-written, batched+log": hand_written_batched_logging}
VARIANTS = {"Trainer, no monitor": trainer_without_monitor,
            "Trainer, no monitor/log": trainer_without_monitor_or_logging,
            BUSY_LOOP: hand_written_batched_busy}


def measure(rounds: int, steps: int, variants: bool = False) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Each loop's steps/s and main-thread CPU µs per step, round by round (this rank's)."""
    torch.set_num_threads(1)
    if dist.get_world_size() <= len(os.sched_getaffinity(0)):  # a core each: no migrations between cores
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[dist.get_rank()]})
    data = make_data(PER_PROCESS_BATCH * dist.get_world_size() * steps)
    loops = {**LOOPS, **(VARIANTS if variants else {})}
    names = list(loops)
    rates: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds + 1):  # round 0 warms up and is not counted
        order = names[round_index % len(names):] + names[: round_index % len(names)]
        for name in order:
            rate = loops[name](data, steps)
            if round_index:
                rates[name].append(rate)
                cpu[name].append(CPU_US[0])
    return rates, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--variants", action="store_true",
                        help="also the Trainer without monitor, without logging; the calibration loop")
    args = parser.parse_args()
    rates, cpu = lockstep.launch(measure, nprocs=args.processes, args=(args.rounds, args.steps, args.variants))
    base = rates["hand-written DDP"]
    print(f"{args.processes} CPU processes, 1 thread each, batch {PER_PROCESS_BATCH} per process, "
          f"{args.steps} steps, {args.rounds} rounds")
    print(f"{'loop':<26}{'steps/s':>9}   ratio to hand-written (paired): median [quartiles]  95% CI of the median")
    for name, values in rates.items():
        print(f"{name:<26}{statistics.median(values):>9.1f}   {_paired(values, base)}")
    print("all rounds (steps/s):")
    for name, values in rates.items():
        print(f"  {name}: " + " ".join(f"{v:.0f}" for v in values))
    logging, batched = rates["hand-written, logging"], rates["hand-written, batched"]
    print(f"{'Trainer / hand-written, logging':<38}{_paired(rates['lockstep Trainer'], logging)}")
    print(f"{'runtime / hand-written, batched':<38}{_paired(rates['lockstep runtime'], batched)}")
    print(f"{'Trainer / hand-written, batched':<38}{_paired(rates['lockstep Trainer'], batched)}")
    print(f"{'Trainer / hand-written, batched+log':<38}"
          f"{_paired(rates['lockstep Trainer'], rates['hand-written, batched+log'])}")
    busy = rates.get(BUSY_LOOP)
    if busy is not None:
        wall = _paired([1e6 / r for r in busy], [1e6 / r for r in batched], difference=True)
        print(f"{BUSY_US:.0f} µs of CPU per step costs in wall time (µs/step, paired): {wall}")
    print("main thread's CPU per step (rank 0; steadier than steps/s, which also waits for the peer):")
    print(f"{'loop':<26}{'µs/step':>9}   minus hand-written, batched (paired): median [quartiles]  95% CI")
    for name, values in cpu.items():
        difference = _paired(values, cpu["hand-written, batched"], difference=True)
        print(f"{name:<26}{statistics.median(values):>9.1f}   {difference}")


def _paired(values: list[float], reference: list[float], difference: bool = False) -> str:
    """The median of the per-round ratios (``difference``: differences), with their quartiles, and a 95 %
    confidence interval of the median."""
    paired = [v - r if difference else v / r for v, r in zip(values, reference, strict=True)]
    shape = "{:+.1f}" if difference else "{:.3f}"
    if len(paired) < 2:
        return shape.format(paired[0])
    low, _, high = statistics.quantiles(paired, n=4)
    interval = median_interval(paired)
    shown = f"  95% CI [{shape.format(interval[0])}, {shape.format(interval[1])}]" if interval is not None else ""
    return f"{shape.format(statistics.median(paired))} [{shape.format(low)}, {shape.format(high)}]{shown}"


def median_interval(values: list[float], confidence: float = 0.95) -> tuple[float, float] | None:
    """A distribution-free confidence interval of the median: the ``j``-th smallest and ``j``-th largest
    value, for the largest ``j`` with P(Binomial(n, 1/2) < j) <= (1 - confidence) / 2 (it holds for any
    distribution of the values: each falls below the median with probability 1/2). None when ``n`` is
    too small for any interval at that confidence (n < 6 at 95 %)."""
    n, tail, j = len(values), (1 - confidence) / 2, 0
    below = 0.0  # P(Binomial(n, 1/2) < j + 1)
    while j < n // 2:
        below += math.comb(n, j) / 2**n
        if below > tail:
            break
        j += 1
    if j == 0:
        return None
    ordered = sorted(values)
    return ordered[j - 1], ordered[n - j]


if __name__ == "__main__":
    main()
