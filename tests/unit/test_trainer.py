"""The Trainer against the runtime loop, single-process references, and its own promises."""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path

import pytest
import torch

import lockstep
from checks import dist as checks
from checks import trainer as tc

pytestmark = pytest.mark.timeout(180)


# -- what a user gets told -------------------------------------------------------------------------
class _EmptyStream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(())


def test_fit_on_one_process_equals_the_runtime_loop():
    assert torch.equal(tc.fit_weights(), tc.runtime_loop_weights())
    assert checks.flat_weights(tc.Classifier()).shape == tc.fit_weights().shape


def test_fit_needs_a_stop_condition_and_a_module():
    with pytest.raises(ValueError, match="fit needs a stopping rule: give the Trainer max_epochs or max_steps"):
        tc.quiet_trainer().fit(tc.Classifier(), checks.make_data(8), batch_size=4)
    with pytest.raises(TypeError, match="runs a lockstep.Module"):
        tc.quiet_trainer(max_epochs=1).fit(torch.nn.Linear(2, 2), checks.make_data(8), batch_size=4)


def test_val_check_interval_validates_every_n_steps(tmp_path):
    trainer = tc.quiet_trainer(max_epochs=1, val_check_interval=2, loggers=("jsonl",), log_dir=tmp_path,
                               gradient_clip_val=0.5)
    trainer.fit(tc.Classifier(), tc.checks.make_data(96), tc.checks.make_data(20, seed=3), batch_size=16)
    import json

    steps = [r["step"] for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if "val_acc" in r]
    assert steps == [2, 4, 6]


def test_16_mixed_trainer_runs_and_reports_finite_loss():
    trainer = tc.quiet_trainer(max_epochs=1, precision="16-mixed", log_every_n_steps=2)
    trainer.fit(tc.Classifier(), tc.checks.make_data(64), batch_size=16)
    assert 0 < trainer.callback_metrics["train_loss"] < 10


def test_settings_are_one_frozen_config_that_reaches_the_logged_hparams(tmp_path):
    trainer = tc.quiet_trainer(max_steps=2, val_check_interval=1, timeout=30, num_workers=0, loggers=("csv",),
                               log_dir=tmp_path)
    with pytest.raises(RuntimeError, match="no Runtime yet"):
        trainer.runtime  # noqa: B018 - reading a property must not start processes or join a group
    assert trainer.is_global_zero
    module = tc.Classifier()
    trainer.fit(module, checks.make_data(32), checks.make_data(16), batch_size=8)
    logged = json.loads((tmp_path / "hparams.json").read_text())
    assert (logged["val_check_interval"], logged["timeout"], logged["num_workers"], logged["deterministic"]) == \
        (1, 30, 0, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        trainer.config.max_steps = 3  # type: ignore[misc]
    copied = pickle.loads(pickle.dumps(module))  # the module holds its Trainer weakly: copies leave it
    assert torch.equal(copied.net[0].weight, module.net[0].weight)
    with pytest.raises(RuntimeError, match="not attached"):
        copied.trainer  # noqa: B018


def test_metrics_of_mapping_batches_are_exact_over_the_dataset():
    module = tc.MappingBatches()
    data = checks.make_data(45)  # batches of 20, 20 and 5: a plain mean of batch means would be off
    loader = torch.utils.data.DataLoader(data, batch_size=20, collate_fn=tc.collate_to_mapping)
    metrics = tc.quiet_trainer(max_epochs=1).validate(module, loader)
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(module(data.tensors[0]), data.tensors[1])
    assert abs(metrics["val_loss"] - float(expected)) < 1e-6


def test_empty_training_data_is_an_error_and_a_batch_larger_than_the_data_is_said(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"the training data \(TensorDataset\) holds no samples"):
        tc.quiet_trainer(max_epochs=1).fit(tc.Classifier(), checks.make_data(0), batch_size=8)
    with pytest.raises(ValueError, match="yielded no batch in epoch 1: an empty stream"):
        tc.quiet_trainer(max_steps=5).fit(tc.Classifier(), _EmptyStream(), batch_size=8)
    with pytest.raises(ValueError, match="drop_last=True drops the only batch"):
        tc.quiet_trainer(max_epochs=1).fit(tc.Classifier(), checks.make_data(5), batch_size=8,
                                           loader_options={"drop_last": True})
    assert not list(tmp_path.rglob("*.ckpt"))
    trainer = tc.quiet_trainer(max_epochs=2)
    trainer.fit(tc.Classifier(), checks.make_data(5), batch_size=8)
    assert "batch_size=8 is larger than the training data (5 samples): each epoch is one step of 5" in \
        capsys.readouterr().out
    assert trainer.global_step == 2


def test_empty_validation_test_and_predict_data_are_errors_before_any_step(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    class Counting(tc.Classifier):
        steps = 0

        def training_step(self, batch, batch_idx):
            Counting.steps += 1
            return super().training_step(batch, batch_idx)

    for empty in (checks.make_data(0), torch.utils.data.DataLoader(checks.make_data(0), batch_size=4)):
        with pytest.raises(ValueError, match=r"the validation data \(TensorDataset\) holds no samples: validation "
                                             "would cover nothing"):
            tc.quiet_trainer(max_epochs=1, callbacks=[lockstep.EarlyStopping(monitor="val_loss")]).fit(
                Counting(), checks.make_data(32), empty, batch_size=8)
    assert Counting.steps == 0
    with pytest.raises(ValueError, match=r"the test data \(TensorDataset\) holds no samples"):
        tc.quiet_trainer().test(tc.Classifier(), checks.make_data(0), batch_size=8)
    with pytest.raises(ValueError, match=r"the validation data \(TensorDataset\) holds no samples"):
        tc.quiet_trainer().validate(tc.Classifier(), checks.make_data(0), batch_size=8)
    with pytest.raises(ValueError, match=r"the predict data \(TensorDataset\) holds no samples"):
        tc.quiet_trainer().predict(tc.Classifier(), checks.make_data(0), batch_size=8)
    # a stream without __len__ is known to be empty once read: at its first pass
    with pytest.raises(ValueError, match=r"the validation data \(_EmptyStream\) holds no samples"):
        tc.quiet_trainer().validate(tc.Classifier(), _EmptyStream(), batch_size=8)
    with pytest.raises(ValueError, match=r"the predict data \(_EmptyStream\) holds no samples"):
        tc.quiet_trainer().predict(tc.Classifier(), _EmptyStream(), batch_size=8)


def test_a_resume_path_that_is_no_checkpoint_says_what_it_is(tmp_path):
    (tmp_path / "a-file").write_text("")
    (tmp_path / "a-folder").mkdir()
    cases = {"missing": "no such checkpoint", "a-file": "a file, not a checkpoint folder",
             "a-folder": r"not a lockstep checkpoint \(it holds no lockstep.json\)"}
    for name, message in cases.items():
        with pytest.raises(Exception, match=message) as raised:
            tc.quiet_trainer(max_epochs=1, resume=tmp_path / name).fit(tc.Classifier(), checks.make_data(8),
                                                                      batch_size=4)
        assert "rank" not in str(raised.value) and "file system" not in str(raised.value)


def test_early_stopping_on_train_loss_with_epochs_shorter_than_the_logging_interval():
    """Epochs of 2 steps, logging every 50: train_loss holds each epoch's value at its end, as
    train_loss_epoch, and EarlyStopping judges it per epoch when there is no validation."""
    stopper = tc.lockstep.EarlyStopping(monitor="train_loss", patience=2, min_delta=1e-5)
    trainer = tc.quiet_trainer(max_epochs=20, callbacks=[stopper])
    trainer.fit(tc.Classifier(lr=0.0), checks.make_data(16), batch_size=8)  # never improves
    assert trainer.callback_metrics["train_loss"] == trainer.callback_metrics["train_loss_epoch"]
    assert trainer.current_epoch == 3 and stopper.stopped_at_step == 6



def test_a_store_keeps_step_values_and_sums_them_exactly_in_float64():
    """Per-step values are only kept (no tensor operation per step) and summed in float64 on reading,
    also past the fold every FOLD_EVERY values and with two weights: against a hand sum in float64."""
    from lockstep.train.metrics import MetricStore

    rt = lockstep.Runtime(accelerator="cpu", env=lockstep.DistEnv())
    store, generator = MetricStore(), torch.Generator().manual_seed(0)
    values = torch.randn(2 * MetricStore.FOLD_EVERY + 7, generator=generator) * 1e4 + 1.0
    weights = [32 if i % 5 else 7 for i in range(len(values))]
    for value, weight in zip(values, weights, strict=True):
        store.add_scalar("loss", value.float(), weight)
    expected = sum(float(v) * w for v, w in zip(values.double(), weights, strict=True)) / sum(weights)
    assert store.reduce(rt)["loss"] == pytest.approx(expected, rel=1e-15)
    rt.close()


def test_settled_values_reach_the_window_and_the_epoch_as_routed_and_leave_a_given_count_alone():
    """A step's values settle once into the window and the epoch (on_step=False / on_epoch=False leave one
    out); a float64 count tensor given as batch_size is copied, not summed into in place: against hand sums."""
    from lockstep.train.metrics import TrainingMetrics

    rt = lockstep.Runtime(accelerator="cpu", env=lockstep.DistEnv())
    metrics, count = TrainingMetrics(), torch.tensor(3.0, dtype=torch.float64)
    metrics.route("epoch_only", on_step=False, on_epoch=None)
    for step, value in enumerate([1.0, 2.0, 4.0], 1):
        metrics.recent.add_scalar("loss", torch.tensor(value), 32)
        metrics.recent.add("tokens", torch.tensor(value * 3.0, dtype=torch.float64), count)
        metrics.recent.add_scalar("epoch_only", torch.tensor(10.0 * value), 32)
        if step == 2:  # a logging step: the window is read and starts again
            metrics.settle()
            assert metrics.window.reduce(rt) == {"loss": 1.5, "tokens": 1.5}
            metrics.window.reset()
    metrics.settle()
    assert metrics.window.reduce(rt) == {"loss": 4.0, "tokens": 4.0}
    assert metrics.epoch.reduce(rt) == pytest.approx({"loss": 7 / 3, "tokens": 7 / 3, "epoch_only": 70 / 3})
    assert float(count) == 3.0, "the caller's count tensor was changed in place"
    # the flags belong to each value: a name logged on_step=False, then with the defaults, is in the window once
    metrics.reset()
    metrics.route("x", on_step=False, on_epoch=None)
    metrics.recent.add_scalar("x", torch.tensor(8.0), 1)
    metrics.route("x", on_step=None, on_epoch=None)
    metrics.recent.add_scalar("x", torch.tensor(2.0), 1)
    metrics.settle()
    assert metrics.window.reduce(rt) == {"x": 2.0} and metrics.epoch.reduce(rt) == {"x": 5.0}
    # fault tolerance: a checkpoint taken while a step is under way holds none of its values (not committed)
    metrics.reset()
    metrics.commits = True
    metrics.recent.add_scalar("loss", torch.tensor(1.0), 1)
    assert metrics.state_dict(rt)["window_metrics"] == [{"sums": {}, "counts": {}}]
    metrics.end_step(committed=False)
    assert metrics.state_dict(rt)["epoch_metrics"] == [{"sums": {}, "counts": {}}]
    rt.close()


def test_the_log_dir_is_known_before_fit_also_for_a_replica_group(tmp_path, monkeypatch):
    """``trainer.log_dir`` is where the fit will log, before the fit creates the Runtime."""
    assert lockstep.Trainer(accelerator="cpu", log_dir=tmp_path / "logs").log_dir == tmp_path / "logs"
    assert lockstep.Trainer(accelerator="cpu", checkpoint_dir=tmp_path / "c").log_dir == tmp_path / "c"
    assert lockstep.Trainer(accelerator="cpu").log_dir == Path("runs/lockstep")
    monkeypatch.setenv("LOCKSTEP_FAULT_TOLERANT", "1")  # what `lockstep run --fault-tolerant` sets for group 3
    monkeypatch.setenv("LOCKSTEP_REPLICA_GROUP", "3")
    assert lockstep.Trainer(accelerator="cpu", log_dir=tmp_path).log_dir == tmp_path / "replica-group-3"


class _LightningStyle(lockstep.Module):
    """A module as a LightningModule writes it: save_hyperparameters, self.hparams.lr, self.log's flags."""

    def __init__(self, hidden: int = 8, lr: float = 0.1, name: str = "run") -> None:
        super().__init__()
        self.save_hyperparameters(ignore="name")
        self.net = torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        self.log("steps_only", loss, on_step=True, on_epoch=False, sync_dist=True, prog_bar=True, logger=True)
        self.log_dict({"epoch_only": loss * 2}, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


def test_a_lightning_style_module_keeps_its_hyperparameters_and_its_log_flags(tmp_path):
    """save_hyperparameters, hparams (also as attributes), log_dict and self.log's on_step / on_epoch / sync_dist
    / logger ported as written; what has no meaning here is refused by name."""
    module = _LightningStyle(hidden=6)
    assert module.hparams == {"hidden": 6, "lr": 0.1} and module.hparams.hidden == 6
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 3, (16,)))
    trainer = tc.quiet_trainer(max_epochs=1, loggers=("csv",), log_dir=tmp_path, log_every_n_steps=1)
    trainer.fit(module, data, batch_size=4)
    assert json.loads((tmp_path / "hparams.json").read_text())["hidden"] == 6
    columns = (tmp_path / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "steps_only" in columns and "steps_only_epoch" not in columns, columns
    assert "epoch_only_epoch" in columns and "epoch_only" not in columns, columns
    with pytest.raises(lockstep.UsageError, match="takes no sync_ranks"):
        module.log("x", 1.0, sync_ranks=True)
    with pytest.raises(lockstep.UsageError, match="reduce_fx='max'"):
        module.log("x", 1.0, reduce_fx="max")
    for mean in ("avg", "MEAN", torch.mean):  # Lightning's spellings of the mean: taken (then refused here as
        with pytest.raises(lockstep.StateError, match="outside training_step"):  # outside a step, not for reduce_fx)
            module.log("x", 1.0, reduce_fx=mean)
    with pytest.raises(lockstep.UsageError, match="call it inside __init__"):
        module.save_hyperparameters()


def test_evaluation_from_a_checkpoint_loads_its_weights_best_last_or_a_folder(tmp_path):
    """ckpt_path, as Lightning's: "best" (ModelCheckpoint's best), "last" (the newest in checkpoint_dir) or a
    folder: the weights evaluated are that checkpoint's, not the module's current ones."""
    data = checks.make_data(40)
    trainer = tc.quiet_trainer(max_epochs=2, checkpoint_dir=tmp_path)
    module = tc.Classifier()
    with pytest.raises(lockstep.UsageError, match='ckpt_path="best": no ModelCheckpoint'):
        trainer.validate(module, data, batch_size=8, ckpt_path="best")
    trainer.fit(module, data, batch_size=8)
    trained = checks.flat_weights(module)
    with torch.no_grad():
        for param in module.parameters():
            param.zero_()
    best = trainer.validate(module, data, batch_size=8, ckpt_path="best")
    assert torch.equal(checks.flat_weights(module), trained)
    module.net[0].weight.data.zero_()
    newest = sorted(p for p in tmp_path.glob("epoch=*") if not p.is_symlink())[-1]
    assert trainer.validate(module, data, batch_size=8, ckpt_path=newest) == best
    module.net[0].weight.data.zero_()
    assert trainer.validate(module, data, batch_size=8, ckpt_path="last") == best
    with pytest.raises(lockstep.CheckpointError):
        trainer.validate(module, data, batch_size=8, ckpt_path=tmp_path / "nothing-here")


def test_on_train_log_runs_once_per_logging_step_with_its_reduced_values(tmp_path):
    """With accumulation over 2 batches and a logging step every 2 optimizer steps, on_train_log runs at
    steps 2, 4, 6 only, after the step, and sees that window's mean loss (the mean of its 4 batches'
    losses, by hand) in callback_metrics; a callback replaced by an assigned list is no longer called."""
    class Seen(lockstep.Callback):
        def __init__(self) -> None:
            self.logged, self.losses = [], []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.losses.append(float(outputs))

        def on_train_log(self, trainer, module):
            self.logged.append((trainer.global_step, trainer.callback_metrics["train_loss"]))

    seen = Seen()
    trainer = tc.quiet_trainer(max_steps=6, accumulate_grad_batches=2, log_every_n_steps=2, log_dir=tmp_path,
                               callbacks=[seen])
    data = torch.utils.data.TensorDataset(torch.randn(192, 8), torch.randint(0, 4, (192,)))
    trainer.fit(tc.Regressor(), data, batch_size=16)
    assert [step for step, _ in seen.logged] == [2, 4, 6]
    for window, (_, logged) in enumerate(seen.logged):
        assert logged == pytest.approx(sum(seen.losses[4 * window: 4 * window + 4]) / 4, rel=1e-6)
    held = trainer.callbacks
    trainer.callbacks += []  # changed in place: still the list held
    assert trainer.callbacks is held
    trainer.callbacks = []  # assigned: the hooks are found again
    trainer.config = dataclasses.replace(trainer.config, max_steps=8)
    trainer.fit(tc.Regressor(), data, batch_size=16)
    assert len(seen.logged) == 3


def test_callbacks_changed_between_fits_are_the_ones_called(tmp_path):
    """The Trainer finds each hook's callbacks once, and again when the list changes, also in place (the same
    list, the same length): a callback put where one without hooks was gets its hooks called."""
    import gc

    class Stateful(lockstep.Callback):  # no hooks: nothing of it is kept for calling
        def state_dict(self):
            return {}

    class Counts(lockstep.Callback):
        def __init__(self) -> None:
            self.ends = 0

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.ends += 1

    trainer = lockstep.Trainer(accelerator="cpu", max_steps=3, enable_progress_bar=False, loggers=(),
                               enable_throughput_monitor=False, num_workers=0, log_dir=tmp_path,
                               callbacks=[Stateful()])
    data = torch.utils.data.TensorDataset(torch.randn(96, 8), torch.randint(0, 4, (96,)))
    trainer.fit(tc.Regressor(), data, batch_size=16)
    for round_ in range(1, 4):
        del trainer.callbacks[0]
        gc.collect()
        counts = Counts()
        trainer.callbacks.insert(0, counts)
        trainer.config = dataclasses.replace(trainer.config, max_steps=3 + 3 * round_)
        trainer.fit(tc.Regressor(), data, batch_size=16)
        assert counts.ends == 3


def test_a_callback_added_during_a_fit_has_its_per_batch_hooks_called_from_the_next_batch(tmp_path):
    """The three per-batch hooks are looked up once and again after the list changes in place: a callback
    that another one appends at batch 2's end runs on_train_batch_start, on_before_backward and
    on_train_batch_end from batch 3 on; removed at batch 5, from batch 6 on it runs none of them. One added
    in batch 1's on_train_batch_start runs that batch's later hooks."""
    class Calls(lockstep.Callback):
        def __init__(self) -> None:
            self.calls = []

        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            self.calls.append(("start", batch_idx))

        def on_before_backward(self, trainer, module, loss):
            self.calls.append(("backward", trainer.batches_done_in_epoch))

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.calls.append(("end", batch_idx))

    added = Calls()

    early = Calls()

    class Adds(lockstep.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if batch_idx == 2:
                trainer.callbacks.append(added)
            elif batch_idx == 5:
                trainer.callbacks.remove(added)

    class AddsAtTheStart(lockstep.Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if batch_idx == 1:
                trainer.callbacks.append(early)
            elif batch_idx == 2:
                trainer.callbacks.remove(early)

    trainer = tc.quiet_trainer(max_steps=8, log_dir=tmp_path, callbacks=[Adds(), AddsAtTheStart()])
    trainer.fit(tc.Regressor(), torch.utils.data.TensorDataset(torch.randn(128, 8), torch.randint(0, 4, (128,))),
                batch_size=16)
    # on_before_backward runs before the batch counts as done: batches_done_in_epoch is its index
    assert added.calls == [(kind, index) for index in (3, 4, 5) for kind in ("start", "backward", "end")]
    assert early.calls[:2] == [("backward", 1), ("end", 1)]  # (removed at batch 2's start, after it began)


class _LogsItsOwnTrainLoss(tc.Classifier):
    """Lightning's habit: ``self.log("train_loss", ...)`` of a value that is not the returned loss."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss.detach() * 0 + 7.0 + batch_idx)  # 7, 8 in each epoch of 2 steps
        return loss


class _LogsTrainLossAfterTheStep(tc.Classifier):
    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.log("train_loss", torch.tensor(7.0))


def test_a_module_that_logs_train_loss_itself_takes_the_name_also_when_it_logs_it_late():
    trainer = tc.quiet_trainer(max_epochs=2)
    trainer.fit(_LogsItsOwnTrainLoss(), checks.make_data(16), batch_size=8)
    assert trainer.callback_metrics["train_loss_epoch"] == 7.5  # the module's values alone, not averaged with the loss
    plain = tc.quiet_trainer(max_epochs=2)
    plain.fit(tc.Classifier(), checks.make_data(16), batch_size=8)  # the returned loss, as before
    assert 1.0 < plain.callback_metrics["train_loss_epoch"] < 2.0
    late = tc.quiet_trainer(max_epochs=1)  # at the batch's end, after the Trainer recorded the returned loss
    late.fit(_LogsTrainLossAfterTheStep(), checks.make_data(16), batch_size=8)
    assert late.callback_metrics["train_loss_epoch"] == 7.0  # the returned loss recorded before it is dropped


class _ForwardOnly(lockstep.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.net(x)


class _NoForward(lockstep.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(8, 3)


def test_predict_and_gather_with_its_loader_over_a_stream_without_len_return_its_rows_in_order():
    """A stream has no ``__len__``: naming its loader (as predict does) must not ask for one."""
    class Rows(torch.utils.data.IterableDataset):
        def __iter__(self):
            for i in range(10):
                yield torch.full((8,), float(i))

    module = _ForwardOnly()
    predicted = tc.quiet_trainer().predict(module, Rows(), batch_size=4)
    with torch.no_grad():
        assert torch.allclose(predicted, module.net(torch.arange(10.0)[:, None].expand(10, 8)), atol=1e-6)
    rt = lockstep.Runtime(accelerator="cpu")
    loader = rt.eval_loader(Rows(), batch_size=4)
    rows = [batch[:, :1] * 2 for batch in loader]
    assert rt.gather(rows, loader=loader).reshape(-1).tolist() == [2.0 * i for i in range(10)]


def test_predict_steps_returning_decoded_texts_per_batch_give_one_text_per_sample_in_order():
    """A predict_step that decodes its batch to strings (alone, or beside a tensor in a dict): before, refused
    as "an output holds 3 rows" (the number of batches)."""
    class Decodes(_ForwardOnly):
        def predict_step(self, batch, batch_idx):
            return {"index": batch, "text": [f"item {int(i)}" for i in batch]}

    class Texts(_ForwardOnly):
        def predict_step(self, batch, batch_idx):
            return [f"item {int(i)}" for i in batch]

    predicted = tc.quiet_trainer().predict(Decodes(), torch.arange(11), batch_size=4)
    assert predicted["index"].tolist() == list(range(11))
    assert predicted["text"] == [f"item {i}" for i in range(11)]
    assert tc.quiet_trainer().predict(Texts(), torch.arange(11), batch_size=4) == [f"item {i}" for i in range(11)]


def test_predict_without_predict_step_returns_forward_of_each_batch_in_order_as_lightnings_default():
    inputs = torch.randn(11, 8)
    module = _ForwardOnly()
    predicted = tc.quiet_trainer().predict(module, inputs, batch_size=4)  # a tensor: each batch is its rows
    with torch.no_grad():
        assert torch.allclose(predicted, module.net(inputs), atol=1e-6)
    with pytest.raises(lockstep.UsageError, match="_NoForward has neither predict_step"):
        tc.quiet_trainer().predict(_NoForward(), inputs, batch_size=4)


def test_a_value_logged_with_a_tensor_count_of_zero_weighs_nothing():
    """A batch without tokens logs 0/0 with ``batch_size=`` its token count, a tensor 0: it adds nothing (it
    made the mean NaN, where the same count given as an int was left out). By hand: 5 of 6 tokens."""
    class Tokens(lockstep.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(1, 1)

        def validation_step(self, batch, batch_idx):
            x, mask = batch
            tokens = mask.sum()
            self.log("accuracy", (mask * (x[:, 0] > 2)).sum() / tokens, batch_size=tokens)

    x, mask = torch.arange(8.0).unsqueeze(1), torch.tensor([0.0, 0, 1, 1, 1, 1, 1, 1])
    result = tc.quiet_trainer().validate(Tokens(), torch.utils.data.TensorDataset(x, mask), batch_size=2)
    assert result["accuracy"] == pytest.approx(5 / 6)
