"""A ~1B Llama on one GPU through lockstep's Trainer: tokens/s, MFU and peak memory per memory/speed
option, against a hand-written loop on the same model.

The model is a ``transformers`` Llama shaped as Llama 3.2 1B (16 layers, width 2048, 32 heads, 8 KV
heads, MLP 8192, vocabulary 128256) but with an untied output layer, as torchtitan's Llama 3 has:
1.50 B parameters. Built from its config with random weights, trained on random tokens (sequence
``--seq``, batch ``--batch``), AdamW (fused on CUDA), bf16. Each mode runs in a fresh process, so
that its peak memory is its own:

- ``hand-written``: the same model compiled block by block, bf16 autocast, a plain loop;
- ``compile``: ``Trainer(compile=True, precision="bf16-mixed")``;
- ``compile+ac``: the same with ``activation_checkpointing="full"``;
- ``compile+selective``: with ``activation_checkpointing="selective"``;
- ``compile+ac+float8``: ``"full"`` and ``precision="float8"`` (torchao; GPUs of compute capability 8.9+).

Reported per mode: the median tokens/s over the timed steps (after ``--warmup``), its ratio to the
hand-written loop, the MFU by the benchmark's own count (torchtitan's ``6 (N - N_embedding) + 12 L d T``
FLOPs per token, over the device's dense bf16 peak from lockstep's table), the MFU the Trainer
logged (its own FLOP count) and their ratio, and ``torch.cuda.max_memory_allocated``.

    python benchmarks/gpu/llama.py [--modes compile,compile+ac] [--steps 30] [--warmup 10]
    python benchmarks/gpu/llama.py --tiny   # a 2-layer model on the CPU: checks the script runs
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

import lockstep

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rounds import measured, report  # noqa: E402

MODES = ("hand-written", "compile", "compile+ac", "compile+selective", "compile+ac+float8")
SIZES = {  # hidden, layers, heads, kv heads, MLP, vocabulary
    "1b": (2048, 16, 32, 8, 8192, 128256),
    "tiny": (64, 2, 4, 2, 128, 512),
}


def make_model(size: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv_heads, mlp, vocab = SIZES[size]
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=mlp, vocab_size=vocab,
                         max_position_embeddings=8192, tie_word_embeddings=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def formula_flops_per_token(model: torch.nn.Module, seq: int) -> float:
    """torchtitan's count: 6 (N - N_embedding) + 12 L d T (attention's QK^T and AV, forward and backward)."""
    config = model.config
    params = sum(p.numel() for p in model.parameters())
    embedding = model.model.embed_tokens.weight.numel()
    return 6 * (params - embedding) + 12 * config.num_hidden_layers * config.hidden_size * seq


def loss_of(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tokens[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def optimizer_for(model: torch.nn.Module, device: str) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device == "cuda")


def data(steps: int, batch: int, seq: int, vocab: int) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return torch.utils.data.TensorDataset(torch.randint(0, vocab, (steps * batch, seq + 1), generator=generator))


class Clock:
    """Per-step seconds after ``warmup`` steps, the device synchronised at each tick. With a ``profiler``
    (a ``torch.profiler.profile``), it runs over the first ``traced`` timed steps alone: started and stopped
    between steps, outside the clock's time."""

    def __init__(self, device: str, warmup: int, profiler: Any = None, traced: int = 0) -> None:
        self.device, self.warmup, self.count, self.steps = device, warmup, 0, []
        self.last = 0.0
        self.profiler, self.traced = profiler, traced

    def tick(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
        now = time.perf_counter()
        if self.count >= self.warmup:
            self.steps.append(now - self.last)
        self.last, self.count = now, self.count + 1
        if self.profiler is not None and self.count in (self.warmup, self.warmup + self.traced):
            (self.profiler.start if self.count == self.warmup else self.profiler.stop)()
            self.last = time.perf_counter()


def hand_written(args: argparse.Namespace, device: str) -> tuple[Clock, list[float], torch.nn.Module]:
    model = make_model(args.size).to(device)
    for layer in model.model.layers:
        layer.compile()
    optimizer = optimizer_for(model, device)
    clock = Clock(device, args.warmup)
    clock.tick()
    loader = torch.utils.data.DataLoader(data(args.warmup + args.steps, args.batch, args.seq, model.config.vocab_size),
                                         batch_size=args.batch, pin_memory=device == "cuda", num_workers=2)
    for (tokens,) in loader:
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = loss_of(model, tokens.to(device, non_blocking=True))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.tick()
    return clock, [], model


class CausalLM(lockstep.Module):
    def __init__(self, size: str, device: str) -> None:
        super().__init__()
        self.llama, self.device_type = make_model(size), device

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return loss_of(self.llama, batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return optimizer_for(self, self.device_type)


class Watch(lockstep.Callback):
    """Ticks the clock at each step and keeps the MFU the Trainer logs after the warm-up."""

    def __init__(self, clock: Clock) -> None:
        self.clock, self.mfu = clock, []

    def on_train_start(self, trainer: Any, module: Any) -> None:
        self.clock.tick()

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.clock.tick()
        if trainer.is_logging_step and self.clock.count > self.clock.warmup and "mfu" in trainer.callback_metrics:
            self.mfu.append(trainer.callback_metrics["mfu"])


def with_trainer(args: argparse.Namespace, device: str, mode: str) -> tuple[Clock, list[float], torch.nn.Module]:
    clock = Clock(device, args.warmup)
    watch = Watch(clock)
    checkpointing = "selective" if "selective" in mode else "full" if "+ac" in mode else None
    trainer = lockstep.Trainer(accelerator=device, precision="float8" if "float8" in mode else "bf16-mixed",
                               compile=True, activation_checkpointing=checkpointing, max_epochs=1, seed=0,
                               log_every_n_steps=2 if args.tiny else 5, loggers=(), enable_progress_bar=False,
                               num_workers=2, callbacks=[watch], log_dir=args.log_dir)
    module = CausalLM(args.size, device)
    trainer.fit(module, data(args.warmup + args.steps, args.batch, args.seq, module.llama.config.vocab_size),
                batch_size=args.batch)
    return clock, watch.mfu, module.llama


def run_mode(args: argparse.Namespace) -> dict[str, Any]:
    """One mode in this process: its measurements as a dict."""
    from lockstep.train.flops import peak_flops

    device = "cuda" if torch.cuda.is_available() else "cpu"
    runner = hand_written if args.mode == "hand-written" else lambda a, d: with_trainer(a, d, args.mode)
    clock, trainer_mfu, model = runner(args, device)
    seconds = statistics.median(clock.steps)
    tokens_per_s = args.batch * args.seq / seconds
    peak = peak_flops(torch.device(device), "bf16-mixed")
    formula = formula_flops_per_token(model, args.seq)
    return {"mode": args.mode, "tokens_per_s": tokens_per_s, "steps": len(clock.steps),
            "formula_mfu": tokens_per_s * formula / peak if peak else None,
            "trainer_mfu": statistics.median(trainer_mfu) if trainer_mfu else None,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
            "params": sum(p.numel() for p in model.parameters())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model, sequence 64: checks the script runs")
    parser.add_argument("--mode", help=argparse.SUPPRESS)  # one mode, in a child process
    parser.add_argument("--log-dir", default=os.environ.get("TMPDIR", "/tmp") + "/lockstep-llama-bench")
    args = parser.parse_args()
    args.size = "tiny" if args.tiny else "1b"
    if args.tiny:
        args.seq, args.batch, args.steps, args.warmup = 64, 2, min(args.steps, 6), min(args.warmup, 2)
    if args.mode:
        report(lambda: run_mode(args))
        return
    results = []
    for mode in args.modes.split(","):
        command = [sys.executable, __file__, "--mode", mode, "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--seq", str(args.seq), "--batch", str(args.batch), "--log-dir", args.log_dir,
                   *(["--tiny"] if args.tiny else [])]
        result = measured(command, mode)
        if result is not None:
            results.append(result)
    if not results:
        return
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"\n{device}, torch {torch.__version__}; Llama {results[0]['params'] / 1e9:.2f} B parameters, "
          f"batch {args.batch} x {args.seq} tokens, {args.steps} timed steps after {args.warmup}")
    base = next((r["tokens_per_s"] for r in results if r["mode"] == "hand-written"), None)

    def cell(value: float | None, form: str) -> str:
        return "-" if value is None else format(value, form)

    print(f"{'mode':<20}{'tokens/s':>10}{'vs hand':>9}{'MFU':>7}{'Trainer MFU':>13}{'ratio':>7}{'peak GiB':>10}")
    for r in results:
        ratio = r["trainer_mfu"] / r["formula_mfu"] if r["trainer_mfu"] and r["formula_mfu"] else None
        print(f"{r['mode']:<20}{r['tokens_per_s']:>10.0f}{cell(r['tokens_per_s'] / base if base else None, '.3f'):>9}"
              f"{cell(r['formula_mfu'], '.3f'):>7}{cell(r['trainer_mfu'], '.3f'):>13}{cell(ratio, '.3f'):>7}"
              f"{cell(r['peak_gib'], '.1f'):>10}")


if __name__ == "__main__":
    main()
