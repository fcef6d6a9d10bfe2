"""``LoopState``: the Trainer's loop counters, owned and written here alone (the Trainer's loop calls its
methods; a checkpoint restores them). Where the data stands (epoch, batches done) is stored once, in the
training loader's state; ``place`` puts the loop there when a checkpoint or a live replica group's state
is loaded."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Generic, TypeVar, overload

from lockstep.errors import UsageError

T = TypeVar("T")


@dataclass
class LoopState:
    """Where a fit stands. ``current_epoch`` counts from 0; ``global_step`` counts committed optimizer
    steps; ``batches_done_in_epoch`` the batches of the current epoch handed out; ``samples_seen`` the
    global samples of the committed steps."""

    current_epoch: int = 0
    global_step: int = 0
    batches_done_in_epoch: int = 0
    samples_seen: int = 0
    steps_per_epoch: int | None = 0  # None: a stream without __len__
    should_stop: bool = False  # a callback asked the fit to end (EarlyStopping)
    at_step_boundary: bool = False  # the current batch ends an accumulation: the optimizer steps after it
    epoch_ended: bool = False  # the epoch's end (schedulers, validation) ran: a checkpoint resumes at the next
    plateau_due: bool = False  # the epoch's end ran up to its plateau schedulers' step, not yet taken (resume takes it)
    step_plateau_due: bool = False  # the same for a step's (they step after its batch's end and its validation)
    log_due: bool = False  # a logging step whose row waits for its batch-end hooks (what they log is in it)
    batch_samples: int | None = None  # this rank's samples in the current batch, self.log's weight (None: no batch)
    batch_global_samples: int = 0  # the samples of the current batch over all ranks
    step_samples: int = 0  # the global samples of the micro-batches of the step under way
    resume_batches: int = 0  # where the next epoch's pass starts (a resumed epoch)
    validated_at: int | None = None  # the step of the last validation in this fit
    # a validation that the fit's end added (its step was not due one): the callback metrics and validated_at as
    # they were before it, where a fit resumed from its checkpoint continues (None: no such validation)
    fit_end: dict[str, Any] | None = None
    # the checkpoint's loader position: resumed after the pass's last batch (a stream's, whose length is unknown,
    # or a batch sampler's, whose count may change with the epoch); None: a position that does not say
    pass_over: bool | None = None
    only_end_left: bool = False  # the current epoch's pass has no batch left, only its end to run
    between_epochs: bool = False  # an epoch ended (current_epoch counts it) and the next has not started

    @property
    def epoch_number(self) -> int:
        """The epoch of the newest step, counted from 1 (as checkpoint names and progress lines count)."""
        return self.current_epoch + (0 if self.between_epochs and self.current_epoch else 1)

    def finished(self, max_epochs: int | None, max_steps: int | None) -> bool:
        return (self.should_stop or (max_steps is not None and self.global_step >= max_steps)
                or (max_epochs is not None and self.current_epoch >= max_epochs))

    def start_epoch(self) -> int:
        """The first batch of the epoch's pass (0, or where a resumed epoch continues)."""
        self.only_end_left, self.between_epochs = self.end_left(), False
        start, self.resume_batches, self.pass_over = self.resume_batches, 0, None
        self.batches_done_in_epoch, self.epoch_ended, self.step_samples, self.plateau_due = start, False, 0, False
        self.batch_samples = None  # values logged before the first batch (on_train_epoch_start) weigh 1
        return start

    def end_left(self) -> bool:
        """Resumed after its epoch's last batch, before the epoch's end (which then runs, also when the fit's
        max_steps was reached at that batch, as it ran in the uninterrupted fit)."""
        if not self.resume_batches:
            return False
        return self.pass_over if self.pass_over is not None else self.resume_batches == self.steps_per_epoch

    def start_batch(self, batch_idx: int, local_samples: int, global_samples: int, accumulate: int, last: bool
                    ) -> None:
        """Batch ``batch_idx`` begins (``last``: the pass's last; a short accumulation steps there too)."""
        self.batch_samples, self.batch_global_samples = local_samples, global_samples
        self.at_step_boundary = (batch_idx + 1) % accumulate == 0 or last

    def check_skip(self, batch_idx: int, fault_tolerant: bool) -> None:
        """The module's ``on_train_batch_start`` returned -1 (skip the rest of the epoch): refused inside an
        accumulation (its micro-batches' gradients and item counts would go into the next step) and in a
        fault-tolerant fit (the live groups took this step's quorum)."""
        where = ("inside a gradient accumulation (its first micro-batches ran): return it at a batch that begins "
                 "one (batch_idx % accumulate_grad_batches == 0)" if self.step_samples else
                 "in a fault-tolerant fit, whose live replica groups agreed on this step: give data of the epoch's "
                 "length instead" if fault_tolerant else None)
        if where is not None:
            raise UsageError(f"on_train_batch_start returned -1 (skip the rest of the epoch) at batch {batch_idx}, "
                             f"{where}.")

    def end_batch(self, batch_idx: int) -> int | None:
        """The batch is done; at a step boundary, the samples of the step's batches (else None)."""
        self.step_samples += self.batch_global_samples
        self.batches_done_in_epoch = batch_idx + 1
        if not self.at_step_boundary:
            return None
        samples, self.step_samples = self.step_samples, 0
        return samples

    def stepped(self, samples: int) -> None:
        """The step of ``samples`` global samples was committed."""
        self.global_step += 1
        self.samples_seen += samples

    def end_epoch(self) -> None:
        self.current_epoch += 1
        self.between_epochs = True

    def resume_at(self, batches_done: int) -> None:
        """Continue the current epoch after ``batches_done`` batches (what loading a checkpoint sets)."""
        self.resume_batches = self.batches_done_in_epoch = batches_done

    def state_dict(self) -> dict[str, Any]:
        return {"global_step": self.global_step, "epoch_ended": self.epoch_ended, "samples_seen": self.samples_seen,
                "plateau_due": self.plateau_due, "step_plateau_due": self.step_plateau_due,
                "validated_at": self.validated_at, "should_stop": self.should_stop, "log_due": self.log_due,
                "fit_end": self.fit_end}

    def load_state_dict(self, loop: dict[str, Any]) -> None:
        self.global_step, self.samples_seen = int(loop["global_step"]), int(loop["samples_seen"])
        validated = loop.get("validated_at")  # None in checkpoints written before it was kept
        self.validated_at = int(validated) if isinstance(validated, int) else None
        self.plateau_due = loop.get("plateau_due") is True
        self.step_plateau_due = loop.get("step_plateau_due") is True
        # written after a callback stopped the fit (EarlyStopping): the resumed fit stops there too
        self.should_stop = loop.get("should_stop") is True
        self.log_due = loop.get("log_due") is True  # saved at a logging step's batch end, before its log
        self.fit_end = _before_fit_end(loop.get("fit_end"))

    def place(self, loop: dict[str, Any], position: dict[str, Any] | None) -> None:
        """Where the resumed fit continues: the epoch and batch of the loader's saved ``position`` (in
        checkpoints written before the loader held it alone: the loop's own copy). Saved once the epoch's
        end ran (its scheduler step, validation): the next epoch starts. Saved at its last batch before
        that: the resumed epoch has no batch left, only its end to run. (Checkpoints without the flag were
        written at the end of an epoch of known length.)"""
        if position is not None and "epoch" in position:
            epoch, done = int(position["epoch"]), int(position["batches_done"])
        else:
            epoch, done = int(loop["epoch"]), int(loop["batches_done_in_epoch"])
        steps = self.steps_per_epoch
        if loop.get("epoch_ended", steps is not None and done >= steps):
            epoch, done = epoch + 1, 0
        self.current_epoch = epoch
        self.resume_at(done)
        # saved after the pass's last batch, before the epoch's end: the pass is not read again (a stream's would
        # be, to find its end)
        ended = position.get("ended") if position is not None else None
        self.pass_over = ended if isinstance(ended, bool) else None


def _before_fit_end(saved: Any) -> dict[str, Any] | None:
    """A checkpoint's ``fit_end`` as read from the file: float metrics by name and an int step, else None."""
    if not isinstance(saved, dict) or not isinstance(saved.get("metrics"), dict):
        return None
    metrics = {k: float(v) for k, v in saved["metrics"].items() if isinstance(k, str) and isinstance(v, (int, float))}
    validated = saved.get("validated_at")
    return {"metrics": metrics, "validated_at": validated if isinstance(validated, int) else None}


class LoopCounter(Generic[T]):
    """A Trainer attribute that is the loop state's own (``trainer.global_step`` is ``trainer.loop.global_step``):
    what callbacks and loggers read on the Trainer, as in Lightning."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, trainer: None, owner: type) -> LoopCounter[T]: ...
    @overload
    def __get__(self, trainer: object, owner: type) -> T: ...

    def __get__(self, trainer: object, owner: type) -> Any:
        return self if trainer is None else getattr(trainer.loop, self.name)  # type: ignore[attr-defined]

    def __set__(self, trainer: object, value: T) -> None:
        setattr(trainer.loop, self.name, value)  # type: ignore[attr-defined]
