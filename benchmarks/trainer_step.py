"""The Trainer's own cost per step, in one process: the runtime loop and a Trainer fit of the same
tiny MLP (benchmarks/overhead.py's), 2,000 steps each, alternated; medians of the rounds.

    python benchmarks/trainer_step.py [--rounds 5] [--steps 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from overhead import Classifier, Clock, make_data, make_model

import lockstep


def runtime_loop(data, steps: int) -> float:
    rt = lockstep.Runtime(accelerator="cpu", env=lockstep.DistEnv())
    model = make_model()
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    loader = rt.loader(data, batch_size=32, shuffle=True, num_workers=0)
    start = time.perf_counter()
    for x, y in loader:
        rt.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    return time.perf_counter() - start


def trainer_fit(data, steps: int) -> float:
    clock = Clock()
    trainer = lockstep.Trainer(max_steps=steps, accelerator="cpu", loggers=(), enable_progress_bar=False,
                               num_workers=0, callbacks=[clock])
    trainer.fit(Classifier(), data, batch_size=32)
    return clock.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args()
    torch.set_num_threads(1)
    data = make_data(32 * args.steps)
    loop, fit = [], []
    for _ in range(args.rounds):
        loop.append(runtime_loop(data, args.steps))
        fit.append(trainer_fit(data, args.steps))
    per_step = {name: statistics.median(values) / args.steps * 1e3 for name, values in (("loop", loop), ("fit", fit))}
    print(f"ms per step: runtime loop {per_step['loop']:.3f}, Trainer {per_step['fit']:.3f}, "
          f"the Trainer's own {per_step['fit'] - per_step['loop']:.3f}")


if __name__ == "__main__":
    main()
