"""The straggler report's cost: steps/s of the same loop with the report on and off, in one run.

The tiny MLP of ``overhead.py`` (about 1 ms a step on 2 CPU processes, so that a per-step cost shows),
the runtime API's loop, 2 processes each on a core of its own. Rounds alternate the two (the order
flips each round); the ratio of each round's "on" to its "off" is paired, and the report gives the
median ratio with its quartiles and a 95 % confidence interval of the median.

    python benchmarks/stragglers.py [--rounds 21] [--steps 300] [--processes 2]

It then measures the report's own work directly, in one process: the clock's calls of one step (a
batch handed out, a forward and a backward timed, the gradient hook), and rank 0's judgement of every
rank's entries in its heartbeat thread (for 2 to 1024 ranks, 0.5 s apart), each against the measured
step. On a shared machine the end-to-end ratio's noise is larger than this cost; the direct figures
are what the cost is.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from overhead import PER_PROCESS_BATCH, _paired, make_data, runtime_api

import lockstep
from lockstep.runtime.faults.stragglers import JUDGE_SHARE_INVERSE


def measure(rounds: int, steps: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    if dist.get_world_size() <= len(os.sched_getaffinity(0)):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[dist.get_rank()]})
    data = make_data(PER_PROCESS_BATCH * dist.get_world_size() * steps)
    rates: dict[str, list[float]] = {"report on": [], "report off": []}
    for round_index in range(rounds + 1):  # round 0 warms up and is not counted
        order = ["report on", "report off"] if round_index % 2 else ["report off", "report on"]
        for name in order:
            os.environ["LOCKSTEP_STRAGGLER_FACTOR"] = "1.3" if name == "report on" else "0"
            rate = runtime_api(data, steps)
            if round_index:
                rates[name].append(rate)
    return rates


def clock_cost_us(repeats: int = 200_000) -> float:
    """Microseconds of the straggler clock's calls in one step, the gradient hook's write included."""
    from lockstep.runtime.faults.stragglers import StepClock

    class Loader:
        wait_s = 0.0

    clock, loader = StepClock(cuda=False), Loader()
    start = time.perf_counter()
    for _ in range(repeats):
        clock.batch(loader)
        clock.enter("forward")
        clock.leave()
        clock.enter("backward")
        clock._gradient = time.perf_counter()  # what the hook on the last gradient does
        clock.leave()
    return (time.perf_counter() - start) / repeats * 1e6


def judge_ms(ranks: int) -> float:
    """Milliseconds of one judgement of ``ranks`` ranks' entries, each with 5 new steps (a beat's worth)."""
    import json
    import random

    from lockstep.runtime.faults.stragglers import KEPT, StragglerJudge

    class Store:
        values: dict[str, str] = {}

        def check(self, keys: list[str]) -> bool:
            return True

        def multi_get(self, keys: list[str]) -> list[bytes]:
            return [self.values[k].encode() for k in keys]

    store, judge = Store(), StragglerJudge(ranks, 1.3, print)

    def publish(first: int) -> None:
        for rank in range(ranks):
            steps = [[n, 0.1, 0.001, 0.03, 0.06, 0.01 + random.random() * 0.01] for n in range(first, first + KEPT)]
            store.values[f"lockstep/steps/{rank}"] = json.dumps({"host": "h", "local_rank": rank % 8, "group": 0,
                                                                 "queued": [], "steps": steps})

    publish(1)
    judge.read(store)
    publish(6)
    start = time.perf_counter()
    judge.read(store)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args()
    rates = lockstep.launch(measure, nprocs=args.processes, args=(args.rounds, args.steps))
    print(f"{args.processes} CPU processes, 1 thread each, batch {PER_PROCESS_BATCH} per process, {args.steps} steps, "
          f"{args.rounds} rounds")
    for name, values in rates.items():
        print(f"{name:<12}{statistics.median(values):>9.1f} steps/s   all: " + " ".join(f"{v:.0f}" for v in values))
    print(f"on / off (paired): median [quartiles]  95% CI: {_paired(rates['report on'], rates['report off'])}")
    step_us = 1e6 / statistics.median(rates["report off"])
    clock = clock_cost_us()
    print(f"the clock's calls a step: {clock:.2f} us = {100 * clock / step_us:.3f} % of a {step_us:.0f} us step")
    for ranks in (2, 16, 256, 1024):
        took = judge_ms(ranks)
        every = max(0.5, JUDGE_SHARE_INVERSE * took / 1e3)  # seconds between judgements
        print(f"rank 0's judgement of {ranks} ranks: {took:.2f} ms every {every:.1f} s = "
              f"{100 * took / 1e3 / every:.3f} % of its time")


if __name__ == "__main__":
    main()
