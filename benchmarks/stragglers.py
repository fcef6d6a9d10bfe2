"""The straggler report's cost: steps/s of the same loop with the report on and off, in one run.

The tiny MLP of ``overhead.py`` (about 1 ms a step on 2 CPU processes, so that a per-step cost shows),
the runtime API's loop, 2 processes each on a core of its own. Rounds alternate the two (the order
flips each round); the ratio of each round's "on" to its "off" is paired, and the report gives the
median ratio with its quartiles and a 95 % confidence interval of the median.

    python benchmarks/stragglers.py [--rounds 21] [--steps 300] [--processes 2]
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist
from overhead import PER_PROCESS_BATCH, _paired, make_data, runtime_api

import lockstep


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


if __name__ == "__main__":
    main()
