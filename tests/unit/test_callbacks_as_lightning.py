"""The built-in callbacks and the logging step, against what Lightning does with the same program
(each value worked out by hand here): a value logged in on_train_batch_end is its step's, also across a
resume; LearningRateMonitor logs the rate a step used; EarlyStopping stops on a non-finite score;
ModelCheckpoint's step rule alone saves no epoch end, its final save follows save_last and names the
step's own epoch, a monitored save waits for the first validation, and the best checkpoint survives a
resume. 40 samples in batches of 8: 5 steps an epoch."""

from __future__ import annotations

import csv
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import lockstep
from checks import trainer as tc
from lockstep.errors import UsageError
from lockstep.runtime.checkpoint.format import read_metadata

pytestmark = pytest.mark.timeout(120)

_g = torch.Generator().manual_seed(0)
TRAIN = TensorDataset(torch.randn(40, 8, generator=_g), torch.randn(40, 4, generator=_g))
VAL = TensorDataset(torch.randn(12, 8, generator=_g), torch.randn(12, 4, generator=_g))


class Net(lockstep.Module):
    def __init__(self, scores=None) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = torch.nn.Linear(8, 4)
        self.scores = scores  # epoch i's validation logs scores[i] as "score"

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.mse_loss(self.net(batch[0]), batch[1]))
        if self.scores is not None:
            self.log("score", self.scores[self.trainer.current_epoch])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class LogsBatchIndex(Net):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.log("index", float(batch_idx))


def _rows(folder) -> list[dict[str, str]]:
    return list(csv.DictReader(open(folder / "metrics.csv")))


def test_a_value_logged_at_the_batch_end_is_in_its_own_steps_row(tmp_path):
    trainer = tc.quiet_trainer(max_epochs=1, log_every_n_steps=1, loggers=("csv",), log_dir=tmp_path)
    trainer.fit(LogsBatchIndex(), TRAIN, batch_size=8)
    indexed = [(r["step"], r["index"]) for r in _rows(tmp_path) if r.get("index")]
    assert indexed == [(str(s), f"{s - 1}.0") for s in range(1, 6)]  # step s ran batch s - 1
    assert trainer.callback_metrics["index"] == 2.0  # the epoch's mean of 0..4 (the epoch's value, as Lightning)


class LogsAtTheBatchEnd(LogsBatchIndex):
    """Logs train_loss itself, at the batch's end (taking the name from the returned loss), under a scheduler
    that steps each step."""

    def on_train_batch_end(self, outputs, batch, batch_idx):
        super().on_train_batch_end(outputs, batch, batch_idx)
        self.log("train_loss", outputs * 2)

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": optimizer, "lr_scheduler": {
            "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5), "interval": "step"}}


class CommitsSteps(lockstep.Callback):
    """A fault-tolerant fit's metrics in one process: a step's values count once the step commits."""

    def on_train_epoch_start(self, trainer, module):
        trainer.metrics.commits = True


@pytest.mark.parametrize("commits", [False, True], ids=["plain", "values-count-at-commit"])
@pytest.mark.parametrize("log_every", [2, 3], ids=["saved-at-logging-steps", "saved-inside-a-window"])
def test_a_checkpoint_saved_at_a_logging_steps_batch_end_resumes_with_that_steps_log(tmp_path, log_every, commits):
    """ModelCheckpoint saves at a logging step's batch end, before its row (which waits for what the hooks
    there log): the resumed fit writes the row first, with the rate that step used and the module's own
    train_loss, and its rows equal the uninterrupted fit's. Also where a step's values count once it commits
    (fault tolerance): what the module logged at the batch's end, before the save, is the committed step's."""
    def fit(folder, steps, resume=None):
        trainer = tc.quiet_trainer(max_steps=steps, log_every_n_steps=log_every, loggers=("csv",), log_dir=folder,
                                   checkpoint_dir=folder, resume=resume, callbacks=[
                                       *([CommitsSteps()] if commits else []),
                                       lockstep.ModelCheckpoint(every_n_steps=2, save_top_k=-1),
                                       lockstep.LearningRateMonitor("step")])
        trainer.fit(LogsAtTheBatchEnd(), TRAIN, batch_size=8)
        kept = [{k: v for k, v in r.items() if k in ("step", "train_loss", "index", "lr-0-0")} for r in _rows(folder)]
        return [row for row in kept if any(v for k, v in row.items() if k != "step")]  # not checkpoint_blocked_s

    fit(tmp_path / "cut", 4)
    resumed = fit(tmp_path / "cut", 8, resume="auto")
    whole = fit(tmp_path / "whole", 8)
    assert [r["step"] for r in whole if r["index"]] == (["2", "4", "6", "8"] if log_every == 2 else ["3", "6"])
    assert resumed == whole


def test_the_learning_rate_monitor_logs_the_rate_each_logging_step_used(tmp_path):
    class Halved(Net):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=1.0)
            return {"optimizer": optimizer, "lr_scheduler": {
                "scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5), "interval": "step"}}

    trainer = tc.quiet_trainer(max_steps=4, log_every_n_steps=1, loggers=("csv",), log_dir=tmp_path,
                               callbacks=[lockstep.LearningRateMonitor("step")])
    trainer.fit(Halved(), TRAIN, batch_size=8)
    assert [float(r["lr-0-0"]) for r in _rows(tmp_path) if r.get("lr-0-0")] == [1.0, 0.5, 0.25, 0.125]


@pytest.mark.parametrize("check_finite", [True, False])
def test_early_stopping_stops_on_a_nan_score_unless_told_not_to(check_finite):
    scores = [5.0, math.nan, 4.0, 4.0, 4.0, 4.0]
    stopping = lockstep.EarlyStopping("score", patience=3, check_finite=check_finite)
    trainer = tc.quiet_trainer(max_epochs=6, callbacks=[stopping])
    trainer.fit(Net(scores), TRAIN, VAL, batch_size=8)
    # a NaN compares false: without the check, 4.0 (epoch 3) improves on 5.0, and 3 epochs later the fit stops
    assert (trainer.global_step, stopping.stopped_at_step) == ((10, 10) if check_finite else (30, 30))


def _saved(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("epoch="))


def test_a_step_interval_alone_saves_no_epoch_end(tmp_path):
    trainer = tc.quiet_trainer(max_epochs=2, checkpoint_dir=tmp_path,
                               callbacks=[lockstep.ModelCheckpoint(every_n_steps=3, save_top_k=-1, save_last=False)])
    trainer.fit(Net(), TRAIN, batch_size=8)
    assert _saved(tmp_path) == ["epoch=1-step=00000003.ckpt", "epoch=2-step=00000006.ckpt",
                                "epoch=2-step=00000009.ckpt"]


@pytest.mark.parametrize("save_last", [True, False])
def test_the_final_save_follows_save_last_and_names_the_epoch_of_its_step(tmp_path, save_last):
    saver = lockstep.ModelCheckpoint(every_n_epochs=2, save_top_k=-1, save_last=save_last)
    tc.quiet_trainer(max_epochs=3, checkpoint_dir=tmp_path, callbacks=[saver]).fit(Net(), TRAIN, batch_size=8)
    final = ["epoch=3-step=00000015.ckpt"] if save_last else []
    assert _saved(tmp_path) == ["epoch=2-step=00000010.ckpt", *final]
    if save_last:
        assert read_metadata(tmp_path / final[0])["epoch"] == 3


def test_a_monitored_step_save_before_the_first_validation_is_skipped_not_refused(tmp_path, capsys):
    saver = lockstep.ModelCheckpoint(monitor="val_loss", every_n_steps=2, save_top_k=-1, save_last=False)
    tc.quiet_trainer(max_epochs=2, checkpoint_dir=tmp_path, callbacks=[saver]).fit(Net(), TRAIN, VAL, batch_size=8)
    # steps 2 and 4 come before the first validation (epoch 1's end); the next ones are scored by it
    assert _saved(tmp_path) == [f"epoch=2-step={s:08d}.ckpt" for s in (6, 8, 10)]
    assert "skips its saves until the metric is logged (step 2: no validation has run yet)" in capsys.readouterr().out


def test_the_best_checkpoint_is_known_after_a_resume(tmp_path):
    """The fit is run again with resume='auto' (a requeue): best_model_path and best_model_score come from
    the folder, and test(ckpt_path='best') finds them."""
    scores = [3.0, 1.0, 2.0]

    def fit(epochs):
        saver = lockstep.ModelCheckpoint(monitor="score", save_top_k=1)
        trainer = tc.quiet_trainer(max_epochs=epochs, checkpoint_dir=tmp_path, resume="auto", callbacks=[saver])
        trainer.fit(Net(scores), TRAIN, VAL, batch_size=8)
        return saver

    first = fit(2)
    again = fit(3)  # epoch 3 scores 2.0: worse, not kept
    assert again.best_model_path == first.best_model_path == str(tmp_path / "epoch=2-step=00000010.ckpt")
    assert again.best_model_score == 1.0


def test_configure_optimizers_may_return_a_list_of_optimizers():
    class Listed(Net):
        def configure_optimizers(self):
            return [torch.optim.SGD(self.parameters(), lr=0.1)]

    weights = tc.checks.flat_weights(tc.quiet_trainer(max_steps=3).fit(Listed(), TRAIN, batch_size=8).module)
    reference = tc.checks.flat_weights(tc.quiet_trainer(max_steps=3).fit(Net(), TRAIN, batch_size=8).module)
    assert torch.equal(weights, reference)


class _Accuracy:  # what a torchmetrics Metric offers self.log
    def update(self, *args):
        pass

    def compute(self):
        return torch.tensor(1.0)


@pytest.mark.parametrize("options", [{"on_step": False, "on_epoch": False}, {"value": _Accuracy()}],
                         ids=["logs-nothing", "metric-object"])
def test_a_log_call_that_would_log_nothing_or_a_metric_object_is_refused(options):
    value = options.pop("value", 1.0)

    class Logs(Net):
        def training_step(self, batch, batch_idx):
            self.log("m", value, **options)
            return super().training_step(batch, batch_idx)

    with pytest.raises(UsageError, match="would log nothing|lockstep logs tensors and numbers"):
        tc.quiet_trainer(max_steps=1).fit(Logs(), TRAIN, batch_size=8)


def test_train_loss_logged_on_some_batches_only_takes_the_name_and_the_epochs_value(tmp_path):
    """The module logs train_loss on odd batches (valid in Lightning; it was refused once the Trainer had
    recorded batch 0's returned loss under that name): the epoch's value is the mean of the module's values."""
    class Sometimes(Net):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            if batch_idx % 2 == 1:
                self.log("train_loss", loss)
                self.seen.append(float(loss))
            return loss

    module = Sometimes()
    module.seen = []
    trainer = tc.quiet_trainer(max_epochs=1, log_every_n_steps=1, loggers=("csv",), log_dir=tmp_path)
    trainer.fit(module, TRAIN, batch_size=8)
    assert trainer.callback_metrics["train_loss"] == pytest.approx(sum(module.seen) / 2, rel=1e-6)
    rows = _rows(tmp_path)
    assert [float(r["train_loss"]) for r in rows if r["step"] in ("2", "4") and r["train_loss"]] == \
        pytest.approx(module.seen, rel=1e-6)
    assert all(any(v for k, v in r.items() if k != "step") for r in rows)  # no empty row (step 3 logged nothing)
