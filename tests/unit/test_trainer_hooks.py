"""What a module ported from Lightning defines: its own hooks run (before the callbacks'), a Lightning hook
lockstep never calls is refused rather than ignored, as is manual optimization, a float val_check_interval and
several evaluation datasets; a checkpoint written during an epoch's end resumes as the uninterrupted fit ran;
LearningRateMonitor("epoch") logs the rate each epoch used."""

from __future__ import annotations

import pytest
import torch

import lockstep
from checks import trainer as tc

pytestmark = pytest.mark.timeout(120)


class Hooked(tc.Classifier):
    """Records its hooks; saves a key of its own in each checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def on_fit_start(self):
        self.calls.append("fit_start")

    def on_train_epoch_start(self):
        self.calls.append(f"epoch_start {self.trainer.current_epoch}")

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.calls.append(f"batch_end {batch_idx}")

    def on_before_backward(self, loss):
        assert loss.requires_grad

    def on_validation_epoch_end(self):
        self.calls.append("validation_epoch_end")

    def on_save_checkpoint(self, checkpoint):
        checkpoint["mine"] = {"saved_at": self.trainer.global_step}

    def on_load_checkpoint(self, checkpoint):
        self.calls.append(f"loaded {checkpoint['mine']}")


class Order(lockstep.Callback):
    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        module.calls.append(f"callback {batch_idx}")


def test_a_modules_hooks_run_with_lightnings_arguments_before_the_callbacks_and_its_checkpoint_key_returns(tmp_path):
    module = Hooked()
    tc.quiet_trainer(max_epochs=1, callbacks=[Order()], checkpoint_dir=tmp_path).fit(
        module, tc.checks.make_data(32), tc.checks.make_data(16, seed=1), batch_size=16)
    assert module.calls == ["fit_start", "epoch_start 0", "batch_end 0", "callback 0", "batch_end 1", "callback 1",
                            "validation_epoch_end"]
    resumed = Hooked()
    tc.quiet_trainer(max_epochs=2, checkpoint_dir=tmp_path, resume="auto").fit(
        resumed, tc.checks.make_data(32), batch_size=16)
    assert resumed.calls[:3] == ["loaded {'saved_at': 2}", "fit_start", "epoch_start 1"]


@pytest.mark.parametrize("owner", ["module", "callback"])
def test_a_lightning_hook_lockstep_never_calls_is_refused_by_name(owner):
    class Module(tc.Classifier):
        def on_after_backward(self):  # noqa: D102 - a Lightning hook
            pass

    class Callback(lockstep.Callback):
        def on_validation_batch_end(self, trainer, module, outputs, batch, batch_idx):  # a Lightning hook
            pass

    module, callbacks = (Module(), []) if owner == "module" else (tc.Classifier(), [Callback()])
    with pytest.raises(lockstep.ConfigError, match=r"(Module\.on_after_backward|Callback\.on_validation_batch_end):"
                                                   r" lockstep never calls"):
        tc.quiet_trainer(max_epochs=1, callbacks=callbacks).fit(module, tc.checks.make_data(16), batch_size=8)


def test_manual_optimization_is_refused_with_the_runtime_api_named():
    class Manual(tc.Classifier):
        automatic_optimization = False

    with pytest.raises(lockstep.ConfigError, match="automatic_optimization = False.*rt.backward"):
        tc.quiet_trainer(max_epochs=1).fit(Manual(), tc.checks.make_data(16), batch_size=8)


@pytest.mark.parametrize("value", [0.5, 1.0, -1, 0, True])
def test_val_check_interval_takes_whole_steps_only(value):
    with pytest.raises(lockstep.ConfigError, match=f"val_check_interval={value!r}: must be a whole number"):
        lockstep.Trainer(val_check_interval=value, accelerator="cpu")


@pytest.mark.parametrize("several", ["list", "dict"])
def test_several_evaluation_datasets_given_as_one_are_refused(several):
    datasets = [tc.checks.make_data(8), tc.checks.make_data(6, seed=1)]
    given = datasets if several == "list" else {"a": datasets[0], "b": datasets[1]}
    with pytest.raises(lockstep.ConfigError, match=f"a {several} of 2 datasets or DataLoaders was given"):
        tc.quiet_trainer(max_epochs=1).fit(tc.Classifier(), tc.checks.make_data(16), given, batch_size=8)


class Plateau(tc.Classifier):
    """ReduceLROnPlateau on the validation loss; records the rate of each epoch's first step."""

    def __init__(self) -> None:
        super().__init__(lr=0.5)
        self.rates: dict[int, float] = {}

    def on_train_epoch_start(self):
        self.rates[self.trainer.current_epoch] = self.trainer.optimizers[0].param_groups[0]["lr"]

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
        # threshold 1.0: only a loss below half the best is better, so the rate is cut at most epochs' ends
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=1.0)
        return {"optimizer": optimizer, "lr_scheduler": scheduler, "monitor": "val_loss"}


class SaveAtValidationEnd(lockstep.Callback):
    """Saves in on_validation_end of epoch ``epoch`` (where Lightning's ModelCheckpoint saves), then stops the
    run there when ``crash``."""

    def __init__(self, path, epoch: int, crash: bool) -> None:
        self.path, self.epoch, self.crash = path, epoch, crash

    def on_validation_end(self, trainer, module):
        if trainer.current_epoch == self.epoch:
            trainer.save_checkpoint(self.path / f"epoch{self.epoch}")
            if self.crash:
                raise KeyboardInterrupt


def test_a_checkpoint_saved_during_an_epochs_end_validation_resumes_with_its_plateau_step(tmp_path):
    data, val = tc.checks.make_data(64), tc.checks.make_data(32, seed=1)
    whole = Plateau()
    tc.quiet_trainer(max_epochs=4, callbacks=[SaveAtValidationEnd(tmp_path / "a", 1, crash=False)]).fit(
        whole, data, val, batch_size=16)
    assert len(set(whole.rates.values())) > 1  # the plateau did cut the rate in this run
    with pytest.raises(KeyboardInterrupt):
        tc.quiet_trainer(max_epochs=4, callbacks=[SaveAtValidationEnd(tmp_path / "b", 1, crash=True)]).fit(
            Plateau(), data, val, batch_size=16)
    resumed = Plateau()
    tc.quiet_trainer(max_epochs=4, resume=tmp_path / "b" / "epoch1").fit(resumed, data, val, batch_size=16)
    assert resumed.rates == {epoch: rate for epoch, rate in whole.rates.items() if epoch >= 2}
    assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), whole.parameters(), strict=True))


def test_the_epoch_learning_rate_logged_is_the_one_each_epoch_used():
    class Halving(tc.Classifier):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=self.lr)
            return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5)}

    logged = []

    class Logger:
        def log_metrics(self, metrics, step):
            logged.extend((step, value) for name, value in metrics.items() if name.startswith("lr-"))

        def log_hyperparams(self, params):
            pass

        def finalize(self):
            pass

    trainer = tc.quiet_trainer(max_epochs=3, callbacks=[lockstep.LearningRateMonitor("epoch")], loggers=[Logger()])
    trainer.fit(Halving(), tc.checks.make_data(32), batch_size=16)  # 2 steps an epoch
    assert logged == [(0, pytest.approx(0.1)), (2, pytest.approx(0.05)), (4, pytest.approx(0.025))]


def test_a_test_before_any_fit_writes_its_metrics_to_the_loggers(tmp_path):
    import csv

    trainer = tc.quiet_trainer(loggers=("csv",), log_dir=tmp_path)
    metrics = trainer.test(tc.Classifier(), tc.checks.make_data(11), batch_size=4)
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert [float(rows[-1]["val_loss"])] == [pytest.approx(metrics["val_loss"])]


def test_val_check_interval_without_validation_data_trains_without_validating():
    trainer = tc.quiet_trainer(max_steps=6, val_check_interval=2)  # as Lightning: nothing to validate
    trainer.fit(tc.Classifier(), tc.checks.make_data(32), batch_size=8)
    assert trainer.global_step == 6 and "val_loss" not in trainer.callback_metrics


def test_a_module_that_is_a_callback_too_runs_as_a_callback():
    class Both(tc.Classifier, lockstep.Callback):
        def on_train_epoch_start(self, trainer, module):
            module.started = trainer.current_epoch

    module = Both()
    tc.quiet_trainer(max_epochs=1, callbacks=[module]).fit(module, tc.checks.make_data(16), batch_size=8)
    assert module.started == 0


def test_a_validate_before_a_resumed_fit_keeps_the_runs_logs(tmp_path):
    import csv

    def steps():
        return [row["step"] for row in csv.DictReader((tmp_path / "metrics.csv").open()) if row.get("train_loss")]

    data, val = tc.checks.make_data(32), tc.checks.make_data(8, seed=1)
    options = dict(checkpoint_dir=tmp_path, loggers=("csv",), log_every_n_steps=1)
    tc.quiet_trainer(max_epochs=1, **options).fit(tc.Classifier(), data, batch_size=8)
    assert steps() == ["1", "2", "3", "4"]
    resumed = tc.quiet_trainer(max_epochs=2, resume="auto", **options)
    resumed.validate(tc.Classifier(), val, batch_size=4)
    resumed.fit(tc.Classifier(), data, batch_size=8)
    assert steps() == ["1", "2", "3", "4", "5", "6", "7", "8"]
