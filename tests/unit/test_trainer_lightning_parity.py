"""Where ordinary Lightning code used to get other numbers here, without a word: each case against a hand
computation or the same run on a dataset with a length.

- ``gradient_clip_val=0`` is no clipping (Lightning's), not a clip to 0; a negative value is refused;
- a stream without ``__len__`` whose end cuts a gradient accumulation short steps at its last batch (the loader
  draws a batch ahead), as a dataset of known length does, and resumes exactly;
- a plateau scheduler on steps reads the values of its step, after that step's validation;
- a logged 0-dim parameter or buffer counts with its value when logged, not after later optimizer steps;
- the logging window goes on across an epoch's end, and monitors at an epoch's end see its newest values;
- a value logged before the epoch's first batch counts (weight 1);
- ``on_before_backward`` gets the loss the backward gets; a dict of ``configure_optimizers`` with a key of a
  scheduler's dict at its top is refused.
"""

from __future__ import annotations

import pytest
import torch

import lockstep
from checks import data as checks
from checks import trainer as tc

pytestmark = pytest.mark.timeout(120)


def test_a_clip_value_of_0_is_no_clipping_and_a_negative_one_is_refused():
    def weights(**options):
        module = tc.Classifier()
        tc.quiet_trainer(max_epochs=1, **options).fit(module, tc.checks.make_data(64), batch_size=16)
        return tc.checks.flat_weights(module)

    unclipped = weights()
    assert torch.equal(weights(gradient_clip_val=0.0), unclipped)
    assert not torch.equal(weights(gradient_clip_val=0.01), unclipped)  # a real clip does act here
    for bad in (-1.0, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="gradient_clip_val=.*0 or None: no clipping"):
            tc.quiet_trainer(max_epochs=1, gradient_clip_val=bad)


class Numbers(torch.utils.data.IterableDataset):
    """1.0, 2.0, ... 10.0, one item a batch, without __len__ (``Listed`` is the same with a length)."""

    def __iter__(self):
        yield from (torch.tensor([float(i)]) for i in range(1, 11))


class Listed(torch.utils.data.Dataset):
    """1.0, 2.0, ... n.0, with a length."""

    def __init__(self, n: int = 10) -> None:
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return torch.tensor([float(index + 1)])


class Linear(lockstep.Module):
    """loss = w * x: each micro-batch's gradient is its x / k; SGD with lr 1 moves w by minus their sum."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.grads_at_start: list[float] = []

    def training_step(self, batch, batch_idx):
        self.grads_at_start.append(0.0 if self.w.grad is None else float(self.w.grad))
        return (self.w * batch).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=1.0)


@pytest.mark.parametrize("data", [Numbers, Listed])
def test_a_streams_end_that_cuts_an_accumulation_short_steps_there(data):
    module = Linear()
    trainer = tc.quiet_trainer(max_steps=5, accumulate_grad_batches=4)
    # Listed in a DataLoader of its own: in order, as the stream
    if data is Numbers:
        trainer.fit(module, data(), batch_size=1)
    else:
        trainer.fit(module, torch.utils.data.DataLoader(data(), batch_size=1))
    # steps: (1+2+3+4)/4, (5+6+7+8)/4, (9+10)/4 at the stream's end, then the next epoch's (1..4)/4 and (5..8)/4
    assert float(module.w) == pytest.approx(-(10 + 26 + 19 + 10 + 26) / 4)
    assert trainer.global_step == 5 and trainer.current_epoch == 1
    assert module.grads_at_start[10] == 0.0  # the next epoch starts from no gradient
    assert trainer.loop.samples_seen == 10 + 8


def test_an_accumulation_steps_at_each_epochs_last_batch_when_the_number_of_batches_changes():
    module = Linear()
    trainer = tc.quiet_trainer(max_epochs=2, accumulate_grad_batches=4)
    trainer.fit(module, torch.utils.data.DataLoader(Listed(24), batch_sampler=checks.EpochCounted()))
    # epoch 1: items 1-12, 13-24; epoch 2: items 1-16, then 17-24 in its last 2 batches (a short accumulation)
    assert trainer.global_step == 4
    assert float(module.w) == -(78 + 222 + 136 + 164) / 4


class Counted(torch.utils.data.IterableDataset):
    """Numbers that keeps its own position (the torchdata convention): a checkpoint holds where it stands."""

    reads = 0

    def __init__(self) -> None:
        self.at = 0

    def __iter__(self):
        while self.at < 10:
            self.at += 1
            Counted.reads += 1
            yield torch.tensor([float(self.at)])
        self.at = 0

    def state_dict(self):
        return {"at": self.at}

    def load_state_dict(self, state):
        self.at = state["at"]


def test_a_stream_that_keeps_its_own_position_resumes_at_the_batch_handed_out_not_the_one_drawn_ahead(tmp_path):
    whole = Linear()
    tc.quiet_trainer(max_steps=6).fit(whole, Counted(), batch_size=1)
    first = Linear()
    tc.quiet_trainer(max_steps=3, checkpoint_dir=tmp_path,
                     callbacks=[lockstep.ModelCheckpoint(every_n_steps=3)]).fit(first, Counted(), batch_size=1)
    resumed = Linear()
    tc.quiet_trainer(max_steps=6, checkpoint_dir=tmp_path, resume="auto").fit(resumed, Counted(), batch_size=1)
    assert float(whole.w) == -(1 + 2 + 3 + 4 + 5 + 6)
    assert float(resumed.w) == float(whole.w)


def test_a_fit_resumed_after_a_streams_last_batch_runs_the_epochs_end_without_reading_the_stream_again(tmp_path):
    """Saved at the epoch's last batch, before its end: the resumed fit runs that end and the next epoch, and reads
    only the next epoch's items (it read the whole epoch again to find the stream's end)."""
    whole = Linear()
    tc.quiet_trainer(max_steps=14).fit(whole, Counted(), batch_size=1)
    tc.quiet_trainer(max_steps=10, checkpoint_dir=tmp_path, callbacks=[
        lockstep.ModelCheckpoint(every_n_steps=10, every_n_epochs=None)]).fit(Linear(), Counted(), batch_size=1)
    Counted.reads = 0
    resumed = Linear()
    tc.quiet_trainer(max_steps=14, checkpoint_dir=tmp_path, resume="auto").fit(resumed, Counted(), batch_size=1)
    assert float(resumed.w) == float(whole.w) == -(55 + 1 + 2 + 3 + 4)
    assert Counted.reads == 5  # the next epoch's 4 batches and the one drawn ahead


def test_a_fit_resumed_after_its_last_step_at_an_epochs_last_batch_runs_that_epochs_end(tmp_path):
    """max_steps reached at an epoch's last batch: the uninterrupted fit runs the epoch's end; so does a fit
    resumed from the checkpoint of that step, written before the end (it found the fit finished and ran nothing)."""
    class Ends(Linear):
        def __init__(self) -> None:
            super().__init__()
            self.ends = 0

        def on_train_epoch_end(self):
            self.ends += 1

    data = torch.utils.data.DataLoader(Listed(), batch_size=1)
    whole = Ends()
    tc.quiet_trainer(max_steps=10).fit(whole, data)
    killed = Ends()
    trainer = tc.quiet_trainer(max_steps=10, checkpoint_dir=tmp_path,
                               callbacks=[lockstep.ModelCheckpoint(every_n_steps=10, every_n_epochs=None)])
    trainer.fit(killed, data)
    resumed = Ends()
    trainer = tc.quiet_trainer(max_steps=10, checkpoint_dir=tmp_path, resume="auto")
    trainer.fit(resumed, data)
    assert whole.ends == resumed.ends == 1 and trainer.current_epoch == 1 and trainer.global_step == 10


class Falling(tc.Classifier):
    """Logs ``m``: ``values[step]`` at each step (the plateau scheduler's monitor)."""

    def __init__(self, values, make) -> None:
        super().__init__()
        self.values, self.make, self.lrs = values, make, []

    def training_step(self, batch, batch_idx):
        self.log("m", self.values[self.trainer.global_step])
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": optimizer, "lr_scheduler": self.make(optimizer)}


def _plateau(optimizer, monitor="m", frequency=1):
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=0.0)
    return {"scheduler": scheduler, "monitor": monitor, "interval": "step", "frequency": frequency}


@pytest.mark.parametrize("values", [[8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 4.0, 8.0, 1.0, 1.0, 0.5, 9.0]])
def test_a_plateau_scheduler_on_steps_reads_the_values_of_its_step(values):
    """log_every_n_steps=3: at steps between two logging steps the scheduler reads the mean of the values since
    the last one, as the next logging step writes it (a hand computation), never the last logging step's. It
    steps after the step's on_train_batch_end (and validation), as in Lightning: the rate read there at step s is
    the one the scheduler set at step s - 1."""
    module = Falling(values, _plateau)
    tc.quiet_trainer(max_steps=8, log_every_n_steps=3).fit(module, tc.checks.make_data(128), batch_size=16)
    reference = torch.optim.lr_scheduler.ReduceLROnPlateau(torch.optim.SGD([torch.zeros(1)], lr=0.1), factor=0.5,
                                                           patience=0, threshold=0.0)
    expected = [0.1]
    for step in range(1, 8):
        since = (step - 1) // 3 * 3  # the last logging step before this one
        reference.step(sum(values[since:step]) / (step - since))
        expected.append(reference.optimizer.param_groups[0]["lr"])
    assert module.lrs == pytest.approx(expected)  # falling means: never cut; the other values: cut 5 times


def test_a_plateau_scheduler_on_steps_resumed_from_a_checkpoint_of_its_step_takes_that_step(tmp_path):
    """The checkpoint of step 3 is written at its batch's end, before the step's plateau step: the resumed fit
    takes it (with the values logged since the last logging step, restored), and ends at the uninterrupted
    fit's rate."""
    values = [float(v) for v in (5, 4, 6, 7, 3, 8, 9)]

    def fit(max_steps, **options):
        module = Falling(values, _plateau)
        tc.quiet_trainer(max_steps=max_steps, log_every_n_steps=4, **options).fit(module, tc.checks.make_data(128),
                                                                                  batch_size=16)
        return module.trainer.optimizers[0].param_groups[0]["lr"]

    uninterrupted = fit(6)
    fit(3, checkpoint_dir=tmp_path, callbacks=[lockstep.ModelCheckpoint(every_n_steps=3, every_n_epochs=None)])
    assert fit(6, checkpoint_dir=tmp_path, resume="auto") == uninterrupted < 0.1


def test_a_plateau_scheduler_on_steps_monitoring_validation_reads_that_steps_validation():
    seen = []

    class Validations(lockstep.Callback):
        def on_validation_end(self, trainer, module):
            seen.append(trainer.callback_metrics["val_loss"])

    module = Falling([0.0] * 8, lambda optimizer: _plateau(optimizer, "val_loss", 2))
    trainer = tc.quiet_trainer(max_steps=8, val_check_interval=2, callbacks=[Validations()])
    trainer.fit(module, tc.checks.make_data(128), tc.checks.make_data(32, seed=1), batch_size=16)
    reference = torch.optim.lr_scheduler.ReduceLROnPlateau(torch.optim.SGD([torch.zeros(1)], lr=0.1), factor=0.5,
                                                           patience=0, threshold=0.0)
    expected = [0.1, 0.1]
    for value in seen[:3]:  # validations at steps 2, 4, 6 (and 8); the scheduler steps right after each
        reference.step(value)
        expected += [reference.optimizer.param_groups[0]["lr"]] * 2
    assert len(seen) == 4
    assert module.lrs == pytest.approx(expected)


class LogsTensors(tc.Classifier):
    """Logs a 0-dim parameter that the optimizer moves and a buffer counted up in place, keeping their values."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(1.0))
        self.register_buffer("count", torch.tensor(0.0))
        self.logged: list[tuple[float, float]] = []

    def training_step(self, batch, batch_idx):
        self.count += 1
        self.log("scale", self.scale)
        self.log("count", self.count)
        self.logged.append((float(self.scale), float(self.count)))
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x) * self.scale, y)


def test_a_logged_parameter_or_buffer_counts_with_its_value_when_logged():
    module = LogsTensors()
    trainer = tc.quiet_trainer(max_epochs=1, log_every_n_steps=100)
    trainer.fit(module, tc.checks.make_data(64), batch_size=16)
    scales, counts = zip(*module.logged, strict=True)
    assert len(set(scales)) == 4  # the parameter did move
    assert trainer.callback_metrics["scale_epoch"] == pytest.approx(sum(scales) / 4, abs=1e-6)
    assert trainer.callback_metrics["count_epoch"] == pytest.approx(2.5)  # (1 + 2 + 3 + 4) / 4


class StepOnly(tc.Classifier):
    """Logs ``x`` = the step's number (1, 2, ...) on steps only, and ``e`` = the epoch's number before its first
    batch; epochs of 2 steps, a logging step every 3."""

    def training_step(self, batch, batch_idx):
        self.log("x", float(self.trainer.global_step + 1), on_epoch=False)
        return super().training_step(batch, batch_idx)

    def on_train_epoch_start(self):
        self.log("e", float(self.trainer.current_epoch + 1))


class Written(lockstep.Callback):
    def __init__(self) -> None:
        self.at_epoch_end: list[float] = []

    def on_train_epoch_end(self, trainer, module):
        self.at_epoch_end.append(trainer.callback_metrics["x"])


def test_the_logging_window_goes_on_across_an_epochs_end_and_monitors_see_its_newest_values(tmp_path):
    written = Written()
    trainer = tc.quiet_trainer(max_epochs=3, log_every_n_steps=3, loggers=("jsonl",), log_dir=tmp_path,
                               callbacks=[written])
    trainer.fit(StepOnly(), tc.checks.make_data(32), batch_size=16)
    import json

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    logged = {row["step"]: row["x"] for row in rows if "x" in row}
    assert logged == {3: (1 + 2 + 3) / 3, 6: (4 + 5 + 6) / 3}  # step 3 is in epoch 2: its window began in epoch 1
    # at the ends of epochs 1 (step 2), 2 (step 4, the window since step 3) and 3 (step 6, a logging step)
    assert written.at_epoch_end == [1.5, 4.0, 5.0]
    epochs = {row["step"]: row["e_epoch"] for row in rows if "e_epoch" in row}
    assert epochs == {2: 1.0, 4: 2.0, 6: 3.0}  # logged before each epoch's first batch, weighing 1


def test_on_train_batch_start_returning_minus_1_skips_the_rest_of_the_epoch():
    """Lightning's: the batch and the rest of its epoch are not trained, the epoch's end runs (items 1-8 in order:
    epochs of batches 1, 2, 3, 4 then -1 at the fifth); inside an accumulation it is refused by name."""
    class Skips(Linear):
        def __init__(self, at: int) -> None:
            super().__init__()
            self.ends, self.at = 0, at

        def on_train_batch_start(self, batch, batch_idx):
            return -1 if batch_idx == self.at else None

        def on_train_epoch_end(self):
            self.ends += 1

    module = Skips(4)
    trainer = tc.quiet_trainer(max_epochs=2, accumulate_grad_batches=2)
    trainer.fit(module, torch.utils.data.DataLoader(Listed(8), batch_size=1))
    assert trainer.global_step == 4 and module.ends == 2 and trainer.current_epoch == 2
    assert float(module.w) == -2 * (1 + 2 + 3 + 4) / 2
    with pytest.raises(TypeError, match="returned -1 .* at batch 3, inside a gradient accumulation"):
        tc.quiet_trainer(max_epochs=1, accumulate_grad_batches=2).fit(
            Skips(3), torch.utils.data.DataLoader(Listed(8), batch_size=1))


def test_on_before_backward_gets_the_loss_the_backward_gets():
    class Seen(tc.Classifier):
        def __init__(self) -> None:
            super().__init__()
            self.pairs: list[tuple[float, float]] = []

        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            self.pairs.append((float(loss), 0.0))
            return loss

        def on_before_backward(self, loss):
            self.pairs[-1] = (self.pairs[-1][0], float(loss))

    module = Seen()
    tc.quiet_trainer(max_steps=2, accumulate_grad_batches=2).fit(module, tc.checks.make_data(64), batch_size=16)
    assert len(module.pairs) == 4
    assert all(hooked == pytest.approx(returned / 2) for returned, hooked in module.pairs)


def test_a_scheduler_key_at_the_top_of_configure_optimizers_dict_is_refused_by_name():
    class Misplaced(tc.Classifier):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1),
                    "interval": "step"}

    with pytest.raises(TypeError, match=r"the keys \['interval', 'lr_scheduler', 'optimizer'\].*go in the "
                                         "lr_scheduler dict"):
        tc.quiet_trainer(max_steps=1).fit(Misplaced(), tc.checks.make_data(32), batch_size=16)
