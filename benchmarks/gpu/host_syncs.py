"""Host syncs in the Trainer's steps on a GPU: a ``torch.profiler`` trace of the Trainer fitting the GPT-2-small
model of ``gpt.py`` (bf16, fused AdamW, pinned loader), counting in each step the calls that make the host wait
for the GPU: ``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize`` and a blocking
``cudaMemcpy``, and the ``.item()``-like reads (``aten::_local_scalar_dense``). A step runs from one
``on_train_batch_start`` to the next, so the logging after a step counts in it. The loss is logged every
``--log-every`` steps: between those steps the goal is none. One more step than counted runs, so that the
epoch's end falls outside the counted steps.

    python benchmarks/gpu/host_syncs.py [--steps 20] [--log-every 10]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import lockstep

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import BATCH, LitGPT, Timer, make_data  # noqa: E402
from rounds import record  # noqa: E402

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy",
         "aten::_local_scalar_dense")
MARK = "lockstep-bench-step-"


class Marks(lockstep.Callback):
    """A zero-length profiler range at each step's start, named by its index; the profiler runs from ``start``."""

    def __init__(self, start: int, prof: profile) -> None:
        self.start, self.prof = start, prof

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if batch_idx == self.start:
            torch.cuda.synchronize()
            self.prof.start()
        if batch_idx >= self.start:
            with record_function(f"{MARK}{batch_idx}"):
                pass

    def on_train_end(self, trainer, module):
        torch.cuda.synchronize()
        self.prof.stop()


def per_step(prof: profile) -> dict[int, Counter]:
    """Each step's sync calls, by name: every sync is counted in the last step that started before it."""
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    counts: dict[int, Counter] = {}
    step = None
    for event in events:
        if event.name.startswith(MARK):
            step = int(event.name[len(MARK):])
            counts[step] = Counter()
        elif step is not None and event.name in SYNCS:
            counts[step][event.name] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--results", help="a JSON file to put the counts into (benchmarks/gpu/results.json)")
    args = parser.parse_args()
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    trainer = lockstep.Trainer(max_epochs=1, accelerator="cuda", precision="bf16-mixed", loggers=(),
                               enable_progress_bar=False, num_workers=2, seed=0, log_every_n_steps=args.log_every,
                               callbacks=[Marks(args.warmup, prof)])
    trainer.fit(LitGPT(Timer(1), False), make_data(args.warmup + args.steps + 1), batch_size=BATCH)
    counts = {s: c for s, c in per_step(prof).items() if s < args.warmup + args.steps}
    logging = {s for s in counts if (s + 1) % args.log_every == 0}
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: the Trainer's steps {min(counts)}-"
          f"{max(counts)} (GPT-2 small, bf16-mixed), the loss logged every {args.log_every} steps (steps "
          f"{', '.join(map(str, sorted(logging)))})")
    for step in sorted(counts):
        said = ", ".join(f"{name} {n}" for name, n in sorted(counts[step].items())) or "none"
        print(f"step {step:>3}{' (logs)' if step in logging else '       '}: {said}")
    quiet = sum(sum(counts[s].values()) for s in counts if s not in logging)
    loud = sum(sum(counts[s].values()) for s in logging)
    record(args.results, lambda results: results.update(
        host_syncs_non_logging_steps=quiet, host_syncs_logging_steps=loud,
        host_syncs_steps=f"{len(counts) - len(logging)} non-logging and {len(logging)} logging steps, GPT-2 small"))
    print(f"host syncs in the {len(counts) - len(logging)} steps that do not log: {quiet}; in the "
          f"{len(logging)} that log: {loud}")


if __name__ == "__main__":
    main()
