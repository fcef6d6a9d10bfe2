"""Callbacks: typed hooks the Trainer calls on every rank, and the built-in ones."""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lockstep.errors import ConfigError
from lockstep.runtime import complete_checkpoints, is_checkpoint_folder

if TYPE_CHECKING:
    from lockstep.runtime import Checkpoint
    from lockstep.train.module import Module
    from lockstep.train.trainer import Trainer


class Callback:
    """Override the hooks you need; the others do nothing. Every rank runs every hook.

    A hook that issues a collective (saving a checkpoint does) must make the same decision on every
    rank: decide from ``trainer.global_step``, ``trainer.current_epoch`` or
    ``trainer.callback_metrics``, which are identical on all ranks.
    """

    def on_fit_start(self, trainer: Trainer, module: Module) -> None: ...
    def on_fit_end(self, trainer: Trainer, module: Module) -> None: ...
    def on_train_start(self, trainer: Trainer, module: Module) -> None: ...
    def on_train_end(self, trainer: Trainer, module: Module) -> None: ...
    def on_train_epoch_start(self, trainer: Trainer, module: Module) -> None: ...
    def on_train_epoch_end(self, trainer: Trainer, module: Module) -> None: ...
    def on_train_batch_start(self, trainer: Trainer, module: Module, batch: Any, batch_idx: int) -> None: ...
    def on_before_backward(self, trainer: Trainer, module: Module, loss: Any) -> None: ...
    def on_train_batch_end(self, trainer: Trainer, module: Module, outputs: Any, batch: Any, batch_idx: int) -> None:
        ...
    def on_train_log(self, trainer: Trainer, module: Module) -> None:
        """After the optimizer step of a logging step (every ``log_every_n_steps``): the steps' logged
        values are reduced and in ``trainer.callback_metrics``; log more with ``trainer.log_metrics``."""
    def on_validation_epoch_end(self, trainer: Trainer, module: Module) -> None: ...
    def on_validation_end(self, trainer: Trainer, module: Module) -> None:
        """After a validation inside a fit, once every callback's ``on_validation_epoch_end`` has run (its
        judgement, EarlyStopping's, is made): where ModelCheckpoint saves what that validation scored."""
    def on_save_checkpoint(self, trainer: Trainer, module: Module, checkpoint: dict[str, Any]) -> None: ...
    def on_load_checkpoint(self, trainer: Trainer, module: Module, checkpoint: dict[str, Any]) -> None: ...
    def on_exception(self, trainer: Trainer, module: Module, exception: BaseException) -> None: ...

    @property
    def state_key(self) -> str:
        """The name of its state in a checkpoint: its class's name. A callback of which a fit may hold several
        with different settings names them too (EarlyStopping: its monitor and mode), as in Lightning."""
        return type(self).__qualname__

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None


#: Lightning's hooks (of a callback or a LightningModule) that lockstep never calls; defining one is refused,
#: not ignored (docs/migrating-from-lightning.md says where each kind of work goes).
LIGHTNING_HOOKS_NOT_CALLED = (
    "setup", "teardown", "prepare_data", "configure_callbacks", "on_sanity_check_start", "on_sanity_check_end",
    "on_validation_start", "on_validation_epoch_start", "on_validation_batch_start", "on_validation_batch_end",
    "on_validation_model_eval", "on_validation_model_train", "on_validation_model_zero_grad",
    "on_test_start", "on_test_end", "on_test_epoch_start", "on_test_epoch_end", "on_test_batch_start",
    "on_test_batch_end", "on_test_model_eval", "on_test_model_train", "on_predict_start", "on_predict_end",
    "on_predict_epoch_start", "on_predict_epoch_end", "on_predict_batch_start", "on_predict_batch_end",
    "on_predict_model_eval", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad",
    "optimizer_step", "optimizer_zero_grad", "lr_scheduler_step", "configure_gradient_clipping", "backward",
    "manual_backward", "on_before_batch_transfer", "on_after_batch_transfer", "transfer_batch_to_device",
)


def hooks_defining(hook: str, callbacks: list[Callback], module: Module | None) -> list[tuple[str, Any]]:
    """Who runs ``hook``, in order, each as ``(name, fn(trainer, module, *args))``: the module first, when it
    defines the hook (with Lightning's arguments: none for the trainer and the module), so that a checkpoint a
    callback saves in the same hook holds what the module's hook did; then the callbacks that override it."""
    strangers = [type(c).__name__ for c in callbacks if not isinstance(c, Callback)]
    if strangers:
        raise ConfigError(f"callbacks holds {', '.join(strangers)}, which is no lockstep.Callback: subclass "
                          "lockstep.Callback and override the hooks you need (a Lightning callback: see "
                          "docs/migrating-from-lightning.md).")
    found: list[tuple[str, Any]] = []
    # a module that is a Callback too runs as one, with the callbacks' arguments, when it is among them
    if module is not None and not isinstance(module, Callback) and getattr(type(module), hook, None) is not None:
        own = getattr(module, hook)
        found.append((f"{type(module).__name__}.{hook}", lambda trainer, module, *args: own(*args)))
    return found + [(f"{type(c).__name__}.{hook}", getattr(c, hook)) for c in callbacks
                    if getattr(type(c), hook) is not getattr(Callback, hook)]


class HookTable:
    """Who runs each hook (``hooks_defining``): found once per hook, and found again after the callback list
    changed in place (``CallbackList.changes``). ``per_step`` tells, for the three hooks of every batch
    (``PER_STEP``), whether anyone runs them: a batch's path then calls nothing for a hook no one defines."""

    PER_STEP = ("on_train_batch_start", "on_before_backward", "on_train_batch_end")

    def __init__(self, callbacks: CallbackList, module: Module | None) -> None:
        self.callbacks, self.module = callbacks, module
        self.refresh()

    def refresh(self) -> None:
        """Find the hooks again (the loop calls it when ``at`` is no longer the list's ``changes``)."""
        self.at = self.callbacks.changes
        self._found: dict[str, list[tuple[str, Any]]] = {}
        self.per_step = tuple(bool(self.defining(hook)) for hook in self.PER_STEP)

    def runs(self, index: int) -> bool:
        """Whether anyone runs per-step hook ``PER_STEP[index]`` (found again if the callbacks changed)."""
        if self.at != self.callbacks.changes:
            self.refresh()
        return self.per_step[index]

    def logs_at_batch_end(self) -> bool:
        """Whether a hook at the batch's end may log: the module's, or a callback's that is not lockstep's own
        (whose hooks there log nothing). The same on every rank, as its code is."""
        return any(not type(getattr(method, "__self__", None)).__module__.startswith("lockstep.")
                   for _, method in self.defining("on_train_batch_end"))

    def defining(self, hook: str) -> list[tuple[str, Any]]:
        if self.at != self.callbacks.changes:
            self.refresh()
        found = self._found.get(hook)
        if found is None:  # once per hook
            found = self._found[hook] = hooks_defining(hook, self.callbacks, self.module)
        return found


def check_hooks(callbacks: list[Callback], module: Module) -> None:
    """Refuse what a port from Lightning would define in vain: hooks lockstep never calls, and manual
    optimization."""
    unused = [f"{type(owner).__name__}.{hook}" for owner in (module, *callbacks)
              for hook in LIGHTNING_HOOKS_NOT_CALLED if getattr(type(owner), hook, None) is not None]
    if unused:
        raise ConfigError(f"{', '.join(unused)}: lockstep never calls these Lightning hooks, so their work would "
                          "silently not happen. Move it where docs/migrating-from-lightning.md (\"Hooks\") says "
                          "(set-up into __init__ or configure_model, per-step work into training_step or "
                          "on_before_backward / on_train_batch_end), or rename a method of your own that only "
                          "shares the name.")
    if getattr(module, "automatic_optimization", True) is False:
        raise ConfigError(f"{type(module).__name__}.automatic_optimization = False: lockstep's Trainer runs the "
                          "backward and the optimizer step itself (exact over the ranks). For a loop of your own "
                          "(several backwards, GANs), use the runtime API: rt.backward(loss), optimizer.step() "
                          "(docs/runtime.md).")


def _link(link: Path, target: Path) -> None:
    """Point ``link`` at ``target`` (a sibling), replacing what was there in one rename."""
    temporary = link.with_name(f".{link.name}.link")
    with contextlib.suppress(FileNotFoundError):
        temporary.unlink()
    temporary.symlink_to(target.name)
    if link.is_dir() and not link.is_symlink():
        _remove(link)
    os.replace(temporary, link)


_CHECKPOINT_NAME = re.compile(r"epoch=\d+-step=\d+\.ckpt")


def _remove_checkpoint(folder: Path, path: Path) -> None:
    """Delete the checkpoint ``path`` only if it is one, directly inside ``folder``: a folder of
    ModelCheckpoint's name pattern holding lockstep's metadata, not a link."""
    if (path.parent.resolve() == folder.resolve() and _CHECKPOINT_NAME.fullmatch(path.name)
            and not path.is_symlink() and is_checkpoint_folder(path)):
        shutil.rmtree(path, ignore_errors=True)


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def _better(mode: str, value: float, than: float, min_delta: float = 0.0) -> bool:
    return value < than - min_delta if mode == "min" else value > than + min_delta


def _check_mode(mode: str) -> str:
    if mode not in ("min", "max"):
        raise ConfigError(f"mode={mode!r}: use 'min' or 'max'.")
    return mode


class CallbackList(list[Callback]):
    """The Trainer's callbacks: a list that counts its changes, so that the Trainer looks up which
    callbacks define a hook again only after one (``changes``), not on every call."""

    changes = 0


def _counted(name: str) -> Any:
    change = getattr(list, name)

    def counted(self: CallbackList, *args: Any, **kwargs: Any) -> Any:
        self.changes += 1
        return change(self, *args, **kwargs)

    counted.__name__ = name
    return counted


for _name in ("append", "extend", "insert", "remove", "pop", "clear", "sort", "reverse", "__setitem__",
              "__delitem__", "__iadd__", "__imul__"):
    setattr(CallbackList, _name, _counted(_name))


class ModelCheckpoint(Callback):
    """Save checkpoints every ``every_n_steps`` steps and/or ``every_n_epochs`` epochs.

    With ``monitor``, keep the ``save_top_k`` best by that metric (``mode`` min or max); without,
    keep the newest ``save_top_k`` (``-1``: all). ``every_n_epochs`` defaults to 1 without
    ``every_n_steps``, to 0 (never) with it, as in Lightning. ``save_last`` also keeps ``last.ckpt`` (a
    link to the newest checkpoint when that one is kept), and saves the fit's final step when no rule did.
    ``best_model_path`` and ``best_model_score`` are read from the folder when a fit starts (a resumed
    fit keeps them), then follow each save. ``dirpath`` defaults to the Trainer's
    ``checkpoint_dir``. Each checkpoint is a folder that every rank writes its shards into,
    committed atomically; ``async_save`` writes it in the background while training goes on, and
    an older checkpoint is deleted only once the newer one is committed.
    """

    def __init__(self, dirpath: str | Path | None = None, monitor: str | None = None, mode: str = "min",
                 save_top_k: int = 1, save_last: bool = True, every_n_steps: int | None = None,
                 every_n_epochs: int | None = None, async_save: bool = False) -> None:
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.monitor, self.mode = monitor, _check_mode(mode)
        self.save_top_k, self.save_last = save_top_k, save_last
        if every_n_epochs is None:  # Lightning's: each epoch, unless a step interval is given
            every_n_epochs = 0 if every_n_steps else 1
        self.every_n_steps, self.every_n_epochs = every_n_steps, every_n_epochs
        self.async_save = async_save
        self.best_model_path: str | None = None
        self.best_model_score: float | None = None
        self._unscored_warned = False
        self._after_validation = False  # a step's save waits for the step's validation
        self._superseded: set[Path] = set()  # damaged checkpoints after a resume="auto" fit's start: replaced

    @property
    def state_key(self) -> str:
        return (f"ModelCheckpoint{{'monitor': {self.monitor!r}, 'mode': {self.mode!r}, 'every_n_steps': "
                f"{self.every_n_steps!r}, 'every_n_epochs': {self.every_n_epochs!r}}}")

    def on_fit_start(self, trainer: Trainer, module: Module) -> None:
        folder = self.dirpath or trainer.checkpoint_dir
        if folder is not None:
            trainer.runtime.prepare_checkpoint_folder(folder)
            found = complete_checkpoints(folder)  # each one's metadata read once, for both
            self._superseded = self._after_the_start(trainer, Path(folder), found)
            self._note_best(self._kept(Path(folder), found))

    def _after_the_start(self, trainer: Trainer, folder: Path, found: list[Checkpoint]) -> set[Path]:
        """This callback's checkpoints in ``folder`` of steps after the one this fit starts from. A fit that
        ``resume="auto"`` resumed from this folder passed over them as damaged: its own saves replace them.
        Any other fit (a fresh one, one resumed from an older checkpoint) would write among another run's
        checkpoints: a save at an existing name would keep that run's weights, and a later ``resume="auto"``
        would continue that run. It is refused, naming them (rank 0's view, so every rank says the same)."""
        rt, start = trainer.runtime, trainer.global_step
        later = rt.broadcast(sorted(checkpoint.path.name for checkpoint in found
                                    if checkpoint.step > start and _CHECKPOINT_NAME.fullmatch(checkpoint.path.name)))
        if not later:
            return set()
        auto = str(trainer.config.resume) == "auto" and Path(trainer.checkpoint_dir or "") == folder
        if auto:
            rt.print(f"lockstep: {', '.join(later)} in {folder} (passed over as damaged): this fit's checkpoints "
                     "replace them.")
            return {folder / name for name in later}
        begun = f"resumes from step {start}" if start else "starts at step 0"
        raise ConfigError(f"{folder} holds checkpoints of steps after the one this fit {begun} ({', '.join(later)}): "
                          "another run's, which this fit's checkpoints would mix with. Give resume='auto' to "
                          "continue that run, or another checkpoint folder, or move them away.")

    def on_train_batch_end(self, trainer: Trainer, module: Module, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.every_n_steps and trainer.at_step_boundary and trainer.global_step % self.every_n_steps == 0:
            if trainer.evaluation.due_after(trainer.global_step):  # saved once the step's validation is in
                self._after_validation = True  # (on_validation_end): a resume does not miss it, the score is the step's
            else:
                self.save(trainer)

    def on_validation_end(self, trainer: Trainer, module: Module) -> None:
        """A step save that waited for this validation; with ``monitor`` and validation inside epochs
        (``val_check_interval``), every validation's save: its score belongs to these weights."""
        if self._after_validation or (self.monitor is not None and self._scores_inside_epochs(trainer)):
            self._after_validation = False
            self.save(trainer)

    def on_train_epoch_end(self, trainer: Trainer, module: Module) -> None:
        if self.monitor is not None and trainer.evaluation.inside_epochs:
            return  # saved at validations (the last score is older than the epoch's end)
        if self.every_n_epochs and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self.save(trainer)

    def _scores_inside_epochs(self, trainer: Trainer) -> bool:
        """Validations inside the epochs: in an epoch the epoch rule saves, each one's save (Lightning's)."""
        every = self.every_n_epochs or 0
        return trainer.evaluation.inside_epochs and every > 0 and (trainer.current_epoch + 1) % every == 0

    def state_dict(self) -> dict[str, Any]:
        return {"after_validation": self._after_validation}  # a resume that runs the validation then saves

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._after_validation = bool(state.get("after_validation", False))

    def on_train_end(self, trainer: Trainer, module: Module) -> None:
        """Whatever ended the fit (``max_steps`` within an epoch, a stream, early stopping), with
        ``save_last`` its final step is saved (ranked as the rules' saves are), unless a checkpoint of that
        step exists."""
        folder = self.dirpath or trainer.checkpoint_dir
        if folder is None or not self.save_last:
            return
        rt = trainer.runtime
        rt.wait_for_save()
        saved = any(found.step == trainer.global_step and found.path not in self._superseded
                    for found in complete_checkpoints(folder))
        if not rt.broadcast(saved):  # rank 0's view decides, so every rank saves or none does
            self.save(trainer)

    def save(self, trainer: Trainer) -> None:
        """Every rank calls it (every rank writes its shards)."""
        folder = self.dirpath or trainer.checkpoint_dir
        if folder is None:
            raise ConfigError("ModelCheckpoint needs a folder: give dirpath= or Trainer(checkpoint_dir=...).")
        folder = Path(folder)
        # The epoch counts from 1, as in the progress lines: epoch=1 is the first epoch's (the step's own epoch,
        # also once that epoch has ended)
        path = folder / f"epoch={trainer.loop.epoch_number}-step={trainer.global_step:08d}.ckpt"
        trainer.runtime.wait_for_save()  # a save in the background: the folder then shows it
        kept = self._kept(folder)
        if path in kept:
            return  # already saved at this step (e.g. by both the step and the epoch rule)
        score = self._score(trainer)
        if score is None:
            return
        mode = self.mode if self.monitor is not None else "max"
        keep = self.save_top_k != 0 and (
            self.save_top_k < 0 or len(kept) < self.save_top_k
            or _better(mode, score, min(kept.values()) if mode == "max" else max(kept.values())))
        last = folder / "last.ckpt"
        if not keep:
            if self.save_last:
                trainer.save_checkpoint(last, blocking=not self.async_save)
            return
        kept[path] = score
        self._superseded.discard(path)  # replaced by this save
        ranked = self._note_best(kept)
        dropped = ranked[self.save_top_k:] if self.save_top_k > 0 else []

        def after_commit() -> None:  # rank 0, once the new checkpoint is complete
            if self.save_last:
                _link(last, path)
            for old in dropped:
                _remove_checkpoint(folder, old)

        trainer.save_checkpoint(path, blocking=not self.async_save, then=after_commit)

    def _kept(self, folder: Path, listed: list[Checkpoint] | None = None) -> dict[Path, float]:
        """This callback's checkpoints in ``folder`` and their scores, read from the folder itself
        (never from restored state: a copied run folder must not delete the original's); ``listed``: the
        folder's checkpoints, where the caller has just read them."""
        kept = {}
        for found in listed if listed is not None else complete_checkpoints(folder):
            if not _CHECKPOINT_NAME.fullmatch(found.path.name) or found.path in self._superseded:
                continue
            if self.monitor is None:
                kept[found.path] = float(found.step)
                continue
            metrics = found.metadata.get("metrics", {})
            value = metrics.get(self.monitor) if isinstance(metrics, dict) else None
            if isinstance(value, int | float):
                kept[found.path] = self._ranked(float(value))
        return kept

    def _note_best(self, kept: dict[Path, float]) -> list[Path]:
        """The kept checkpoints, the best first; the best noted as ``best_model_path``/``best_model_score``."""
        ranked = sorted(kept, key=lambda p: kept[p], reverse=self.monitor is None or self.mode == "max")
        if ranked:
            self.best_model_path = str(ranked[0])
            self.best_model_score = kept[ranked[0]] if self.monitor is not None else None
        return ranked

    def _score(self, trainer: Trainer) -> float | None:
        """The checkpoint's score; None (not saved) when the monitored metric is a validation's and no
        validation has run yet (Lightning's, with a warning): an error once one has."""
        if self.monitor is None:
            return float(trainer.global_step)
        score = trainer.callback_metrics.get(self.monitor)
        if score is None:
            if trainer.validates and trainer.loop.validated_at is None:
                if not self._unscored_warned:
                    self._unscored_warned = True
                    trainer.runtime.print(f"lockstep: ModelCheckpoint(monitor={self.monitor!r}) skips its saves "
                                          f"until the metric is logged (step {trainer.global_step}: no validation "
                                          "has run yet).")
                return None
            raise ConfigError(f"ModelCheckpoint(monitor={self.monitor!r}): no such metric yet; logged "
                              f"metrics are {sorted(trainer.callback_metrics)}.")
        return self._ranked(float(score))

    def _ranked(self, score: float) -> float:
        """A NaN score (a diverged step) ranks last, as in Lightning."""
        return score if not math.isnan(score) else (math.inf if self.mode == "min" else -math.inf)


class EarlyStopping(Callback):
    """Stop when ``monitor`` has not improved by ``min_delta`` for ``patience`` validations (for
    ``patience`` epochs when the fit has no validation data). A metric logged in ``training_step``
    holds the epoch's value at an epoch's end.

    The metric is reduced over all ranks before it is compared, so every rank decides the same and
    stops at the same step. ``check_finite`` (Lightning's default): a NaN or infinite value stops the fit
    at once.
    """

    def __init__(self, monitor: str, mode: str = "min", patience: int = 3, min_delta: float = 0.0,
                 check_finite: bool = True) -> None:
        self.monitor, self.mode = monitor, _check_mode(mode)
        self.patience, self.min_delta, self.check_finite = patience, min_delta, check_finite
        self.best: float | None = None
        self.wait = 0
        self.stopped_at_step: int | None = None

    @property
    def state_key(self) -> str:
        return f"EarlyStopping{{'monitor': {self.monitor!r}, 'mode': {self.mode!r}}}"

    def on_validation_epoch_end(self, trainer: Trainer, module: Module) -> None:
        if trainer.loop.fit_end is None:  # else the fit's end added this validation: its verdict would change
            self._check(trainer)  # nothing in this fit, and a fit resumed from its end never had it

    def on_train_epoch_end(self, trainer: Trainer, module: Module) -> None:
        if not trainer.validates:  # no validation to wait for: judge each epoch (a training metric)
            self._check(trainer)

    def _check(self, trainer: Trainer) -> None:
        if self.monitor not in trainer.callback_metrics:
            raise ConfigError(f"EarlyStopping(monitor={self.monitor!r}): no such metric; logged metrics are "
                              f"{sorted(trainer.callback_metrics)}.")
        value = trainer.callback_metrics[self.monitor]
        if self.check_finite and not math.isfinite(value):
            trainer.runtime.print(f"lockstep: EarlyStopping stops the fit at step {trainer.global_step}: "
                                  f"{self.monitor} = {value} is not finite (the best was {self.best}).")
            trainer.should_stop = True
            self.stopped_at_step = trainer.global_step
            return
        if self.best is None or _better(self.mode, value, self.best, self.min_delta):
            self.best, self.wait = value, 0
            return
        self.wait += 1
        if self.wait >= self.patience:
            trainer.should_stop = True
            self.stopped_at_step = trainer.global_step

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "wait": self.wait}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.wait = state.get("best"), int(state.get("wait", 0))


class LearningRateMonitor(Callback):
    """Log each optimizer param group's learning rate as ``lr-<optimizer>-<group>``: the optimizer's index,
    or the ``name`` of its scheduler's configuration. ``"step"``: at each logging step, the rate that step
    used (read at its last batch's start, before its schedulers step); ``"epoch"``: at each epoch's start,
    the rate its first step uses (both as Lightning logs them)."""

    def __init__(self, logging_interval: str = "step") -> None:
        if logging_interval not in ("step", "epoch"):
            raise ConfigError(f"logging_interval={logging_interval!r}: use 'step' or 'epoch'.")
        self.logging_interval = logging_interval
        self._used: dict[str, float] = {}  # the rates of the step under way

    def _rates(self, trainer: Trainer) -> dict[str, float]:
        names = {id(getattr(s.scheduler, "optimizer", None)): s.name for s in trainer.lr_schedulers if s.name}
        return {f"lr-{names.get(id(optimizer), i)}-{j}": float(group["lr"])
                for i, optimizer in enumerate(trainer.optimizers) for j, group in enumerate(optimizer.param_groups)}

    def on_train_batch_start(self, trainer: Trainer, module: Module, batch: Any, batch_idx: int) -> None:
        if self.logging_interval == "step" and trainer.at_step_boundary:
            self._used = self._rates(trainer)

    def on_train_log(self, trainer: Trainer, module: Module) -> None:
        if self.logging_interval == "step":
            trainer.log_metrics(self._used or self._rates(trainer))

    def state_dict(self) -> dict[str, Any]:
        return {"used": dict(self._used)}  # a checkpoint written before its step's row: the resumed row has them

    def load_state_dict(self, state: dict[str, Any]) -> None:
        used = state.get("used")
        self._used = {str(k): float(v) for k, v in used.items()} if isinstance(used, dict) else {}

    def on_train_epoch_start(self, trainer: Trainer, module: Module) -> None:
        if self.logging_interval == "epoch" and not trainer.batches_done_in_epoch:  # else resumed: its row is written
            trainer.log_metrics(self._rates(trainer))
