"""What the Trainer writes: logs, profiler reports, checkpoints, scheduler steps, throughput advice."""

from __future__ import annotations

import csv
import json
import re
import time
import types

import pytest
import torch

import lockstep
from checks import trainer as tc

pytestmark = pytest.mark.timeout(120)


class Scheduled(tc.Classifier):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class SlowData(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        import time

        time.sleep(0.012)  # 0.1 s a batch of 8: the data wait stays above a fifth of a step on a busy machine
        return torch.randn(8), index % 4


class EpochLines(lockstep.Callback):
    def on_train_epoch_end(self, trainer, module):
        loss = trainer.callback_metrics["train_loss_epoch"]
        print(f"script: epoch {trainer.current_epoch + 1} train_loss {loss:.4g}")


class LogsAtEpochEnd(lockstep.Callback):
    def on_train_epoch_end(self, trainer, module):
        module.log("epoch_extra", 1.0)


def test_loggers_write_csv_jsonl_and_tensorboard_with_hyperparameters(tmp_path):
    trainer = tc.quiet_trainer(max_epochs=2, log_every_n_steps=2, loggers=("csv", "jsonl", "tensorboard"),
                               log_dir=tmp_path, callbacks=[lockstep.LearningRateMonitor()])
    trainer.fit(Scheduled(), tc.checks.make_data(64), tc.checks.make_data(32, seed=1), batch_size=16)
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert [r["step"] for r in rows if r.get("train_loss")] == ["2", "4", "6", "8"]
    assert any(r.get("val_acc") for r in rows) and any(r.get("train_loss_epoch") for r in rows)
    lrs = [float(r["lr-0-0"]) for r in rows if r.get("lr-0-0")]
    assert lrs == [0.1 * 0.5**1, 0.1 * 0.5**3, 0.1 * 0.5**5, 0.1 * 0.5**7]  # stepped per step: what step 2k used
    assert json.loads(open(tmp_path / "hparams.json").read())["max_epochs"] == 2
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert lines[0]["hparams"]["log_every_n_steps"] == 2 and any("val_loss" in line for line in lines)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train_loss")] == [2, 4, 6, 8]


@pytest.mark.parametrize("kind", ["simple", "advanced", "pytorch"])
def test_each_profiler_writes_its_report(kind, tmp_path, capsys):
    trainer = tc.quiet_trainer(max_steps=8, profiler=kind, log_dir=tmp_path)
    trainer.fit(tc.Classifier(), tc.checks.make_data(128), batch_size=16)
    report = (tmp_path / f"profile-{kind}-rank0.txt").read_text()
    rows = {m.group(1): (int(m.group(2)), float(m.group(3)), float(m.group(4)))
            for m in re.finditer(r"^(\S+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+[\d.]+%$", report, flags=re.MULTILINE)}
    wall = float(re.search(r"^wall time\s+([\d.]+)", report, flags=re.MULTILINE).group(1))
    for hook in ("training_step", "backward", "optimizer_step"):
        count, mean_ms, total = rows[hook]
        assert count == 8 and 0 < total < wall and mean_ms == pytest.approx(1000 * total / 8, rel=0.01, abs=2e-4)
    assert "profiler report" in capsys.readouterr().out
    if kind == "advanced":
        assert "=== training_step ===" in report or "function calls" in report
    if kind == "pytorch":
        assert list((tmp_path / "pytorch-profiler").glob("rank0*.json"))
        assert "Self CPU" in (tmp_path / "profile-pytorch-ops-rank0.txt").read_text()


def test_a_profiler_object_of_its_own_times_every_hook_and_one_without_the_methods_is_refused(tmp_path):
    """An object with the four methods (no lockstep base class) sees each hook inside its profile();
    one without them is refused by name before any training."""
    import contextlib

    class Counting:
        def __init__(self):
            self.entered, self.steps = [], 0

        def start(self, folder, rank):
            pass

        @contextlib.contextmanager
        def profile(self, hook):
            self.entered.append(hook)
            yield

        def step(self):
            self.steps += 1

        def report(self, folder, rank):
            return ""

    counting = Counting()
    tc.quiet_trainer(max_steps=3, profiler=counting, log_dir=tmp_path).fit(
        tc.Classifier(), tc.checks.make_data(64), batch_size=16)
    assert [counting.entered.count(h) for h in ("training_step", "backward", "optimizer_step")] == [3, 3, 3]
    assert counting.steps == 3
    with pytest.raises(lockstep.ConfigError, match="has no start, step, report"):
        tc.quiet_trainer(max_steps=1, profiler=types.SimpleNamespace(profile=contextlib.nullcontext))


def test_model_checkpoint_keeps_the_best_by_monitor_and_last(tmp_path):
    keeper = lockstep.ModelCheckpoint(monitor="val_acc", mode="max", save_top_k=2)
    trainer = tc.quiet_trainer(max_epochs=4, checkpoint_dir=tmp_path, callbacks=[keeper])
    trainer.fit(tc.Classifier(), tc.checks.make_data(64), tc.checks.make_data(64, seed=2), batch_size=16)
    saved = sorted(p.name for p in tmp_path.glob("*.ckpt"))
    assert "last.ckpt" in saved and len(saved) == 3
    assert keeper.best_model_path in {str(tmp_path / name) for name in saved}
    assert lockstep.runtime.read_metadata(tmp_path / "last.ckpt")["step"] == 16


def test_throughput_monitor_reports_and_advises_once_on_slow_data(capsys):
    trainer = tc.quiet_trainer(max_epochs=2, log_every_n_steps=1, enable_throughput_monitor=True)
    trainer.fit(tc.Classifier(), SlowData(), batch_size=8)
    assert trainer.callback_metrics["samples_per_s"] > 0
    assert 0.2 < trainer.callback_metrics["data_wait_fraction"] <= 1.0
    assert capsys.readouterr().out.count("is spent waiting for data") == 1


class _SlowValidation(tc.Classifier):
    def validation_step(self, batch, batch_idx):
        time.sleep(0.25)  # 2 batches: 0.5 s a validation, against a few ms a training step
        super().validation_step(batch, batch_idx)


def test_throughput_leaves_validation_and_the_time_between_epochs_out():
    """Lightning's monitor does; before, a window holding an epoch's end reported 0.2 s a step."""
    trainer = tc.quiet_trainer(max_epochs=3, log_every_n_steps=2, enable_throughput_monitor=True)
    logged: list[dict] = []
    original = trainer.log_metrics
    trainer.log_metrics = lambda metrics: (logged.append(dict(metrics)), original(metrics))[1]
    trainer.fit(_SlowValidation(), tc.checks.make_data(64), tc.checks.make_data(32, seed=1), batch_size=16)
    windows = [m["step_time_s"] for m in logged if "step_time_s" in m]
    assert len(windows) == 5 and max(windows) < 0.05, windows  # steps 4, 6, 8, 10, 12: windows across 2 epoch ends


def test_progress_without_a_terminal_prints_each_epoch_in_order_with_the_epoch_values(capsys):
    trainer = tc.quiet_trainer(max_epochs=3, log_every_n_steps=1, enable_progress_bar=True,
                               callbacks=[EpochLines()])
    trainer.fit(tc.Classifier(), tc.checks.make_data(64), tc.checks.make_data(32, seed=1), batch_size=16)
    lines = [line for line in capsys.readouterr().out.splitlines() if "epoch" in line]
    # The user's callback runs first, then the bar's line for the same epoch: numbered alike, same loss.
    assert len(lines) == 6, lines
    for epoch in (1, 2, 3):
        script, bar = lines[2 * epoch - 2], lines[2 * epoch - 1]
        loss = re.search(r"train_loss (\S+)", script).group(1)
        assert script.startswith(f"script: epoch {epoch} ")
        assert bar.startswith(f"epoch {epoch}/3  4/4 batches") and f"train_loss {loss}" in bar, (script, bar)


def test_loader_options_reach_every_loader_and_reserved_ones_are_refused():
    calls = []

    def collate(rows):
        calls.append(len(rows))
        return torch.utils.data.default_collate(rows)

    trainer = tc.quiet_trainer(max_epochs=1)
    module = tc.Classifier()
    data = tc.checks.make_data(32)
    trainer.fit(module, data, data, batch_size=16, loader_options={"collate_fn": collate})
    assert calls == [16, 16, 16, 16]  # two training and two validation batches
    assert trainer.validate(module, data, batch_size=32, loader_options={"collate_fn": collate})
    assert calls[-1] == 32
    with pytest.raises(ValueError, match="loader_options cannot set 'sampler'"):
        trainer.predict(module, data, batch_size=16, loader_options={"sampler": None})

    rows = []
    ordered = tc.quiet_trainer(max_epochs=1)
    ordered.fit(tc.Classifier(), data, data, batch_size=16, loader_options={  # before: "multiple values for shuffle"
        "shuffle": False, "collate_fn": lambda items: (rows.append(items), torch.utils.data.default_collate(items))[1]})
    first = torch.stack([x for x, _ in rows[0]])
    assert torch.equal(first, data.tensors[0][:16])  # the dataset's order: not shuffled


def test_a_metric_logged_where_nothing_reduces_it_raises_instead_of_vanishing():
    trainer = tc.quiet_trainer(max_epochs=1, callbacks=[LogsAtEpochEnd()])
    with pytest.raises(RuntimeError, match=r"self.log\('epoch_extra'\) was called outside training_step"):
        trainer.fit(tc.Classifier(), tc.checks.make_data(32), batch_size=16)

