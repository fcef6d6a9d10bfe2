"""ModelCheckpoint with validation inside epochs (val_check_interval): the best checkpoint holds the weights that
scored best, a step's checkpoint holds that step's validation (a resume equals the uninterrupted fit), and a
NaN score ranks last. 40 samples in batches of 8: 5 steps an epoch; validation every 3 steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import lockstep
from checks import trainer as tc

pytestmark = pytest.mark.timeout(120)

_g = torch.Generator().manual_seed(0)
TRAIN = TensorDataset(torch.randn(40, 8, generator=_g), torch.randn(40, 4, generator=_g))
VAL = TensorDataset(torch.randn(12, 8, generator=_g), torch.randn(12, 4, generator=_g))


class Net(lockstep.Module):
    def __init__(self, scores=None, lr: float = 0.3) -> None:
        super().__init__()
        self.lr = lr
        torch.manual_seed(1)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        self.scores = scores  # epoch i's validation logs scores[i] as "score" (a NaN, say)

    def training_step(self, batch, batch_idx):
        return F.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.mse_loss(self.net(batch[0]), batch[1]))
        if self.scores is not None:
            self.log("score", self.scores[self.trainer.current_epoch])

    test_step = validation_step

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


class Validations(lockstep.Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[int, float]] = []

    def on_validation_epoch_end(self, trainer, module):
        self.seen.append((trainer.global_step, trainer.callback_metrics["val_loss"]))


class CrashAt(lockstep.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            raise RuntimeError(f"crash at step {self.step}")


def trainer(folder, *callbacks, **options) -> lockstep.Trainer:
    return tc.quiet_trainer(max_epochs=3, val_check_interval=3, checkpoint_dir=folder, callbacks=list(callbacks),
                            **options)


def test_the_best_checkpoint_holds_the_weights_that_scored_best(tmp_path):
    checkpoint, validations = lockstep.ModelCheckpoint(monitor="val_loss", save_top_k=1), Validations()
    fit = trainer(tmp_path, checkpoint, validations)
    fit.fit(Net(), TRAIN, VAL, batch_size=8)
    best_step, best = min(validations.seen, key=lambda seen: seen[1])
    assert [step for step, _ in validations.seen] == [3, 6, 9, 12, 15]
    assert checkpoint.best_model_path.endswith(f"step={best_step:08d}.ckpt")
    assert fit.test(Net(), VAL, batch_size=8, ckpt_path="best")["val_loss"] == pytest.approx(best, abs=1e-6)


def test_a_step_checkpoint_at_a_validation_holds_it_and_the_resumed_fit_equals_the_uninterrupted_one(tmp_path):
    """EarlyStopping(mode="max") on a falling loss stops the fit at the third validation (step 9): a checkpoint
    of step 3 written before step 3's validation would resume with no best score and never stop."""
    def run(folder, *extra):
        stopping = lockstep.EarlyStopping(monitor="val_loss", mode="max", patience=2)
        module = Net(lr=0.05)  # the validation loss falls at every validation
        trainer(folder, lockstep.ModelCheckpoint(every_n_steps=3, save_top_k=-1), stopping, *extra,
                resume="auto").fit(module, TRAIN, VAL, batch_size=8)
        return module, stopping

    whole, stopped = run(tmp_path / "whole")
    with pytest.raises(RuntimeError, match="crash at step 4"):
        run(tmp_path / "resumed", CrashAt(4))
    resumed, stopped_again = run(tmp_path / "resumed")
    assert (stopped.stopped_at_step, stopped_again.stopped_at_step) == (9, 9), (stopped.best, stopped_again.best)
    assert (stopped.best, stopped.wait) == (stopped_again.best, stopped_again.wait)
    for a, b in zip(whole.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_a_fit_that_early_stopped_resumed_from_its_last_checkpoint_stays_stopped(tmp_path):
    """A fit started again on its folder (a requeue, the script run again) after EarlyStopping ended it at step 9
    resumes from step 9's checkpoint, written after the stop: it trains no further step and writes nothing."""
    def run():
        stopping, module = lockstep.EarlyStopping(monitor="val_loss", mode="max", patience=2), Net(lr=0.05)
        fit = trainer(tmp_path, lockstep.ModelCheckpoint(every_n_steps=3, save_top_k=-1), stopping, resume="auto")
        fit.fit(module, TRAIN, VAL, batch_size=8)
        return fit, module

    first, module = run()
    written = sorted(path.name for path in tmp_path.glob("*.ckpt"))
    assert first.global_step == 9 and "epoch=2-step=00000009.ckpt" in written, written
    again, resumed = run()
    assert again.global_step == 9 and sorted(path.name for path in tmp_path.glob("*.ckpt")) == written
    for a, b in zip(module.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_a_nan_score_ranks_last(tmp_path):
    checkpoint = lockstep.ModelCheckpoint(monitor="score", save_top_k=2)
    fit = tc.quiet_trainer(max_epochs=3, checkpoint_dir=tmp_path, callbacks=[checkpoint])
    fit.fit(Net(scores=[3.0, float("nan"), 2.0]), TRAIN, VAL, batch_size=8)
    kept = sorted(path.name for path in tmp_path.glob("epoch=*"))
    assert kept == ["epoch=1-step=00000005.ckpt", "epoch=3-step=00000015.ckpt"], kept  # scores 3.0 and 2.0
    assert checkpoint.best_model_path.endswith("epoch=3-step=00000015.ckpt")


class SaveAt(lockstep.Callback):
    """A checkpoint written at the step's end, before the validation that follows it (as a preemption's is)."""

    def __init__(self, step: int, path) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def test_a_fit_resumed_from_before_a_steps_validation_runs_it_first_and_equals_the_uninterrupted_one(tmp_path):
    def run(*extra, resume=None):
        stopping = lockstep.EarlyStopping(monitor="val_loss", mode="max", patience=2)
        module = Net(lr=0.05)
        tc.quiet_trainer(max_epochs=3, val_check_interval=3, callbacks=[stopping, *extra], resume=resume).fit(
            module, TRAIN, VAL, batch_size=8)
        return module, stopping

    whole, stopped = run()
    with pytest.raises(RuntimeError, match="crash at step 4"):
        run(SaveAt(3, tmp_path / "at3"), CrashAt(4))
    resumed, stopped_again = run(resume=str(tmp_path / "at3"))
    assert (stopped.stopped_at_step, stopped_again.stopped_at_step) == (9, 9)
    assert (stopped.best, stopped.wait) == (stopped_again.best, stopped_again.wait)
    for a, b in zip(whole.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def _saving_fit(folder, seed: int, resume=None) -> lockstep.Trainer:
    trainer = tc.quiet_trainer(max_steps=10, checkpoint_dir=folder, resume=resume,
                               callbacks=[lockstep.ModelCheckpoint(every_n_steps=5, save_top_k=-1)])
    trainer.fit(Net(lr=0.1 * seed), TRAIN, batch_size=8)
    return trainer


def test_a_fit_that_would_write_among_another_runs_later_checkpoints_is_refused_before_training(tmp_path):
    """Before, a save at a name the other run had used was skipped: the folder kept that run's weights under
    this fit's step, and resume="auto" would later continue the other run."""
    _saving_fit(tmp_path, 1)  # steps 5 and 10
    names = sorted(p.name for p in tmp_path.glob("epoch=*"))
    assert names == ["epoch=1-step=00000005.ckpt", "epoch=2-step=00000010.ckpt"]
    with pytest.raises(lockstep.ConfigError, match=r"starts at step 0 \(epoch=1-step=00000005.ckpt, "
                                                   r"epoch=2-step=00000010.ckpt\): another run's"):
        _saving_fit(tmp_path, 2)  # a fresh fit in the same folder
    with pytest.raises(lockstep.ConfigError, match=r"resumes from step 5 \(epoch=2-step=00000010.ckpt\)"):
        _saving_fit(tmp_path, 2, resume=tmp_path / names[0])  # an older checkpoint of it
    again = _saving_fit(tmp_path, 1, resume="auto")  # the run itself, continued: nothing to train, nothing refused
    assert again.global_step == 10
    resumed = _saving_fit(tmp_path / "other", 2, resume=tmp_path / names[0])  # the same, into a folder of its own
    assert resumed.global_step == 10 and (tmp_path / "other" / names[1]).is_dir()
