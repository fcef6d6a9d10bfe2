"""A resumed fit equals the uninterrupted one whatever the callbacks' order: ModelCheckpoint runs last in a hook
(its checkpoint holds EarlyStopping's judgement of that hook), each callback's state is found by its own key
(not its place in the list), and a different gradient accumulation inside an epoch is refused. 64 samples in
batches of 16: 4 steps an epoch; no validation data (EarlyStopping judges each epoch's training loss)."""

from __future__ import annotations

import csv

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import lockstep
from checks import data as dc
from checks import trainer as tc
from lockstep.errors import CheckpointError

pytestmark = pytest.mark.timeout(120)

_g = torch.Generator().manual_seed(0)
DATA = TensorDataset(torch.randn(64, 8, generator=_g), torch.randint(0, 4, (64,), generator=_g))


class Net(lockstep.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(folder, epochs: int, *callbacks, **options):
    """EarlyStopping(mode="max") on a falling loss: it stops the fit at the end of epoch 3 (patience 2)."""
    stopping, module = lockstep.EarlyStopping(monitor="train_loss", mode="max", patience=2), Net()
    fit = tc.quiet_trainer(max_epochs=epochs, checkpoint_dir=folder, resume="auto",
                           callbacks=[*callbacks, stopping], **options)
    fit.fit(module, DATA, batch_size=16)
    return fit, stopping, module


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y)


def test_model_checkpoint_runs_after_the_other_callbacks_so_its_epoch_checkpoint_holds_early_stoppings_verdict(
        tmp_path):
    saver = lockstep.ModelCheckpoint(save_top_k=-1)
    whole, stopped, module = _fit(tmp_path / "whole", 10, saver)
    assert isinstance(whole.callbacks[-1], lockstep.ModelCheckpoint)  # given first, it runs last
    assert (whole.global_step, stopped.wait) == (12, 2)
    _fit(tmp_path / "cut", 2, lockstep.ModelCheckpoint(save_top_k=-1))  # ends after epoch 2 (step 8)
    resumed, stopped_again, module_again = _fit(tmp_path / "cut", 10, lockstep.ModelCheckpoint(save_top_k=-1))
    assert (resumed.global_step, stopped_again.wait) == (12, 2)  # before: the judgement of epoch 2 was lost (16)
    _same_weights(module, module_again)
    again, _, _ = _fit(tmp_path / "whole", 10, lockstep.ModelCheckpoint(save_top_k=-1))  # the finished fit, again
    assert again.global_step == 12  # its last checkpoint records the stop: no further step


def test_a_callback_keeps_its_state_when_another_callback_is_left_out_of_the_resumed_fit(tmp_path, capsys):
    _, _, module = _fit(tmp_path / "whole", 10)
    _fit(tmp_path / "cut", 2, lockstep.LearningRateMonitor())
    resumed, stopped, module_again = _fit(tmp_path / "cut", 10)  # without the LearningRateMonitor
    assert (resumed.global_step, stopped.wait) == (12, 2)  # before: EarlyStopping started again (20)
    _same_weights(module, module_again)
    assert "holds the state of callback(s) LearningRateMonitor, which this fit does not have" in capsys.readouterr().out


def test_callback_states_saved_by_position_go_to_the_callbacks_of_their_class():
    """Checkpoints written before state keys named each state ``Class-position``: the n-th saved state of a
    class goes to the n-th callback of that class, wherever the callbacks now stand."""
    from lockstep.train.checkpoint import _Callbacks

    first, second = lockstep.EarlyStopping(monitor="a"), lockstep.EarlyStopping(monitor="b")
    said: list[str] = []
    part = _Callbacks([lockstep.ModelCheckpoint(), first, second], said.append)
    part.load_state_dict({"EarlyStopping-0": {"best": 1.0, "wait": 1}, "LearningRateMonitor-1": {"used": {}},
                          "EarlyStopping-2": {"best": 2.0, "wait": 2}, "ModelCheckpoint-3": {}})
    assert (first.best, first.wait, second.best, second.wait) == (1.0, 1, 2.0, 2)
    assert len(said) == 1 and "LearningRateMonitor-0" in said[0]
    # saved now by key: the monitors tell the two apart in any order
    saved = part.state_dict()
    fresh_b, fresh_a = lockstep.EarlyStopping(monitor="b"), lockstep.EarlyStopping(monitor="a")
    _Callbacks([fresh_b, fresh_a, lockstep.ModelCheckpoint()], said.append).load_state_dict(saved)
    assert (fresh_a.best, fresh_b.best) == (1.0, 2.0)
    with pytest.raises(CheckpointError, match="not a dict"):
        part.load_state_dict([{"best": 1.0}])


def test_a_different_accumulation_inside_an_epoch_is_refused_and_at_an_epochs_start_taken(tmp_path):
    class CrashAt(lockstep.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == 2 and trainer.at_step_boundary:
                raise RuntimeError("crash")

    def fit(epochs, accumulate, *callbacks):
        tc.quiet_trainer(max_epochs=epochs, checkpoint_dir=tmp_path, resume="auto", accumulate_grad_batches=accumulate,
                         callbacks=[lockstep.ModelCheckpoint(every_n_steps=1, save_top_k=-1), *callbacks]
                         ).fit(Net(), DATA, batch_size=8)

    with pytest.raises(RuntimeError, match="crash"):
        fit(2, 2, CrashAt())  # the last checkpoint: step 1, after batch 2 of 8 in epoch 1
    with pytest.raises(CheckpointError, match="accumulate_grad_batches=2; this fit has 4"):
        fit(2, 4)
    fit(1, 2)  # the same accumulation: the epoch ends, saved at its end
    fit(2, 4)  # from the epoch's end: the next epoch groups its batches by 4


class _LogsAtEpochStart(Net):
    def on_train_epoch_start(self):
        self.log("step_at_epoch_start", float(self.trainer.global_step), on_step=False, on_epoch=True)


def _rows(folder) -> list[dict[str, str]]:
    """metrics.csv without the checkpoints' own seconds (a time, not a value of the fit)."""
    with open(folder / "metrics.csv") as table:
        rows = [{k: v for k, v in row.items() if k != "checkpoint_blocked_s"} for row in csv.DictReader(table)]
    return [row for row in rows if any(v for k, v in row.items() if k != "step")]


def test_a_resumed_epochs_start_hook_runs_again_and_what_it_logs_counts_once(tmp_path):
    """Resumed after step 5 (inside epoch 2): the epoch's start ran before the checkpoint. Its value logged there
    was added to the restored epoch sums again (step_at_epoch_start_epoch 6.0 became 7.5) and
    LearningRateMonitor("epoch") wrote a second row for the epoch."""
    class CrashAt(lockstep.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step == 6:
                raise RuntimeError("crash")

    def fit(folder, *callbacks):
        module = _LogsAtEpochStart()
        tc.quiet_trainer(max_epochs=3, checkpoint_dir=folder, resume="auto", loggers=("csv",), log_every_n_steps=2,
                         callbacks=[lockstep.ModelCheckpoint(every_n_steps=1, save_top_k=-1),
                                    lockstep.LearningRateMonitor("epoch"), *callbacks]).fit(module, DATA, batch_size=16)
        return module

    whole = fit(tmp_path / "whole")
    with pytest.raises(RuntimeError, match="crash"):
        fit(tmp_path / "cut", CrashAt())
    resumed = fit(tmp_path / "cut")
    _same_weights(whole, resumed)
    expected = _rows(tmp_path / "whole")
    assert [row["step_at_epoch_start_epoch"] for row in expected if row["step_at_epoch_start_epoch"]] == \
        ["0.0", "4.0", "8.0"]
    assert _rows(tmp_path / "cut") == expected


class _Seen(lockstep.Callback):
    """The validation loss each batch of the fit sees (what a plateau scheduler or a callback reads)."""

    def __init__(self) -> None:
        self.seen: dict[int, float | None] = {}

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.seen[trainer.global_step] = trainer.callback_metrics.get("val_loss")


class _Validated(Net):
    def validation_step(self, batch, batch_idx):
        self.log("val_loss", F.cross_entropy(self.net(batch[0]), batch[1]))


def test_a_fit_resumed_from_a_max_steps_end_continues_as_one_longer_fit_without_its_extra_validation(tmp_path):
    """max_steps=6 ends inside epoch 2 (4 steps an epoch, validation at each epoch's end): the fit's end
    validates step 6. EarlyStopping (mode="max" on a falling loss: never better) counted that validation,
    and the resumed fit read its val_loss until the next validation; the longer fit had neither."""
    def fit(folder, steps):
        stopping, seen, module = lockstep.EarlyStopping(monitor="val_loss", mode="max", patience=2), _Seen(), \
            _Validated()
        fit = tc.quiet_trainer(max_steps=steps, checkpoint_dir=folder, resume="auto", callbacks=[stopping, seen])
        fit.fit(module, DATA, TensorDataset(DATA.tensors[0][:32], DATA.tensors[1][:32]), batch_size=16)
        return fit, stopping, seen.seen, module

    whole, stopped, seen, module = fit(tmp_path / "whole", 20)
    assert (whole.global_step, stopped.wait) == (12, 2)
    cut, stopped_cut, _, _ = fit(tmp_path / "cut", 6)
    assert (cut.global_step, stopped_cut.wait) == (6, 0)  # step 6's validation ran, and was left out of the count
    resumed, stopped_again, seen_again, module_again = fit(tmp_path / "cut", 20)
    assert (resumed.global_step, stopped_again.wait) == (12, 2)  # before: it stopped at step 8
    assert seen_again == {step: seen[step] for step in range(6, 12)}  # before: steps 6 and 7 read step 6's
    _same_weights(module, module_again)


class _Recorded(Net):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[int] = []

    def training_step(self, batch, batch_idx):
        self.seen += batch[1].tolist()  # the labels: which rows trained (order included)
        return super().training_step(batch, batch_idx)


def _packed_fit(folder, max_steps):
    module = _Recorded()
    # batches of 16 in even epochs, of 8 in odd ones: epoch 0 holds 4, epoch 1 holds 8
    loader = torch.utils.data.DataLoader(DATA, batch_sampler=dc.EpochCounted(64, (16, 8)))
    tc.quiet_trainer(max_epochs=2, max_steps=max_steps, checkpoint_dir=folder, resume="auto").fit(module, loader)
    return module


def test_a_resume_inside_an_epoch_whose_batch_sampler_yields_another_count_trains_the_rest_of_it(tmp_path):
    whole = _packed_fit(tmp_path / "whole", None)
    assert len(whole.seen) == 2 * 64
    first = _packed_fit(tmp_path / "cut", 8)  # epoch 0's 4 batches, then 4 of epoch 1's 8
    rest = _packed_fit(tmp_path / "cut", None)
    # before: 4 batches done equalled epoch 0's count, so the resumed epoch was taken as over and its last 4
    # batches (32 rows) never trained
    assert first.seen + rest.seen == whole.seen
    _same_weights(rest, whole)
