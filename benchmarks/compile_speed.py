"""torch.compile through lockstep: compile time and steps/s, regional and whole-model, against eager.

By default a small transformer (6 blocks: attention + MLP, width 128, 8 x 64 tokens per process)
under DDP on 2 CPU processes (Gloo, 1 thread each); ``--accelerator cuda --processes 1 --width 768
--depth 12 --tokens 1024 --precision bf16-mixed`` is a GPT-2-small-sized run on one GPU.
Each round runs three set-ups in rotating order, each from a cold start (``torch._dynamo.reset()``,
inductor's caches off):

- eager: ``rt.setup(model, optimizer)``;
- regional: ``rt.setup(model, optimizer, compile=True)`` (each block compiled in place, code shared);
- whole: ``rt.setup(model, optimizer, compile={"regional": False})`` (the model compiled in place).

"first step" is the first step's seconds (compilation included); steps/s is measured over the
following steps. The report gives medians over the rounds and ratios to eager.

    python benchmarks/compile_speed.py [--rounds 3] [--steps 30] [--processes 2] [--accelerator cuda ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TORCHINDUCTOR_FORCE_DISABLE_CACHES", "1")  # measure compilation, not a cache hit

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import lockstep  # noqa: E402

HEAD_WIDTH, VOCAB = 32, 256


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, width = x.shape
        heads = width // HEAD_WIDTH
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, heads, HEAD_WIDTH).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, width)
        x = x + self.proj(attention)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Model(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


SETUPS = {"eager": None, "regional": True, "whole": {"regional": False}}


def run(rt: lockstep.Runtime, compile, steps: int, shape: dict[str, int]) -> tuple[float, float]:
    torch._dynamo.reset()
    with rt.init_module():
        model = Model(shape["width"], shape["depth"])
    model, optimizer = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3), compile=compile)
    generator = torch.Generator().manual_seed(rt.rank)
    tokens = torch.randint(0, VOCAB, (shape["batch"], shape["tokens"] + 1), generator=generator).to(rt.device)

    def step() -> None:
        logits = model(tokens[:, :-1])
        rt.backward(F.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1)))
        optimizer.step()
        optimizer.zero_grad()

    rt.barrier()
    start = time.perf_counter()
    step()
    rt.barrier()
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        step()
    rt.barrier()
    return first, steps / (time.perf_counter() - start)


def measure(rounds: int, steps: int, accelerator: str, precision: str,
            shape: dict[str, int]) -> dict[str, list[tuple[float, float]]]:
    if accelerator == "cpu":
        torch.set_num_threads(1)
    rt = lockstep.Runtime(accelerator=accelerator, precision=precision)
    names = list(SETUPS)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    for index in range(rounds):
        for name in names[index % len(names):] + names[: index % len(names)]:
            results[name].append(run(rt, SETUPS[name], steps, shape))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8, help="sequences per process")
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    shape = {"width": args.width, "depth": args.depth, "batch": args.batch, "tokens": args.tokens}
    common = (args.rounds, args.steps, args.accelerator, args.precision, shape)
    if args.processes == 1:
        results = measure(*common)
    else:
        results = lockstep.launch(measure, nprocs=args.processes, args=common)
    eager_rate = statistics.median(rate for _, rate in results["eager"])
    print(f"{args.processes} {args.accelerator} process(es), {args.precision}, {args.depth} blocks, width "
          f"{args.width}, {args.batch}x{args.tokens} tokens per process, {args.steps} timed steps, "
          f"{args.rounds} rounds, torch {torch.__version__}")
    print(f"{'setup':<10}{'first step s':>14}{'steps/s':>10}{'vs eager':>10}   rounds (first s / steps/s)")
    for name, values in results.items():
        first, rate = statistics.median(f for f, _ in values), statistics.median(r for _, r in values)
        rounds = " ".join(f"{f:.1f}/{r:.2f}" for f, r in values)
        print(f"{name:<10}{first:>14.2f}{rate:>10.2f}{rate / eager_rate:>10.3f}   {rounds}")


if __name__ == "__main__":
    main()
