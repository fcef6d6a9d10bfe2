"""The cost of ``rt.backward(loss, num_items=n)``: token-averaged losses normalised over the global batch.

A tiny GPT-2 (``transformers``, from a config: 2 layers, width 64, vocabulary 512) on padded
sequences of 16 to 128 tokens, 8 sequences per process, DDP on 2 CPU processes (Gloo, 1 thread
each). Two loops alternate in rounds (the order rotates): the model's per-rank mean loss with
``rt.backward(loss)``, and the same with ``num_items`` (one extra all-reduce of one number per
optimizer step, and one multiply of the gradients). Reports median steps/s and the ratio.

    python benchmarks/num_items.py [--rounds 9] [--steps 40] [--processes 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import lockstep

PER_PROCESS, VOCAB = 8, 512


def batches(rank: int, steps: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(rank)
    out = []
    for _ in range(steps):
        lengths = torch.randint(16, 129, (PER_PROCESS,), generator=generator)
        ids = torch.randint(1, VOCAB, (PER_PROCESS, int(lengths.max())), generator=generator)
        mask = (torch.arange(ids.shape[1]) < lengths[:, None]).long()
        out.append({"input_ids": ids * mask, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


def run(rt: lockstep.Runtime, data: list[dict[str, torch.Tensor]], with_items: bool) -> float:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=128, n_embd=64, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=0)
    model = GPT2LMHeadModel(config)
    model, optimizer = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    rt.barrier()
    start = time.perf_counter()
    for batch in data:
        loss = model(**batch).loss
        if with_items:
            rt.backward(loss, num_items=(batch["labels"][:, 1:] != -100).sum())
        else:
            rt.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    rt.barrier()
    return len(data) / (time.perf_counter() - start)


def measure(rounds: int, steps: int) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    rt = lockstep.Runtime(accelerator="cpu")
    data = batches(rt.rank, steps)
    loops = {"per-rank mean": False, "num_items": True}
    rates: dict[str, list[float]] = {name: [] for name in loops}
    for index in range(rounds + 1):  # round 0 warms up
        order = list(loops) if index % 2 == 0 else list(reversed(loops))
        for name in order:
            rate = run(rt, data, loops[name])
            if index:
                rates[name].append(rate)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--processes", type=int, default=2)
    args = parser.parse_args()
    rates = lockstep.launch(measure, nprocs=args.processes, args=(args.rounds, args.steps))
    base = statistics.median(rates["per-rank mean"])
    print(f"{args.processes} CPU processes, tiny GPT-2, {PER_PROCESS} sequences of 16-128 tokens per process, "
          f"{args.steps} steps, {args.rounds} rounds")
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"{name:<15}{median:>8.2f} steps/s{median / base:>8.3f}   " + " ".join(f"{v:.1f}" for v in values))


if __name__ == "__main__":
    main()
