"""What configure_optimizers returns, run as Lightning does: the scheduler configuration (interval, frequency,
a scheduler that reduces on a plateau with its monitor, strict, name), against rates computed by hand and torch's
own scheduler; several optimizers with clipping and 16-mixed, against torch's recipe."""

from __future__ import annotations

import warnings

import pytest
import torch

import lockstep
from checks import trainer as tc

pytestmark = pytest.mark.timeout(120)


class WithScheduler(tc.Classifier):
    """``make(optimizer)`` gives what configure_optimizers returns beside the optimizer; ``lrs`` records the
    learning rate after each optimizer step."""

    def __init__(self, make, lr: float = 0.1) -> None:
        super().__init__(lr=lr)
        self.make, self.lrs = make, []

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        return {"optimizer": optimizer, **self.make(optimizer)}



class Rates(lockstep.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        module.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


def fit(make, epochs: int = 3, lr: float = 0.1, callbacks=(), **options) -> WithScheduler:
    module = WithScheduler(make, lr)
    # 64 samples in batches of 16: 4 steps an epoch
    trainer = tc.quiet_trainer(max_epochs=epochs, callbacks=[Rates(), *callbacks], **options)
    trainer.fit(module, tc.checks.make_data(64), tc.checks.make_data(32, seed=1), batch_size=16)
    return module


def halving(interval: str, frequency: int):
    return lambda optimizer: {"lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5),
                                               "interval": interval, "frequency": frequency}}


def test_a_scheduler_steps_every_frequency_steps_or_epochs():
    by_steps = fit(halving("step", 3), epochs=2)
    assert by_steps.lrs == pytest.approx([0.1 * 0.5 ** ((step + 1) // 3) for step in range(8)])
    by_epochs = fit(halving("epoch", 2), epochs=4)  # halved after epochs 2 and 4: seen during epochs 3 and 4
    assert by_epochs.lrs == pytest.approx([0.1] * 8 + [0.05] * 8)


def test_reduce_on_plateau_follows_torchs_own_scheduler_fed_the_logged_values():
    seen = []

    class Recorder(lockstep.Callback):
        def on_train_epoch_end(self, trainer, module):
            seen.append(trainer.callback_metrics["val_loss"])

    def plateau(optimizer):
        # threshold 1.0: only a loss below half the best counts as better, so the rate is cut at most epochs' ends
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=1.0)
        return {"lr_scheduler": scheduler, "monitor": "val_loss"}  # the monitor beside it, as Lightning allows

    module = fit(plateau, epochs=4, lr=0.5, callbacks=[Recorder()])
    reference = torch.optim.lr_scheduler.ReduceLROnPlateau(torch.optim.SGD([torch.zeros(1)], lr=0.5), factor=0.5,
                                                           patience=0, threshold=1.0)
    expected = []
    for value in seen:
        expected.append(reference.optimizer.param_groups[0]["lr"])
        reference.step(value)
    assert len(seen) == 4 and module.lrs[::4] == pytest.approx(expected)  # each epoch's first step
    assert len(set(expected)) > 1  # the schedule did change the rate in this run
    assert module.trainer.lr_schedulers[0].on_plateau


def test_reduce_on_plateau_by_steps_steps_with_the_monitored_value_each_due_step():
    """interval="step": after each due optimizer step, with the monitored value as logged so far (train_loss,
    logged every step here): with a relative threshold of 1.0 no value counts as better, not even the first, so
    each due step (2 and 4) halves the rate; the others leave it. As in Lightning, it steps after the step's
    on_train_batch_end (where the rate is read): the halving at step 2 is seen at step 3."""
    def plateau(optimizer):
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=1.0)
        return {"lr_scheduler": {"scheduler": scheduler, "monitor": "train_loss", "interval": "step",
                                 "frequency": 2}}

    module = fit(plateau, epochs=1, lr=0.1, log_every_n_steps=1)
    assert module.lrs == pytest.approx([0.1, 0.1, 0.05, 0.05])  # read at steps 1 to 4


def test_a_missing_monitor_is_an_error_or_with_strict_false_a_warning():
    def monitoring(name, strict=True):
        return lambda optimizer: {"lr_scheduler": {
            "scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer), "monitor": name, "strict": strict}}

    with pytest.raises(ValueError, match="monitors 'val_los', which no step has logged.*val_loss"):
        fit(monitoring("val_los"), epochs=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(monitoring("val_los", strict=False), epochs=1)
    assert any("is skipped ('strict': False)" in str(w.message) for w in caught)


@pytest.mark.parametrize("config, match", [
    ({"interval": "batch"}, "interval 'batch'"),
    ({"frequency": 0}, "frequency 0"),
    ({"frequncy": 2}, "takes the keys"),
    ({"reduce_on_plateau": True}, "drop the key"),
])
def test_bad_scheduler_configurations_are_refused_by_name(config, match):
    def make(optimizer):
        return {"lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1), **config}}

    with pytest.raises(ValueError, match=match):
        fit(make, epochs=1)
    with pytest.raises(ValueError, match="ReduceLROnPlateau steps with a metric"):
        fit(lambda optimizer: {"lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)}, epochs=1)


def test_the_learning_rate_monitor_names_an_optimizer_by_its_schedulers_name(tmp_path):
    def named(optimizer):
        return {"lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1), "name": "head"}}

    module = WithScheduler(named)
    trainer = tc.quiet_trainer(max_steps=2, log_every_n_steps=1, callbacks=[lockstep.LearningRateMonitor()])
    trainer.fit(module, tc.checks.make_data(64), batch_size=16)
    assert "lr-head-0" in trainer.callback_metrics and "lr-0-0" not in trainer.callback_metrics


class TwoOptimizers(lockstep.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self):
        return [torch.optim.SGD(self.a.parameters(), lr=0.1), torch.optim.SGD(self.b.parameters(), lr=0.1)], []


@pytest.mark.parametrize("precision", ["16-mixed", "32-true"])
def test_two_optimizers_with_clipping_equal_torchs_recipe(precision):
    """gradient_clip_val clips the total norm of every optimizer's gradients, each unscaled first; the scale
    moves once a step: torch's recipe for several optimizers, bit for bit."""
    x, y = torch.randn(32, 8, generator=torch.Generator().manual_seed(2)), torch.randn(32, 4)
    module = TwoOptimizers()
    in_order = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)  # no shuffle
    tc.quiet_trainer(max_epochs=2, precision=precision, gradient_clip_val=0.5).fit(module, in_order)
    reference = TwoOptimizers()
    first, second = reference.configure_optimizers()[0]
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "16-mixed")
    for _ in range(2):
        for rows in torch.arange(32).split(8):
            with torch.autocast("cpu", dtype=torch.float16, enabled=precision == "16-mixed"):
                out = reference(x[rows])
            scaler.scale(torch.nn.functional.mse_loss(out.float(), y[rows])).backward()
            scaler.unscale_(first)
            scaler.unscale_(second)
            torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
            scaler.step(first)
            scaler.step(second)
            scaler.update()
            first.zero_grad()
            second.zero_grad()
    for (name, got), want in zip(module.state_dict().items(), reference.state_dict().values(), strict=True):
        assert torch.equal(got, want), name
