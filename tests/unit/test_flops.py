"""MFU: the FLOP count against hand counts, the peak table, and no figure above 100 %."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lockstep
from checks import trainer as tc
from lockstep.runtime import FlopCount
from lockstep.train.flops import cache_file, device_name, mfu, peak_flops, record_measured_peaks

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


def test_grouped_query_attention_counts_as_its_query_heads_on_every_kernel(monkeypatch):
    """4 query heads over 2 key/value heads: 4 b h s^2 d forward and 10 b h s^2 d backward, h the query
    heads. torch 2.11's formulas refused such shapes (and so ended the Trainer's first step on a GPU):
    here they are made as strict, so the count must not hand them grouped shapes."""
    from torch.utils import flop_counter

    for name in ("sdpa_flop_count", "sdpa_backward_flop_count"):
        original = getattr(flop_counter, name)

        def strict(*shapes, original=original):
            assert len({shape[1] for shape in shapes}) == 1, f"heads differ: {shapes}"
            return original(*shapes)

        monkeypatch.setattr(flop_counter, name, strict)
    b, h, s, d = 2, 4, 8, 16
    q = torch.randn(b, h, s, d, requires_grad=True)
    k, v = (torch.randn(b, 2, s, d, requires_grad=True) for _ in range(2))
    counter = FlopCount()
    counter.start()
    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).sum().backward()
    assert counter.stop() == 14 * b * h * s * s * d


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


def test_a_measured_peak_counts_for_its_device_and_precision_only(monkeypatch):
    monkeypatch.delenv("LOCKSTEP_PEAK_FLOPS", raising=False)
    cpu = torch.device("cpu")
    record_measured_peaks(cpu, {"fp32": 1.5e11})
    record_measured_peaks(cpu, {"bf16": 4e11})  # merged with what was there
    assert json.loads(cache_file().read_text()) == {device_name(cpu): {"fp32": 1.5e11, "bf16": 4e11}}
    assert peak_flops(cpu, "32-true") == 1.5e11
    assert peak_flops(cpu, "bf16-mixed") == peak_flops(cpu, "float8") == 4e11
    assert peak_flops(cpu, "64-true") is None  # not measured
    threads = torch.get_num_threads()
    try:  # fewer threads, a lower peak: another device name, no measured peak
        torch.set_num_threads(threads + 1)
        assert peak_flops(cpu, "32-true") is None
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("content", [b"{not json", b'{"cpu": 3}', b'{"cpu": {"fp32": -1}}',
                                     b'{"cpu": {"fp32": NaN}}', b'{"cpu": {"fp32": true}}', b"[]",
                                     b'{"x": {"fp32": 1}}' + b" " * (1 << 20)])
def test_a_damaged_cache_of_peaks_is_ignored_with_a_warning(monkeypatch, content):
    monkeypatch.delenv("LOCKSTEP_PEAK_FLOPS", raising=False)
    cache_file().parent.mkdir(parents=True, exist_ok=True)
    cache_file().write_bytes(content.replace(b'"cpu"', json.dumps(device_name(torch.device("cpu"))).encode()))
    with pytest.warns(UserWarning, match="is not a file of measured peaks"):
        assert peak_flops(torch.device("cpu"), "32-true") is None
    record_measured_peaks(torch.device("cpu"), {"fp32": 2e11})  # rewritten whole
    assert peak_flops(torch.device("cpu"), "32-true") == 2e11


def _fit(tmp_path, peak: str | None, monkeypatch, module: lockstep.Module | None = None) -> tuple:
    """Fit 6 steps, logging every 2, with LOCKSTEP_PEAK_FLOPS set to ``peak`` (or unset)."""
    if peak is None:
        monkeypatch.delenv("LOCKSTEP_PEAK_FLOPS", raising=False)
    else:
        monkeypatch.setenv("LOCKSTEP_PEAK_FLOPS", peak)
    return tc.fit_logging(tmp_path, module)


def test_the_trainer_counts_the_first_batch_and_logs_mfu_against_the_given_peak(tmp_path, monkeypatch):
    trainer, windows, monitor = _fit(tmp_path, "1e12", monkeypatch)
    weights = 8 * 64 + 64 * 4
    assert monitor.flops_per_sample == 3 * (2 * weights)  # three times the forward's products
    assert windows and all("mfu" in m for m in windows)
    for m in windows:
        assert m["mfu"] == pytest.approx(monitor.flops_per_sample * m["samples_per_s"] / 1e12)


def test_the_count_runs_on_the_first_batch_of_each_fit_then_no_hook_of_it_is_called(tmp_path, monkeypatch):
    """The first batch's count is a callback of its own that leaves the Trainer's callbacks once done: a
    second fit counts again (not with the first fit's counter), and the steps after it call none of its hooks."""
    from lockstep.train import progress

    monkeypatch.setenv("LOCKSTEP_PEAK_FLOPS", "1e12")
    calls: list[str] = []
    for hook in ("on_train_batch_start", "on_before_backward", "on_train_batch_end"):
        original = getattr(progress._FirstForwardFlops, hook)
        monkeypatch.setattr(progress._FirstForwardFlops, hook,
                            lambda self, *a, _hook=hook, _original=original: (calls.append(_hook), _original(self, *a)))
    starts: list[int] = []
    original_start = FlopCount.start
    monkeypatch.setattr(FlopCount, "start", lambda self: (starts.append(1), original_start(self))[1])
    trainer = lockstep.Trainer(accelerator="cpu", max_steps=6, enable_progress_bar=False, loggers=(),
                               num_workers=0, log_dir=tmp_path)
    data = torch.utils.data.TensorDataset(torch.randn(96, 8), torch.randint(0, 4, (96,)))
    for fit in (1, 2):
        trainer.config = dataclasses.replace(trainer.config, max_steps=6 * fit)  # the second fit trains 6 more
        trainer.fit(tc.Regressor(), data, batch_size=16)
        monitor = next(c for c in trainer.callbacks if isinstance(c, progress.ThroughputMonitor))
        assert monitor.flops_per_sample == 3 * (2 * (8 * 64 + 64 * 4))
        assert not any(isinstance(c, progress._FirstForwardFlops) for c in trainer.callbacks)
        assert len(starts) == fit  # counted once per fit
    assert calls == ["on_train_batch_start", "on_before_backward"] * 2  # the first batch of each fit only


def test_a_fit_whose_first_batch_raises_leaves_no_count_running(tmp_path, monkeypatch):
    """The count runs around the first batch's forward (torch's counting mode, compiled regions eager): a
    fit that raises there stops it, so what runs after (another fit) is neither counted nor eager."""
    import torch._dynamo.eval_frame as eval_frame
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    from lockstep.train import progress

    class RaisesOnce(tc.Regressor):
        raised = False

        def training_step(self, batch, batch_idx):
            if not RaisesOnce.raised:
                RaisesOnce.raised = True
                self.net(batch[0])  # counted, then the batch fails
                raise RuntimeError("out of memory (planted)")
            return super().training_step(batch, batch_idx)

    monkeypatch.setenv("LOCKSTEP_PEAK_FLOPS", "1e12")
    trainer = lockstep.Trainer(accelerator="cpu", max_steps=4, enable_progress_bar=False, loggers=(),
                               num_workers=0, log_dir=tmp_path)
    data = torch.utils.data.TensorDataset(torch.randn(96, 8), torch.randint(0, 4, (96,)))
    with pytest.raises(RuntimeError, match="planted"):
        trainer.fit(RaisesOnce(), data, batch_size=16)
    assert _get_current_dispatch_mode_stack() == [] and eval_frame._stance.stance == "default"
    trainer.fit(RaisesOnce(), data, batch_size=16)  # counts its own first batch
    monitor = next(c for c in trainer.callbacks if isinstance(c, progress.ThroughputMonitor))
    assert monitor.flops_per_sample == 3 * (2 * (8 * 64 + 64 * 4))
    assert _get_current_dispatch_mode_stack() == [] and eval_frame._stance.stance == "default"
    assert not any(isinstance(c, progress._FirstForwardFlops) for c in trainer.callbacks)


def test_an_mfu_above_one_is_refused_and_said_once(tmp_path, monkeypatch, capsys):
    _, windows, _ = _fit(tmp_path, "1", monkeypatch)  # a peak of 1 FLOP/s: any real rate exceeds it
    assert windows and not any("mfu" in m for m in windows)
    assert capsys.readouterr().out.count("no MFU is reported") == 1


class TokenRegressor(tc.Regressor):
    """Reports 3 items per sample, as a token-averaged loss reports its valid tokens."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return {"loss": F.cross_entropy(self.net(x), y), "num_items": 3 * len(y)}


def test_the_items_a_module_reports_are_logged_per_second(tmp_path, monkeypatch):
    trainer, windows, _ = _fit(tmp_path, None, monkeypatch, TokenRegressor())
    assert windows and all(m["items_per_s"] == pytest.approx(3 * m["samples_per_s"]) for m in windows)
    assert not any("mfu" in m for m in windows)  # no peak known on the CPU
    assert float(trainer.recorder.items_seen_local) == 3 * 96


class CausalLM(lockstep.Module):
    """A ``transformers`` Llama on fixed-length token rows, its own loss."""

    def __init__(self, attention: str) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        super().__init__()
        torch.manual_seed(0)
        self.config = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
                                  num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                                  attn_implementation=attention)
        self.llama = LlamaForCausalLM(self.config)

    def training_step(self, batch, batch_idx):
        return self.llama(input_ids=batch[0], labels=batch[0]).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def benchmark_formula(model: CausalLM, tokens: int) -> float:
    """torchtitan's FLOPs per token: 6 (N - N_embedding) + 12 L d T; times T for one sequence."""
    config = model.config
    n = sum(p.numel() for p in model.parameters()) - model.llama.model.embed_tokens.weight.numel()
    return (6 * n + 12 * config.num_hidden_layers * config.hidden_size * tokens) * tokens


@pytest.mark.parametrize("attention,checkpointing", [("sdpa", None), ("sdpa", "full"), ("eager", None)])
def test_the_trainers_count_for_a_llama_agrees_with_the_benchmark_formula_with_or_without_checkpointing(
        tmp_path, monkeypatch, attention, checkpointing):
    pytest.importorskip("transformers")
    from lockstep.train.progress import ThroughputMonitor

    monkeypatch.setenv("LOCKSTEP_PEAK_FLOPS", "1e15")
    module, tokens = CausalLM(attention), 128
    trainer = lockstep.Trainer(accelerator="cpu", max_steps=1, enable_progress_bar=False, loggers=(),
                               num_workers=0, log_dir=tmp_path, activation_checkpointing=checkpointing)
    trainer.fit(module, torch.utils.data.TensorDataset(torch.randint(0, 1000, (4, tokens))), batch_size=4)
    monitor = next(c for c in trainer.callbacks if isinstance(c, ThroughputMonitor))
    assert monitor.flops_per_sample == pytest.approx(benchmark_formula(module, tokens), rel=0.02)


def test_counting_runs_compiled_regions_eagerly_and_leaves_them_to_compile_after():
    """A region first called under torch's FLOP counter was never compiled after it (eager for the whole
    run): the count runs it eagerly, and the next call compiles it."""
    from torch._dynamo.utils import counters

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(16, 16)

        def forward(self, x):
            return F.gelu(self.linear(x))

    torch._dynamo.reset()
    counters.clear()
    block = Block()
    block.compile()
    x = torch.randn(4, 16)
    counter = FlopCount()
    counter.start()
    block(x).sum().backward()
    assert counter.stop() == 2 * (2 * 4 * 16 * 16)  # the forward and the weight gradient (x needs none)
    assert counters["stats"]["unique_graphs"] == 0
    for _ in range(2):
        block(x).sum().backward()
    assert counters["stats"]["unique_graphs"] == 1  # compiled at its first call outside the count


def test_a_compiled_trainer_that_counts_its_mfu_runs_its_blocks_compiled(tmp_path, monkeypatch):
    """With a known peak the Trainer counts the first batch's FLOPs; its compiled blocks then still compile
    (they ran eagerly for the whole fit when the count was their first call)."""
    from torch._dynamo.utils import counters

    from checks import compile as compile_checks

    class Compiled(lockstep.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = compile_checks.Net()

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    monkeypatch.setenv("LOCKSTEP_PEAK_FLOPS", "1e12")
    torch._dynamo.reset()
    counters.clear()
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=generator), torch.randint(0, 4, (64,)))
    trainer = tc.quiet_trainer(compile=True, enable_throughput_monitor=True, log_every_n_steps=2, max_epochs=1,
                               log_dir=str(tmp_path))
    trainer.fit(Compiled(), data, batch_size=16)
    assert trainer.runtime.compiled == ["net.blocks.0", "net.blocks.1", "net.blocks.2"]
    assert counters["stats"]["unique_graphs"] >= 1  # the blocks compiled after the counted first batch
    assert trainer.callback_metrics["mfu"] > 0
