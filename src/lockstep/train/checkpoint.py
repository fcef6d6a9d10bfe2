"""The Trainer's own part of a checkpoint: its stateful parts, what it saves, how it loads them, the
resume at a fit's start, and the checkpoint a preemption asks for.

Finding, agreeing on, verifying and loading a checkpoint folder are the Runtime's (``rt.save``,
``rt.latest_checkpoint``, ``rt.load``: ``lockstep.runtime.checkpoint.life``).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lockstep.env.settings import PREEMPTED_EXIT
from lockstep.errors import CheckpointError, NoSuchCheckpointError
from lockstep.runtime import Checkpoint
from lockstep.train.callbacks import ModelCheckpoint

if TYPE_CHECKING:
    from lockstep.train.trainer import Trainer


class _Each:
    """The learning-rate schedulers, in configure_optimizers' order, as one part."""

    def __init__(self, items: list[Any]) -> None:
        self.items = items

    def state_dict(self) -> Any:
        return [item.state_dict() for item in self.items]

    def load_state_dict(self, state: Any) -> None:
        if not isinstance(state, list) or len(state) != len(self.items):
            raise CheckpointError(f"the checkpoint holds {len(state) if isinstance(state, list) else 'no list of'} "
                                  f"learning-rate scheduler(s) where configure_optimizers returns {len(self.items)}: "
                                  "resume with the schedulers of the run that saved it (or start a new run).")
        for item, saved in zip(self.items, state, strict=True):
            item.load_state_dict(saved)


class _Callbacks:
    """The callbacks' states, each under its ``state_key`` (its class's name unless it says otherwise; the
    second with the same key is ``KEY#2``, and so on): adding, removing or reordering other callbacks between
    a save and the resume leaves each callback its own state. A saved state that no callback takes is said
    (rank 0 prints it): its callback is missing from the resumed fit."""

    def __init__(self, callbacks: list[Any], say: Callable[[str], None]) -> None:
        self.callbacks, self.say = callbacks, say
        seen: dict[str, int] = {}
        self.keys: list[str] = []
        for callback in callbacks:
            key = str(getattr(callback, "state_key", type(callback).__qualname__))
            seen[key] = seen.get(key, 0) + 1
            self.keys.append(key if seen[key] == 1 else f"{key}#{seen[key]}")

    def state_dict(self) -> dict[str, Any]:
        return {key: callback.state_dict() for key, callback in zip(self.keys, self.callbacks, strict=True)}

    def load_state_dict(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise CheckpointError(f"the checkpoint's callback states are a {type(state).__name__}, not a dict "
                                  "(damaged): resume from another checkpoint.")
        state = self._by_position(state) if state and all(_POSITION_KEY.match(str(k)) for k in state) else state
        for key, callback in zip(self.keys, self.callbacks, strict=True):
            callback.load_state_dict(state.get(key, {}))
        left = sorted(str(key) for key in set(state) - set(self.keys))
        if left:
            self.say(f"lockstep: the checkpoint holds the state of callback(s) {', '.join(left)}, which this fit "
                     "does not have: their state is not restored (give the same callbacks to resume them).")

    def _by_position(self, state: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint that keyed each state by its callback's position (``EarlyStopping-1``): the n-th saved
        state of a class goes to the n-th callback of that class."""
        saved: dict[str, list[Any]] = {}
        for key in sorted(state, key=lambda k: int(str(k).rsplit("-", 1)[1])):
            saved.setdefault(str(key).rsplit("-", 1)[0], []).append(state[key])
        moved: dict[str, Any] = {}
        for key, callback in zip(self.keys, self.callbacks, strict=True):
            mine = saved.get(type(callback).__name__)
            if mine:
                moved[key] = mine.pop(0)
        return {**moved, **{f"{name}-{i}": left for name, rest in saved.items() for i, left in enumerate(rest)}}


_POSITION_KEY = re.compile(r"^[A-Za-z_]\w*-\d+$")  # how checkpoints before state keys named a callback's state


class _Metrics:
    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        # whether the module logs train_loss itself (the Trainer then records no returned loss under it)
        return {**self.trainer.metrics.state_dict(self.trainer.runtime), "loss_taken": self.trainer.recorder.taken}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        t = self.trainer
        t.metrics.load_state_dict(t.runtime, state, mid_epoch=t.batches_done_in_epoch > 0)
        if state.get("loss_taken") is True:
            t.recorder.loss_name = None


def parts(trainer: Trainer) -> dict[str, Any]:
    """The Trainer's stateful parts besides the module and optimizers, in loading order."""
    callbacks = trainer.callbacks
    named = {
        "loop": trainer.loop,
        "schedulers": _Each([s.scheduler for s in trainer.lr_schedulers]),
        "precision": trainer.runtime.precision,
        "metrics": _Metrics(trainer),
        "callbacks": _Callbacks(list(callbacks), trainer.runtime.print),
    }
    if trainer.train_loader is not None:
        named["loader"] = trainer.train_loader
    return named


class _Joined:
    """The loop's counters with the data's position, for a replica group that joins a fault-tolerant
    fit: loading them puts the Trainer where the live group is (``place``)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer, self.loop = trainer, trainer.loop

    def state_dict(self) -> dict[str, Any]:
        loader = self.trainer.train_loader
        return {**self.loop.state_dict(), "position": loader.state_dict() if loader is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loop.load_state_dict(state)
        self.loop.place(state, state["position"])


def replica_state(trainer: Trainer) -> dict[str, Any]:
    """What a replica group that joins a fault-tolerant fit receives from a live one, in loading order:
    the model and optimizers, the loop and the data's position, the schedulers, the precision's
    scaler, the callbacks (the replica groups add each rank's random states). Not the metrics of the
    epoch so far: their sums are each group's own."""
    parts_ = parts(trainer)
    state = {**_model_and_optimizers(trainer), "loop": _Joined(trainer)}
    return {**state, **{name: parts_[name] for name in ("loader", "schedulers", "precision", "callbacks")
                        if name in parts_}}


def save(trainer: Trainer, path: Path, blocking: bool, then: Any = None) -> float:
    """Write the Trainer's checkpoint folder; every rank calls it. Returns the seconds it blocked."""
    rt = trainer.runtime
    objects = {name: part.state_dict() for name, part in parts(trainer).items()}
    objects["rng"] = rt.random_states().state_dict()
    objects["config"] = {k: str(v) for k, v in trainer.config.hparams().items()}
    objects["loggers"] = logger_states(trainer.loggers)  # rank 0's: its objects are the ones written
    trainer.fire("on_save_checkpoint", objects)
    loader = trainer.train_loader
    # The epoch counts from 1, as in the checkpoint's name and the progress lines.
    metadata = {"step": trainer.global_step, "epoch": trainer.loop.epoch_number,
                "global_batch": loader.sampler.batch_size if loader is not None else None,
                "metrics": {name: float(value) for name, value in trainer.callback_metrics.items()}}
    # rt.save syncs the ranks' buffers (BatchNorm statistics): rank 0's are saved.
    blocked = rt.save(path, {**_model_and_optimizers(trainer), **objects}, blocking=blocking, metadata=metadata,
                      on_commit=then)
    for logger in trainer.loggers:  # rank 0's own seconds: not a callback metric, which every rank holds the same
        logger.log_metrics({"checkpoint_blocked_s": blocked}, trainer.global_step)
    return blocked


def _model_and_optimizers(trainer: Trainer) -> dict[str, Any]:
    """The model with its optimizers, as ``rt.save`` shards them (under the keys that earlier
    checkpoints hold: ``model``, its optimizers in their order)."""
    return {"model": trainer.module, **{f"optimizer-{i:03d}": o for i, o in enumerate(trainer.optimizers)}}


def logger_states(loggers: list[Any]) -> list[dict[str, Any]]:
    """What the loggers that keep a run (trackers' run ids) need to continue it after a resume."""
    return [{"type": type(logger).__name__, "state": logger.state_dict()}
            for logger in loggers if callable(getattr(logger, "state_dict", None))]


def resume(trainer: Trainer, found: Checkpoint) -> list[dict[str, Any]]:
    """Load the checkpoint ``found`` (already agreed and verified by ``rt.latest_checkpoint``) into the
    Trainer's parts; random states last, and only on the same number of processes. Returns the
    loggers' saved states (for ``resume_loggers``)."""
    rt = trainer.runtime
    saved = found.metadata.get("objects", [])
    if not isinstance(saved, list) or not all(isinstance(name, str) for name in saved):
        raise CheckpointError(f"{found.path}: its lockstep.json lists no objects (damaged metadata).")
    state = rt.load(found, {**_model_and_optimizers(trainer), **dict.fromkeys(saved)}, verify=False)
    if isinstance(state.get("loop"), dict):  # before the parts: the metrics ask whether mid-epoch
        trainer.loop.place(state["loop"], state.get("loader"))
    _same_accumulation(trainer, state.get("config"), found.path)
    for name, part in parts(trainer).items():
        if name not in state:
            raise CheckpointError(f"{found.path}: holds no {name!r} state; it holds {sorted(state)}.")
        part.load_state_dict(state[name])
    metrics = found.metadata.get("metrics")
    if isinstance(metrics, dict):  # what the callbacks and schedulers saw, until the resumed fit logs anew
        trainer.callback_metrics.update({k: float(v) for k, v in metrics.items()
                                         if isinstance(k, str) and isinstance(v, (int, float))})
    before = trainer.loop.fit_end
    if before is not None:  # the saving fit's end added a validation: continue from before it
        trainer.callback_metrics.clear()
        trainer.callback_metrics.update(before["metrics"])
        trainer.loop.validated_at, trainer.loop.fit_end = before["validated_at"], None
    if trainer.loop.plateau_due:  # written during the epoch's end, before its plateau schedulers stepped
        trainer.lr_schedulers.step("epoch", trainer.current_epoch, trainer.callback_metrics, on_plateau=True)
        trainer.loop.plateau_due = False
    trainer.fire("on_load_checkpoint", state)
    rt.random_states().load_state_dict(state["rng"])  # last: nothing may draw random numbers after it
    return list(state.get("loggers", []))


def _same_accumulation(trainer: Trainer, config: Any, path: Path) -> None:
    """Inside an epoch, the steps' micro-batches continue as the saving fit grouped them: a different
    ``accumulate_grad_batches`` would make a step of the wrong micro-batches, its loss divided by the new count."""
    saved = config.get("accumulate_grad_batches") if isinstance(config, dict) else None
    wanted = trainer.config.accumulate_grad_batches
    done = trainer.batches_done_in_epoch
    if saved is not None and str(saved) != str(wanted) and done and not trainer.loop.end_left():
        raise CheckpointError(f"{path} was written after batch {done} of epoch {trainer.current_epoch + 1} with "
                              f"accumulate_grad_batches={saved}; this fit has {wanted}, which would group that "
                              f"epoch's remaining batches into different steps: resume with "
                              f"accumulate_grad_batches={saved} (change it at an epoch's start, from a checkpoint "
                              "written at an epoch's end).")


def restore(trainer: Trainer) -> list[dict[str, Any]] | None:
    """The fit's start: resume from ``Trainer(resume=...)``; returns the loggers' saved states, or None when
    nothing was resumed. In a fault-tolerant fit, then join the replica groups: a group behind the live
    ones takes their state (``rt.join``)."""
    trainer.loop.fit_end = None  # of a fit before on this Trainer
    saved = _resume_asked(trainer)
    if trainer.runtime.replication.fault_tolerant:
        trainer.runtime.join(replica_state(trainer), trainer.global_step)
    return saved


def _resume_asked(trainer: Trainer) -> list[dict[str, Any]] | None:
    config, rt = trainer.config, trainer.runtime
    if config.resume is None:
        return None
    auto = str(config.resume) == "auto"
    source = config.checkpoint_dir if auto else config.resume
    assert source is not None, "TrainerConfig checks that resume='auto' has a checkpoint_dir"
    try:
        found = rt.latest_checkpoint(source, exact=not auto)
    except NoSuchCheckpointError:  # said of the argument given: resume='...'
        raise NoSuchCheckpointError(f"resume={str(source)!r}: no such checkpoint.") from None
    if found is None:
        rt.print(f"lockstep: no intact checkpoint in {config.checkpoint_dir}; starting from scratch.")
        return None
    saved_loggers = resume(trainer, found)
    done, epoch = trainer.batches_done_in_epoch, trainer.current_epoch + 1  # epochs count from 1, as in the names
    where = f"at the start of epoch {epoch}" if done == 0 else f"in epoch {epoch} after its batch {done}"
    rt.print(f"lockstep: resumed from {found.path} {where}, after step {trainer.global_step}.")
    return saved_loggers



def stop_preempted(trainer: Trainer) -> None:
    """A preemption signal reached some rank: checkpoint at this step on every rank, requeue, exit."""
    rt = trainer.runtime
    path = preemption_checkpoint(trainer)
    outcome = rt.requeue()
    # A scheduler that cannot be asked to requeue (Kubernetes' Job and JobSet) starts the job again
    # when it failed: the stop is then a failure, with TERM's exit status.
    code = 0 if rt.env.capabilities.requeues else PREEMPTED_EXIT
    then = "" if code == 0 else f"; exiting with {code} so that {rt.env.capabilities.scheduler} starts it again"
    rt.print(f"lockstep: preempted at step {trainer.global_step}; checkpoint {path}; {outcome}{then}.")
    rt.close()  # fit's `finally` writes the reports
    raise SystemExit(code)


def preemption_checkpoint(trainer: Trainer) -> Path:
    """The checkpoint of this step that a preemption (or a node's reclaim notice) asks for; its path."""
    folder = trainer.config.checkpoint_dir or trainer.log_dir
    path = folder / f"epoch={trainer.current_epoch + 1}-step={trainer.global_step:08d}-preempted.ckpt"
    trainer.save_checkpoint(path)
    return path


def report_best(trainer: Trainer) -> None:
    """Rank 0's loggers that take one (experiment trackers) get the best checkpoint kept."""
    paths = [c.best_model_path for c in trainer.callbacks if isinstance(c, ModelCheckpoint) and c.best_model_path]
    for logger in trainer.loggers:
        log_checkpoint = getattr(logger, "log_checkpoint", None)
        if paths and log_checkpoint is not None:
            log_checkpoint(Path(paths[0]))
