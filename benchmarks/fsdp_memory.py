"""Peak resident memory per rank when a model too big to copy everywhere is built under FSDP.

A 201 M-parameter MLP stack (24 blocks of Linear(1024, 4096) -> GELU -> Linear(4096, 1024); 805 MB
of fp32 weights) is built two ways on N CPU processes (Gloo), each in fresh processes:

- ``empty``: ``with rt.init_module(empty=True)`` builds it on the meta device; ``rt.setup`` shards it
  and materialises only this rank's shards.
- ``full``: every rank builds the whole model on the CPU, then ``rt.setup`` shards it (what a script
  without ``init_module`` does).

Each rank reads its peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs`` between
phases) for: start-up (torch imported, process group joined), build + setup, and one training step
(forward, backward, SGD without momentum, batch 8 per rank). The report gives the largest value
over the ranks for each phase, and that peak less the start-up's, each next to the full model's size.

glibc's malloc raises its mmap threshold (up to 32 MiB) each time a large block is freed, after
which blocks of that size come from the heap, where freed memory stays resident. FSDP frees an
all-gathered block's parameters after every forward and backward. lockstep's FSDP therefore fixes
the threshold at 1 MiB on the CPU (``give_back_freed_buffers``); the benchmark runs that way, and
again with ``MALLOC_MMAP_THRESHOLD_=33554432`` (glibc's ceiling, which lockstep leaves alone as a
user's setting) to show what the resident set keeps without it.

    python benchmarks/fsdp_memory.py [--processes 4] [--blocks 24] [--width 1024]
"""

from __future__ import annotations

import argparse
import os
import re

import torch
import torch.distributed as dist
from torch import nn

import lockstep

MB = 1e6


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class MLPStack(nn.Module):
    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(width) for _ in range(blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _status(field: str) -> float:
    """A field of /proc/self/status (VmRSS, VmHWM) in MB."""
    with open("/proc/self/status") as status:
        found = re.search(rf"^{field}:\s+(\d+) kB", status.read(), re.MULTILINE)
    assert found is not None, field
    return int(found.group(1)) * 1024 / MB


def _reset_peak() -> None:
    """Make VmHWM start again from the current resident set (Linux >= 4.0)."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def measure(mode: str, blocks: int, width: int) -> list[dict[str, float]]:
    torch.set_num_threads(1)
    rt = lockstep.Runtime(accelerator="cpu", strategy="fsdp", seed=0)
    phases = {"start-up": _status("VmHWM")}
    _reset_peak()
    with rt.init_module(empty=mode == "empty"):
        model = MLPStack(blocks, width)
    model = rt.setup(model)
    phases["build + setup"] = _status("VmHWM")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    _reset_peak()
    x = torch.randn(8, width)
    rt.backward(model(x).square().mean())
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)
    phases["training step"] = _status("VmHWM")
    local = sum(p.to_local().numel() for p in model.parameters()) * 4 / MB
    phases["local shard MB"] = local
    everyone: list[dict[str, float]] = [{} for _ in range(rt.world_size)]
    dist.all_gather_object(everyone, phases)
    return everyone


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024)
    args = parser.parse_args()
    params = sum(p.numel() for p in MLPStack(args.blocks, args.width).to("meta").parameters())
    full = params * 4 / MB
    print(f"model: {params / 1e6:.1f} M parameters, {full:.0f} MB in fp32; {args.processes} CPU processes, FSDP")
    print(f"{'malloc':<10}{'build':<7}{'phase':<15}{'peak RSS MB':>12}{'/model':>8}"
          f"{'above start-up':>16}{'/model':>8}   per rank")
    for malloc in ("lockstep", "32 MiB"):
        if malloc == "lockstep":
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:  # read by each worker's C library when it starts
            os.environ["MALLOC_MMAP_THRESHOLD_"] = str(2**25)
        for mode in ("empty", "full"):
            ranks = lockstep.launch(measure, nprocs=args.processes, args=(mode, args.blocks, args.width))
            for phase in ("build + setup", "training step"):
                peak = max(r[phase] for r in ranks)
                above = max(r[phase] - r["start-up"] for r in ranks)
                print(f"{malloc:<10}{mode:<7}{phase:<15}{peak:>12.0f}{peak / full:>8.2f}{above:>16.0f}"
                      f"{above / full:>8.2f}   " + " ".join(f"{r[phase]:.0f}" for r in ranks))
    print(f"start-up (torch imported, group joined): {max(r['start-up'] for r in ranks):.0f} MB per rank; "
          f"local shard: {ranks[0]['local shard MB']:.0f} MB")


if __name__ == "__main__":
    main()
