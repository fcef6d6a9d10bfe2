"""GPT-2-small-sized training on one GPU: a hand-written loop against lockstep's runtime API and Trainer.

A 12-layer, 768-wide decoder (12 heads, sequence 1024, vocabulary 50304, 124 M parameters) on random
tokens, bf16 autocast, fused AdamW, batch 8 sequences. Each loop feeds the same CPU tensors through a
DataLoader with pinned memory. Lightning's Trainer and Accelerate run the same model too, where
they are installed. Rounds alternate the loops (the order rotates); each round times
``--steps`` steps after ``--warmup`` steps, with the GPU synchronised at both ends. Reports the median
tokens/s, the ratio to the hand-written loop and the MFU (model FLOPs per token: 6 N + 12 L T d, over
the bf16 peak this card reached on an 8192^3 matrix product).

    python benchmarks/gpu/gpt.py [--rounds 5] [--steps 30] [--compile]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lockstep

LAYERS, WIDTH, HEADS, SEQ, VOCAB, BATCH = 12, 768, 12, 1024, 50304, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.qkv, self.proj = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.up, self.down = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(b, t, WIDTH))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tokens, self.positions = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.ln = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.tokens.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def loss_of(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().view(-1, VOCAB), targets.view(-1))


def make_data(steps: int) -> TensorDataset:
    tokens = torch.randint(0, VOCAB, (steps * BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def optimizer_for(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)


class Timer:
    """Seconds from the first timed step to the last, the GPU synchronised at both ends."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.count, self.start, self.seconds = warmup, 0, 0.0, 0.0

    def tick(self) -> None:
        self.count += 1
        if self.count == self.warmup:
            torch.cuda.synchronize()
            self.start = time.perf_counter()

    def stop(self) -> None:
        torch.cuda.synchronize()
        self.seconds = time.perf_counter() - self.start


def hand_written(data: TensorDataset, warmup: int, compile_: bool) -> float:
    torch.manual_seed(0)
    model = GPT().cuda()
    optimizer = optimizer_for(model)
    forward = torch.compile(model) if compile_ else model
    timer = Timer(warmup)
    for x, y in DataLoader(data, batch_size=BATCH, pin_memory=True, num_workers=2):
        x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = forward(x)
        loss_of(logits, y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        timer.tick()
    timer.stop()
    return timer.seconds


def runtime_api(data: TensorDataset, warmup: int, compile_: bool) -> float:
    rt = lockstep.Runtime(accelerator="cuda", precision="bf16-mixed", seed=0)
    torch.manual_seed(0)
    model = GPT()
    if compile_:
        model.compile()
    model, optimizer = rt.setup(model, optimizer_for(model))
    timer = Timer(warmup)
    for x, y in rt.loader(data, batch_size=BATCH, num_workers=2):
        rt.backward(loss_of(model(x), y))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        timer.tick()
    timer.stop()
    return timer.seconds


class LitGPT(lockstep.Module):
    def __init__(self, timer: Timer, compile_: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.gpt, self.timer = GPT(), timer
        if compile_:
            self.gpt.compile()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return loss_of(self.gpt(x), y)

    def configure_optimizers(self):
        return optimizer_for(self)


class Ticks(lockstep.Callback):
    def __init__(self, timer: Timer) -> None:
        self.timer = timer

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.timer.tick()

    def on_train_end(self, trainer, module):
        self.timer.stop()


def trainer_loop(data: TensorDataset, warmup: int, compile_: bool) -> float:
    timer = Timer(warmup)
    trainer = lockstep.Trainer(max_epochs=1, accelerator="cuda", precision="bf16-mixed", loggers=(),
                               enable_progress_bar=False, num_workers=2, callbacks=[Ticks(timer)], seed=0)
    trainer.fit(LitGPT(timer, compile_), data, batch_size=BATCH)
    return timer.seconds


def lightning_loop(data: TensorDataset, warmup: int, compile_: bool) -> float:
    """The same model as a LightningModule under ``lightning.Trainer(precision="bf16-mixed")``."""
    import lightning as L

    timer = Timer(warmup)

    class LitModule(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.gpt = GPT()
            if compile_:
                self.gpt.compile()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return loss_of(self.gpt(x), y)

        def configure_optimizers(self):
            return optimizer_for(self)

    class Ticks(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            timer.tick()

        def on_train_end(self, trainer, pl_module):
            timer.stop()

    trainer = L.Trainer(accelerator="cuda", devices=1, precision="bf16-mixed", max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[Ticks()])
    trainer.fit(LitModule(), DataLoader(data, batch_size=BATCH, pin_memory=True, num_workers=2))
    return timer.seconds


def accelerate_loop(data: TensorDataset, warmup: int, compile_: bool) -> float:
    """The same loop through ``accelerate.Accelerator(mixed_precision="bf16")``."""
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="bf16")
    torch.manual_seed(0)
    model = GPT()
    if compile_:
        model.compile()
    loader = DataLoader(data, batch_size=BATCH, pin_memory=True, num_workers=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer_for(model), loader)
    timer = Timer(warmup)
    for x, y in loader:
        accelerator.backward(loss_of(model(x), y))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        timer.tick()
    timer.stop()
    return timer.seconds


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


LOOPS = {"hand-written": hand_written, "lockstep runtime": runtime_api, "lockstep Trainer": trainer_loop,
         **({"Lightning": lightning_loop} if _importable("lightning") else {}),
         **({"Accelerate": accelerate_loop} if _importable("accelerate") else {})}


def bf16_peak() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    return 10 * 2 * 8192**3 / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    peak = bf16_peak()
    params = sum(p.numel() for p in GPT().parameters())
    flops_per_token = 6 * params + 12 * LAYERS * SEQ * WIDTH
    tokens = args.steps * BATCH * SEQ
    data = make_data(args.warmup + args.steps)
    names = list(LOOPS)
    rates: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(args.rounds + 1):  # round 0 warms up (and compiles) and is not counted
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            seconds = LOOPS[name](data, args.warmup, args.compile)
            if round_index:
                rates[name].append(tokens / seconds)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16 peak {peak / 1e12:.0f} TFLOP/s; "
          f"GPT {params / 1e6:.0f} M parameters, batch {BATCH}x{SEQ}, compile={args.compile}, "
          f"{args.steps} steps x {args.rounds} rounds")
    base = statistics.median(rates["hand-written"])
    print(f"{'loop':<20}{'median tokens/s':>16}{'ratio':>8}{'MFU':>7}   all rounds")
    for name, values in rates.items():
        median = statistics.median(values)
        print(f"{name:<20}{median:>16.0f}{median / base:>8.3f}{median * flops_per_token / peak:>7.2f}   "
              + " ".join(f"{v:.0f}" for v in values))


if __name__ == "__main__":
    main()
