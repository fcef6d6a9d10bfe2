"""Activation checkpointing: the peak memory it saves and the step time it costs.

A Llama-style decoder (``transformers``, built from a config: nothing downloaded) of about 110 M
parameters takes training steps with ``activation_checkpointing`` off, ``"full"`` and
``"selective"``, each in a fresh process. Peak memory is the process's peak resident set on the
CPU, ``torch.cuda.max_memory_allocated`` on a GPU; the step time is the median of the timed steps.
Modes alternate over ``--rounds`` so that drift on a busy machine hits them alike.

    python benchmarks/activation_checkpointing.py --rounds 2 --steps 3
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

MODES = ("none", "full", "selective")


def one_run(mode: str, steps: int, batch: int, length: int, device: str) -> dict[str, float]:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import lockstep

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                         num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=length)
    rt = lockstep.Runtime(accelerator=device, precision="bf16-mixed" if device == "cuda" else "32-true")
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = rt.setup(model, optimizer, activation_checkpointing=None if mode == "none" else mode)
    tokens = torch.randint(0, 32000, (batch, length), device=rt.device)
    times = []
    for _ in range(steps + 1):  # the first step warms up
        start = time.perf_counter()
        rt.backward(model(input_ids=tokens, labels=tokens).loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if rt.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if rt.device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    params = sum(p.numel() for p in model.parameters())
    return {"peak_mib": peak, "step_s": statistics.median(times[1:]), "params": params}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args.one, args.steps, args.batch, args.length, args.device)))
        return
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:
            out = subprocess.run([sys.executable, __file__, "--one", mode, "--steps", str(args.steps), "--batch",
                                  str(args.batch), "--length", str(args.length), "--device", args.device],
                                 capture_output=True, text=True, check=True, timeout=1800)
            results[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = results["none"]
    peak0 = statistics.median(r["peak_mib"] for r in base)
    time0 = statistics.median(r["step_s"] for r in base)
    print(f"{base[0]['params'] / 1e6:.0f} M parameters, batch {args.batch} x {args.length} tokens, {args.device}, "
          f"{args.rounds} rounds x {args.steps} steps")
    print("mode        peak MiB   saved    step s   cost")
    for mode in MODES:
        peak = statistics.median(r["peak_mib"] for r in results[mode])
        step = statistics.median(r["step_s"] for r in results[mode])
        print(f"{mode:10s} {peak:9.0f} {1 - peak / peak0:7.1%} {step:9.2f} {step / time0 - 1:+7.1%}")


if __name__ == "__main__":
    main()
