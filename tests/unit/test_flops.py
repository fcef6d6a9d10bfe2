"""MFU: the FLOP count against hand counts, the peak table, and no figure above 100 %."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lockstep
from lockstep.train.flops import FlopCount, mfu, peak_flops

pytestmark = pytest.mark.timeout(120)


def counted(fn) -> int:
    count = FlopCount()
    count.start()
    try:
        fn()
    finally:
        flops = count.stop()
    return flops


def test_an_mlp_costs_two_flops_per_weight_forward_and_four_backward_except_the_first_input_gradient():
    sizes, batch = [(8, 32), (32, 16), (16, 4)], 5
    model = nn.Sequential(*(m for i, o in sizes for m in (nn.Linear(i, o), nn.Tanh())))
    weights = sum(i * o for i, o in sizes)
    hand = 2 * batch * weights + 2 * batch * weights + 2 * batch * (weights - 8 * 32)  # fwd, dW, dX (not for x)
    assert counted(lambda: model(torch.randn(batch, 8)).sum().backward()) == hand


class TinyTransformer(nn.Module):
    """One block, attention by explicit matmuls, so every product is one a hand can count."""

    def __init__(self, vocab: int = 50, d: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, d)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, t = tokens.shape
        x = self.embed(tokens)
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(x).chunk(3, dim=-1))
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        x = x + self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, -1))
        x = x + self.down(F.gelu(self.up(x)))
        return self.head(x)


def test_a_small_transformer_costs_three_times_its_forward_matmuls():
    b, t, d, vocab = 3, 10, 32, 50
    model = TinyTransformer(vocab, d)
    tokens = torch.randint(0, vocab, (b, t))
    linear = d * 3 * d + d * d + d * 4 * d + 4 * d * d + d * vocab  # weights of every product with a weight
    forward = 2 * b * t * linear + 2 * (2 * b * t * t * d)  # + QK^T and AV over all heads
    assert counted(lambda: model(tokens)) == forward
    # every product's inputs need gradients (the embedding's output does): backward is twice the forward
    assert counted(lambda: F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()) == 3 * forward


def test_mfu_is_the_fraction_of_the_peak_and_never_above_one():
    assert mfu(1e9, 100.0, 1e12, 2) == pytest.approx(0.05)
    assert mfu(1e9, 100.0, 1e10, 2) is None  # 500 %: the count or the peak is wrong


def test_the_peak_comes_from_the_environment_or_the_table_and_is_unknown_on_the_cpu(monkeypatch):
    monkeypatch.delenv("LOCKSTEP_PEAK_FLOPS", raising=False)
    assert peak_flops(torch.device("cpu"), "32-true") is None
    monkeypatch.setenv("LOCKSTEP_PEAK_FLOPS", "2.5e12")
    assert peak_flops(torch.device("cpu"), "bf16-mixed") == 2.5e12
    monkeypatch.setenv("LOCKSTEP_PEAK_FLOPS", "fast")
    with pytest.raises(ValueError, match="LOCKSTEP_PEAK_FLOPS='fast'"):
        peak_flops(torch.device("cpu"), "32-true")


class Regressor(lockstep.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 4))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(tmp_path, peak: str | None, monkeypatch, module: lockstep.Module | None = None) -> tuple:
    """Fit 6 steps, logging every 2; the Trainer, the throughput windows it logged, its monitor."""
    from lockstep.train.progress import ThroughputMonitor

    if peak is None:
        monkeypatch.delenv("LOCKSTEP_PEAK_FLOPS", raising=False)
    else:
        monkeypatch.setenv("LOCKSTEP_PEAK_FLOPS", peak)
    logged: list[dict] = []
    trainer = lockstep.Trainer(accelerator="cpu", max_steps=6, log_every_n_steps=2, enable_progress_bar=False,
                               loggers=(), num_workers=0, log_dir=tmp_path)
    original = trainer.log_metrics
    trainer.log_metrics = lambda metrics: (logged.append(dict(metrics)), original(metrics))[1]  # type: ignore
    data = torch.utils.data.TensorDataset(torch.randn(96, 8), torch.randint(0, 4, (96,)))
    trainer.fit(module if module is not None else Regressor(), data, batch_size=16)
    monitor = next(c for c in trainer.callbacks if isinstance(c, ThroughputMonitor))
    return trainer, [m for m in logged if "samples_per_s" in m], monitor


def test_the_trainer_counts_the_first_batch_and_logs_mfu_against_the_given_peak(tmp_path, monkeypatch):
    trainer, windows, monitor = _fit(tmp_path, "1e12", monkeypatch)
    weights = 8 * 64 + 64 * 4
    assert monitor.flops_per_sample == 2 * weights + 2 * weights + 2 * 64 * 4  # fwd, dW, dX of the second product
    assert windows and all("mfu" in m for m in windows)
    for m in windows:
        assert m["mfu"] == pytest.approx(monitor.flops_per_sample * m["samples_per_s"] / 1e12)


def test_an_mfu_above_one_is_refused_and_said_once(tmp_path, monkeypatch, capsys):
    _, windows, _ = _fit(tmp_path, "1", monkeypatch)  # a peak of 1 FLOP/s: any real rate exceeds it
    assert windows and not any("mfu" in m for m in windows)
    assert capsys.readouterr().out.count("no MFU is reported") == 1


class TokenRegressor(Regressor):
    """Reports 3 items per sample, as a token-averaged loss reports its valid tokens."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return {"loss": F.cross_entropy(self.net(x), y), "num_items": 3 * len(y)}


def test_the_items_a_module_reports_are_logged_per_second(tmp_path, monkeypatch):
    trainer, windows, _ = _fit(tmp_path, None, monkeypatch, TokenRegressor())
    assert windows and all(m["items_per_s"] == pytest.approx(3 * m["samples_per_s"]) for m in windows)
    assert not any("mfu" in m for m in windows)  # no peak known on the CPU
    assert float(trainer.items_seen_local) == 3 * 96
