"""``lockstep.Trainer``: fit / validate / test / predict, built only on the runtime's public API.

Reading order of one training run: ``fit`` → ``_train_epoch`` → ``_train_batch`` (one forward
and backward, ``train/steps.py``) → ``_step_taken`` → ``_step_optimizers``; then ``_after_step``
(preemption, mid-epoch validation, the stop check) and ``_end_epoch``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import DataLoader

from lockstep.env import DistEnv
from lockstep.env.fault_tolerance import ENV_GROUP
from lockstep.errors import ConfigError, StateError, UsageError
from lockstep.runtime import (
    DistributedLoader,
    FaultTolerance,
    Runtime,
    RuntimeConfig,
    is_stream,
    seed_everything,
    unwrap,
)
from lockstep.train import checkpoint as ckpt
from lockstep.train.callbacks import Callback, CallbackList, HookTable, ModelCheckpoint, check_hooks
from lockstep.train.config import TrainerConfig
from lockstep.train.evaluation import Evaluation
from lockstep.train.loggers import Logger, make_loggers, resume_loggers
from lockstep.train.loop import LoopCounter, LoopState
from lockstep.train.metrics import TrainingMetrics
from lockstep.train.module import Module, StepRouter, configure_model, configure_optimizers
from lockstep.train.profilers import SimpleProfiler, hook_runner, make_profiler
from lockstep.train.recording import LOSS_NAME, Recorder
from lockstep.train.schedulers import Schedules
from lockstep.train.steps import WholeModelStep, batch_step_for

if TYPE_CHECKING:
    from lockstep.runtime import Devices, Parallel, Policy, Strategy
from lockstep.train.progress import ProgressBar, ThroughputMonitor


class Trainer:
    """Runs a ``lockstep.Module`` on every rank with the runtime's exact data, precision and collectives.

    ``devices``, ``accelerator``, ``strategy``, ``parallel``, ``precision``, ``seed``, ``deterministic``,
    ``timeout`` and ``per_sample_rng`` go to ``lockstep.Runtime``; ``trainer.config`` holds all settings (a
    ``TrainerConfig``). ``batch_size`` (in ``fit`` etc.) is the global batch. Stop after
    ``max_epochs`` epochs or ``max_steps`` optimizer steps, whichever comes first. Creating the
    Trainer seeds every random generator with ``seed``: build the module after it.

    ``compile=True`` (or a dict of ``torch.compile`` options) compiles the module's repeated blocks
    in place, or the module whole when it has none or their layouts are too many: its ``forward``, or
    without one its children (see ``Runtime.compile``). A module passed already
    compiled (``torch.compile(module)``) is unwrapped and compiled that way.
    ``activation_checkpointing`` (``"full"``, ``"selective"`` or a function) recomputes the repeated
    blocks' activations in the backward (see ``Runtime.setup``).

    The Runtime is created by the first ``fit``/``validate``/``test``/``predict``: that joins the
    process group, or, for a script started with plain ``python`` that asks for several devices,
    re-runs the script as one worker per device (self-launch; this process then never returns).
    """

    # where the fit stands: the loop state's own (``trainer.loop``), read here as in Lightning
    current_epoch = LoopCounter[int]()
    global_step = LoopCounter[int]()
    batches_done_in_epoch = LoopCounter[int]()
    samples_seen = LoopCounter[int]()
    steps_per_epoch = LoopCounter["int | None"]()
    at_step_boundary = LoopCounter[bool]()
    epoch_ended = LoopCounter[bool]()
    should_stop = LoopCounter[bool]()  # a callback sets it to end the fit after this step

    def __init__(
        self, *, max_epochs: int | None = None, max_steps: int | None = None, devices: Devices = "auto",
        num_nodes: int | None = None, accelerator: str | None = None, strategy: str | Strategy | None = None,
        parallel: Parallel | None = None, precision: str | int | None = None,
        accumulate_grad_batches: int = 1, gradient_clip_val: float | None = None,
        val_check_interval: int | None = None, log_every_n_steps: int = 50, seed: int = 0,
        deterministic: bool = False, checkpoint_dir: str | Path | None = None, resume: str | Path | None = None,
        callbacks: Sequence[Callback] = (), loggers: Sequence[Any] = ("csv",), log_dir: str | Path | None = None,
        profiler: str | SimpleProfiler | None = None, enable_progress_bar: bool = True,
        enable_throughput_monitor: bool = True,
        num_workers: int | None = None, timeout: float | None = None, compile: bool | dict[str, Any] | None = None,
        per_sample_rng: bool = False, activation_checkpointing: Policy | None = None,
    ) -> None:
        runtime = RuntimeConfig(accelerator=accelerator, devices=devices, strategy=strategy, parallel=parallel,
                                precision=precision, seed=seed, deterministic=deterministic, timeout=timeout,
                                per_sample_rng=per_sample_rng)
        self.config = TrainerConfig(
            max_epochs=max_epochs, max_steps=max_steps, num_nodes=num_nodes,
            accumulate_grad_batches=accumulate_grad_batches, gradient_clip_val=gradient_clip_val,
            val_check_interval=val_check_interval, log_every_n_steps=log_every_n_steps,
            checkpoint_dir=Path(checkpoint_dir) if checkpoint_dir is not None else None, resume=resume,
            log_dir=Path(log_dir) if log_dir is not None else None, num_workers=num_workers, compile=compile,
            activation_checkpointing=activation_checkpointing, runtime=runtime,
        )
        seed_everything(seed)  # now, so that a module built after the Trainer starts from repeatable weights
        self._module: Module | None = None
        self.callbacks = _with_default_callbacks(callbacks, checkpoint_dir is not None, enable_throughput_monitor,
                                                 enable_progress_bar)
        self._logger_specs, self.profiler = loggers, profiler  # make_loggers reads them (a str is one)
        self._runtime: Runtime | None = None
        self.compiled: list[str] = []  # what compile= compiled: block or child names, "" for the module's forward
        self.loggers: list[Logger] = []
        self.callback_metrics: dict[str, float] = {}
        self.progress_bar_metrics: set[str] = {LOSS_NAME}
        self.loop = LoopState()
        self.optimizers: list[torch.optim.Optimizer] = []
        self.lr_schedulers = Schedules()  # each scheduler and when it steps
        self._wrapped: Any = None
        self.train_loader: DistributedLoader | None = None
        self._val_loader: DistributedLoader | None = None
        self.evaluation = Evaluation(self)
        self.metrics = TrainingMetrics()
        self.recorder = Recorder(self.metrics, self.loop)  # where self.log goes in the current stage
        self._forward_backward: Callable[[Any, int], Any] = WholeModelStep(self)  # chosen by _start

    # -- where this rank sits ----------------------------------------------------------------------
    @property
    def callbacks(self) -> CallbackList:
        """The callbacks, in the order their hooks run (lockstep's defaults, then the ModelCheckpoints, last).
        Change them in place, or assign new ones: an assigned plain list is copied (and kept in its order), so
        change ``trainer.callbacks`` after that."""
        return self._callbacks

    @callbacks.setter
    def callbacks(self, callbacks: Sequence[Callback]) -> None:
        self._callbacks = callbacks if isinstance(callbacks, CallbackList) else CallbackList(callbacks)
        self._hooks = HookTable(self._callbacks, self._module)  # who runs each hook: see fire

    @property
    def profiler(self) -> Any:
        """The profiler that times each hook (``profiler=`` of the Trainer); assign another to change it."""
        return self._profiler

    @profiler.setter
    def profiler(self, spec: Any) -> None:
        self._profiler = make_profiler(spec)
        self._run_hook = hook_runner(self._profiler)

    @property
    def runtime(self) -> Runtime:
        """The Runtime that ``fit``/``validate``/``test``/``predict`` created."""
        if self._runtime is None:
            raise StateError("the Trainer has no Runtime yet: fit, validate, test and predict create it.")
        return self._runtime

    @property
    def is_global_zero(self) -> bool:
        """True on rank 0 (read from the launcher's environment before the Runtime exists)."""
        return self._runtime.is_global_zero if self._runtime is not None else DistEnv.from_environ().is_global_zero

    @property
    def local_batch_samples(self) -> int:
        """This rank's samples in the current batch (0 outside a batch)."""
        return self.loop.batch_samples or 0

    @property
    def is_logging_step(self) -> bool:
        return self.loop.global_step % self.config.log_every_n_steps == 0

    @property
    def module(self) -> Module:
        """The module that ``fit``/``validate``/``test``/``predict`` set up."""
        if self._module is None:
            raise StateError("no module is set up: call fit, validate, test or predict first.")
        return self._module

    @property
    def data_wait_s(self) -> float:
        """Seconds this rank waited for training batches (the loader's ``wait_s``)."""
        return self.train_loader.wait_s if self.train_loader is not None else 0.0

    @property
    def validates(self) -> bool:
        """Whether the current fit has validation data."""
        return self._val_loader is not None

    @property
    def checkpoint_dir(self) -> Path | None:
        return self.config.checkpoint_dir

    @property
    def log_dir(self) -> Path:
        """``log_dir``, else ``checkpoint_dir``, else ``runs/lockstep``; in a fault-tolerant fit, its
        ``replica-group-N`` folder (each group's rank 0 logs what its group saw)."""
        base = self.config.log_dir or self.config.checkpoint_dir or Path("runs/lockstep")
        group = self._replica_group()
        return base / f"replica-group-{group}" if group is not None else base

    def _replica_group(self) -> int | None:
        """This replica group's number in a fault-tolerant fit (before ``fit`` too), else None."""
        if self._runtime is not None:
            return self._runtime.replication.index
        asked = self.config.runtime.fault_tolerance or FaultTolerance.from_environ()
        if asked is None:
            return None
        raw = os.environ.get(ENV_GROUP) or "0"
        return asked.replica_group if asked.replica_group is not None else int(raw) if raw.isdigit() else None

    # -- public entry points ------------------------------------------------------------------------
    def fit(self, module: Module, train_data: Any, val_data: Any = None, batch_size: int | None = None,
            val_batch_size: int | None = None, loader_options: dict[str, Any] | None = None) -> Trainer:
        """Train ``module`` on ``train_data`` (a dataset or DataLoader), validating on ``val_data``.

        ``loader_options`` go to every DataLoader built here (``collate_fn``, ``num_workers``,
        ``pin_memory``, ...); with a DataLoader they override its own."""
        if self.config.max_epochs is None and self.config.max_steps is None:
            raise ConfigError("fit needs a stopping rule: give the Trainer max_epochs or max_steps (or both). "
                              "validate, test and predict need neither.")
        rt = self._start(module, with_optimizers=True)
        self.recorder.start_fit()
        self.metrics.reset()  # a fit's own sums (a checkpoint resumed below restores its own)
        options = self._loader_options(loader_options)
        self._make_train_loader(train_data, batch_size, options)
        if val_data is not None:
            self._val_loader = self.evaluation.loader(val_data, val_batch_size or batch_size, options, "validation")
        saved_loggers = ckpt.restore(self)
        if rt.is_global_zero:
            self.loggers = make_loggers(self._logger_specs, self.log_dir)
            if saved_loggers is not None:  # each continues its run and drops what it logged after the checkpoint
                resume_loggers(self.loggers, saved_loggers, self.global_step)
            for logger in self.loggers:
                logger.log_hyperparams({**self.config.hparams(), **dict(getattr(module, "hparams", {}) or {})})
        self.profiler.start(self.log_dir, rt.rank)
        try:
            self.fire("on_fit_start")
            self.fire("on_train_start")
            if self.loop.log_due:  # resumed from a checkpoint of a logging step written before its row
                self._write_log(self.metrics.window_values(rt))
            self.evaluation.after_resume()
            if self.loop.step_plateau_due:  # resumed from a checkpoint of a step whose plateau schedulers are due
                self._step_plateau_schedulers()
            while not self.loop.finished(self.config.max_epochs, self.config.max_steps) or self.loop.end_left():
                self._train_epoch()
            self.evaluation.at_fit_end()
            self.fire("on_train_end")  # ModelCheckpoint saves the final step, if it is not saved yet
            rt.wait_for_save()  # a checkpoint still being written in the background
            ckpt.report_best(self)
            self.fire("on_fit_end")
        except BaseException as error:
            for callback in self.callbacks:
                callback.on_exception(self, module, error)
            raise
        finally:
            self.recorder.sink = None
            self._finish_reports()
        return self

    def _make_train_loader(self, data: Any, batch_size: int | None, options: dict[str, Any]) -> None:
        """``train_loader`` and ``steps_per_epoch`` (None for a stream without ``__len__``)."""
        # Shuffle a dataset (unless loader_options say shuffle=False); a DataLoader keeps its own order (its
        # sampler), a stream is read in order.
        shuffle = options.get("shuffle", None if isinstance(data, DataLoader) or is_stream(data) else True)
        self.train_loader = self.runtime.loader(data, batch_size=batch_size, **{**options, "shuffle": shuffle})
        try:
            self.steps_per_epoch = len(self.train_loader)
        except TypeError:  # a stream without __len__: an epoch is one pass, however long
            if self.config.max_steps is None:
                raise ConfigError("the training data is a stream without __len__, whose epochs have no known "
                                  "length: give the Trainer max_steps.") from None
            self.steps_per_epoch = None

    def validate(self, module: Module, data: Any, batch_size: int | None = None,
                 loader_options: dict[str, Any] | None = None, ckpt_path: str | Path | None = None) -> dict[str, float]:
        """Run ``validation_step`` over ``data`` once; metrics are exact over the whole dataset. ``ckpt_path``:
        first load the module's weights from ``"best"`` (the ModelCheckpoint's best), ``"last"`` (the newest in
        ``checkpoint_dir``) or a checkpoint folder."""
        return self.evaluation.once(module, data, batch_size, "validation_step", loader_options, ckpt_path)

    def test(self, module: Module, data: Any, batch_size: int | None = None,
             loader_options: dict[str, Any] | None = None, ckpt_path: str | Path | None = None) -> dict[str, float]:
        """Run ``test_step`` over ``data`` once; metrics are exact over the whole dataset (``ckpt_path``: as
        ``validate``'s)."""
        return self.evaluation.once(module, data, batch_size, "test_step", loader_options, ckpt_path)

    def predict(self, module: Module, data: Any, batch_size: int | None = None,
                loader_options: dict[str, Any] | None = None, ckpt_path: str | Path | None = None) -> Any:
        """``predict_step`` outputs of every sample, in dataset order, on every rank (one row per sample;
        ``ckpt_path``: as ``validate``'s)."""
        return self.evaluation.predict(module, data, batch_size, loader_options, ckpt_path)

    def log_metrics(self, metrics: dict[str, float]) -> None:
        """Record already-reduced values (identical on every rank); rank 0's loggers write them."""
        self.callback_metrics.update(metrics)
        for logger in self.loggers if metrics else ():  # no empty row (a step that logged nothing)
            logger.log_metrics(metrics, self.global_step)

    def record_metric(self, name: str, value: float | torch.Tensor, *, prog_bar: bool = False,
                      batch_size: int | torch.Tensor | None = None, on_step: bool | None = None,
                      on_epoch: bool | None = None) -> None:
        """What ``Module.log`` calls: ``value`` into the current stage's sums (``Recorder.log``)."""
        self.recorder.log(name, value, batch_size, on_step, on_epoch)
        if prog_bar:
            self.progress_bar_metrics.add(name)

    def save_checkpoint(self, path: str | Path, blocking: bool = True, then: Callable[[], None] | None = None) -> None:
        """Every rank calls it: each writes its shards into the checkpoint folder ``path``, committed
        atomically. ``blocking=False`` writes in the background; rank 0 runs ``then`` once committed.
        The seconds rank 0's loop was blocked are logged (by its loggers) as ``checkpoint_blocked_s``."""
        ckpt.save(self, Path(path), blocking=blocking, then=then)

    # -- set-up and resume --------------------------------------------------------------------------
    def _start(self, module: Module, with_optimizers: bool) -> Runtime:
        """Create the Runtime on first use (see the class docstring), then set ``module`` up on it."""
        inner = unwrap(module)  # also torch.compile's wrapper: its module is compiled as compile= says
        compile = self.config.compile if self.config.compile is not None else inner is not module
        if not isinstance(inner, Module):
            raise UsageError(f"the Trainer runs a lockstep.Module; got {type(inner).__name__}: subclass "
                             "lockstep.Module and write training_step / configure_optimizers.")
        module = inner
        if self._runtime is None:
            self._runtime = Runtime.from_config(self.config.runtime)
            self.config.check_runtime(self._runtime)  # num_nodes as launched; every rank given the same loop
            self.recorder.device = self._runtime.device
        if with_optimizers or self._module is not module:
            check_hooks(self.callbacks, module)
            self._hooks = HookTable(self._callbacks, module)  # the module's own hooks are found again
            module.attach(self)
            configure_model(module, self._runtime)
            if not self.compiled:
                self._runtime.compile(module, compile)
                self.compiled = list(self._runtime.compiled)
            self._module = module
            self.optimizers, self.lr_schedulers = configure_optimizers(module) if with_optimizers else ([], Schedules())
            wrapped = self._runtime.setup(StepRouter(module), *self.optimizers,
                                          activation_checkpointing=self.config.activation_checkpointing)
            self._wrapped = wrapped[0] if self.optimizers else wrapped
            # a batch's forward and backward: on the whole model, or on pipeline stages; chosen once
            self._forward_backward = batch_step_for(self, self._runtime.pipeline_parallel_size > 1)
        return self._runtime

    def _loader_options(self, given: dict[str, Any] | None) -> dict[str, Any]:
        """``Trainer(num_workers=...)``, then what the call gave (``collate_fn``, ``pin_memory``, ...)."""
        workers = self.config.num_workers
        options = {} if workers is None else {"num_workers": workers}
        for reserved in ("batch_size", "sampler", "batch_sampler"):
            if given and reserved in given:
                raise ConfigError(f"loader_options cannot set {reserved!r}: pass batch_size= (the global batch); to "
                                  "choose the samples, give fit a DataLoader built with your sampler or batch_sampler "
                                  "(lockstep draws its order the same on every rank and splits each global batch).")
        return {**options, **(given or {})}

    # -- the training loop, in reading order ------------------------------------------------------
    def _train_epoch(self) -> None:
        """One pass over the training data, from where a resumed run left off."""
        assert self.train_loader is not None
        start = self._start_epoch(self.train_loader)
        stopped = skipped = False
        # A checkpoint saved at an epoch's last batch resumes with only the epoch's end left to run.
        batches = () if self.loop.only_end_left else self.train_loader
        for batch in batches:
            stepped = self._train_batch(batch, self.train_loader.batches_done - 1)  # a batch drawn again keeps it
            if stepped is None:  # the module's on_train_batch_start returned -1: the rest of the epoch is skipped
                skipped = True
                break
            if stepped and self._after_step():
                stopped = True
                break
        if start == 0 and self.batches_done_in_epoch == 0 and not skipped:  # else an empty stream would loop forever
            raise ConfigError(f"the training data yielded no batch in epoch {self.current_epoch + 1}: an empty "
                              "stream trains nothing. Check the stream's source, filter or split.")
        if not stopped or self.train_loader.last_batch:  # the epoch's data is done
            self._end_epoch()

    def _start_epoch(self, loader: DistributedLoader) -> int:
        """Position the loader; a resumed epoch keeps the metric sums restored from the checkpoint."""
        start = self.loop.start_epoch()
        position = loader.state_dict()  # restored from a checkpoint: it may hold the stream's own state
        if (position["epoch"], position["batches_done"]) != (self.current_epoch, start):
            position = {"epoch": self.current_epoch, "batches_done": start}
        loader.load_state_dict(position)
        if start == 0:
            self.metrics.start_epoch()
        self.metrics.commits = self.runtime.replication.fault_tolerant  # a step's values count once it commits
        # An epoch resumed from a checkpoint started before it: its start hook runs again (as in Lightning, for what
        # else it does), and what it logs again goes nowhere, as the restored sums hold it.
        self.recorder.sink = self.metrics.sink_at_epoch_start()
        self.fire("on_train_epoch_start")
        self.recorder.sink = self.metrics.recent
        self._wrapped.train()
        return start

    def _train_batch(self, batch: Any, batch_idx: int) -> bool | None:
        """One forward and backward; at an accumulation boundary, the optimizer step. True if it stepped; None
        when the module's ``on_train_batch_start`` returned -1 (Lightning's: skip the rest of the epoch)."""
        loop, loader, k = self.loop, self.train_loader, self.config.accumulate_grad_batches
        assert loader is not None
        # last: of this epoch's pass, where a short accumulation steps (a stream's loader draws a batch ahead to
        # know; a batch sampler's count may change)
        loop.start_batch(batch_idx, *loader.batch_sizes(batch_idx), k, k > 1 and loader.last_batch)
        if self._hooks.runs(0) and self.fire("on_train_batch_start", batch, batch_idx) == -1:
            loop.check_skip(batch_idx, self.runtime.replication.fault_tolerant)
            return None
        if loop.at_step_boundary:
            outputs = self._forward_backward(batch, batch_idx)
        else:  # an accumulation micro-step: the gradients stay on this rank
            with self._runtime.no_sync(self._wrapped):  # type: ignore[union-attr]
                outputs = self._forward_backward(batch, batch_idx)
        samples = loop.end_batch(batch_idx)
        if samples is not None and not self._step_taken(samples):
            return False  # fault tolerance: a replica group died during the step; its batches come again
        if self._hooks.runs(2):  # also a callback added during this batch
            with self.metrics.after_commit(loop.at_step_boundary):  # fault tolerance: a committed step's values
                self.fire("on_train_batch_end", outputs, batch, batch_idx)
            if loop.log_due:  # a logging step: its row, with what the hooks logged (as Lightning writes it)
                self._write_log(self.metrics.window_values(self._runtime))
        return loop.at_step_boundary

    def _step_taken(self, samples: int) -> bool:
        """The optimizer step at the end of an accumulation, then its counters and the logging step's values;
        False when it was not committed (fault tolerance)."""
        committed = self._call("optimizer_step", self._step_optimizers)
        if self.metrics.commits:  # fault tolerance: the step's values count once it commits
            self.metrics.end_step(committed)
        if not committed:
            return False
        self.loop.stepped(samples)
        self.profiler.step()
        if self.is_logging_step:
            values = self.metrics.window_values(self._runtime)
            if self._hooks.logs_at_batch_end():  # the same on every rank: the row waits for what they log
                self.callback_metrics.update(values)  # what the hooks at the batch's end read
                self.loop.log_due = True
            else:
                self._write_log(values)
        return True

    def _write_log(self, values: dict[str, float]) -> None:
        """A logging step's row, then ``on_train_log``; the logging window starts again. A checkpoint written
        before (a save at the batch's end) records the row as due: the resumed fit writes it first."""
        self.metrics.window.reset()
        self.loop.log_due = False
        self.log_metrics(values)
        self.fire("on_train_log")

    def _step_optimizers(self) -> bool:
        """The optimizers' step, then the schedulers'; False when it was not committed (fault tolerance:
        taken nowhere, its batches come again)."""
        rt, clip = self._runtime, self.config.gradient_clip_val
        assert rt is not None
        if clip:  # the total norm of every optimizer's gradients, each unscaled first (16-mixed); 0: none (Lightning's)
            rt.clip_grad_norm_(self._wrapped, self.optimizers, clip)
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if not rt.step_committed:
            return False
        if self.lr_schedulers:  # the step, once taken; those that reduce on a plateau wait for its values
            self.lr_schedulers.step("step", self.global_step + 1, self.callback_metrics, on_plateau=False)
            self.loop.step_plateau_due = self.lr_schedulers.due("step", self.global_step + 1, on_plateau=True)
        return True

    def _after_step(self) -> bool:
        """After an optimizer step: preemption, mid-epoch validation; True when training is over."""
        rt = self._runtime
        assert rt is not None
        if rt.should_stop():
            ckpt.stop_preempted(self)
        if rt.should_checkpoint():  # a node of the job will be reclaimed: the engine restarts from here
            path = ckpt.preemption_checkpoint(self)
            rt.print(f"lockstep: a node of this job will be reclaimed; checkpoint {path} at step "
                     f"{self.global_step}; training goes on until the node goes.")
        interval = self.config.val_check_interval  # Evaluation.due_after, inline on this per-step path
        if interval and self.global_step % interval == 0 and self._val_loader is not None:
            self.evaluation.during_fit()
        if self.loop.step_plateau_due:  # as in Lightning: after the step's validation, with this step's values
            self._step_plateau_schedulers()
        return self.loop.finished(self.config.max_epochs, self.config.max_steps)

    def _step_plateau_schedulers(self) -> None:
        """The plateau schedulers due at this step (a checkpoint written before, at the batch's end or its
        validation's, keeps them due: the resumed fit takes them); between two logging steps, with the values
        logged since the last one (``TrainingMetrics.newest``)."""
        self.callback_metrics.update(self.metrics.newest(self.runtime, reduce=not self.is_logging_step))
        self.lr_schedulers.step("step", self.global_step, self.callback_metrics, on_plateau=True)
        self.loop.step_plateau_due = False

    def _end_epoch(self) -> None:
        # a checkpoint from here on resumes at the next epoch's start, first stepping the plateau schedulers if due
        self.epoch_ended = self.loop.plateau_due = True
        self.lr_schedulers.step("epoch", self.current_epoch + 1, self.callback_metrics, on_plateau=False)
        # the names logged on steps alone hold their newest values (since the last logging step), for the monitors
        self.callback_metrics.update(self.metrics.newest(self.runtime, reduce=not self.is_logging_step))
        epoch_values = self.metrics.epoch.reduce(self.runtime)
        self.log_metrics({f"{name}_epoch": value for name, value in epoch_values.items()})
        # The names logged in training_step hold the epoch's value once it ends (as in Lightning), also
        # when the epoch was shorter than log_every_n_steps and no step value was logged.
        self.callback_metrics.update(epoch_values)
        self.metrics.epoch.reset()
        self.recorder.sink = None  # reduced: until the next epoch starts, nothing could record a value
        if self._val_loader is not None and not self.config.val_check_interval:
            self.evaluation.during_fit()
        # those that reduce on a plateau step with the epoch's values, before a checkpoint at its end is written
        self.lr_schedulers.step("epoch", self.current_epoch + 1, self.callback_metrics, on_plateau=True)
        self.loop.plateau_due = False
        self.fire("on_train_epoch_end")
        self.loop.end_epoch()

    # -- callbacks and reports ---------------------------------------------------------------------
    def _call(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Run a hook (or a step of the loop) ``fn``: the runtime told where this rank is (for hang
        reports), the profiler timing it."""
        self._runtime.mark(name)  # type: ignore[union-attr]  # hooks run once the Runtime exists
        run = self._run_hook
        return fn(*args) if run is None else run(name, fn, *args)

    def fire(self, hook: str, *args: Any) -> Any:
        """Call ``hook`` on the module and the callbacks that define it (``HookTable``: found once). Returns
        what the module's own hook returned (None without one)."""
        module, defined, returned = self._module, self._hooks.defining(hook), None
        for name, method in defined:
            result = self._call(name, method, self, module, *args)
            if method is defined[0][1] and name == f"{type(module).__name__}.{hook}":  # the module's: it comes first
                returned = result
        return returned

    def _finish_reports(self) -> None:
        text = self.profiler.report(self.log_dir, self.runtime.rank)
        if text:
            self.runtime.print(f"profiler report ({getattr(self.profiler, 'name', type(self.profiler).__name__)}), "
                              f"rank 0:\n{text}")
        for logger in self.loggers:
            logger.finalize()


def _with_default_callbacks(callbacks: Sequence[Callback], checkpoints: bool, throughput: bool,
                            progress: bool) -> list[Callback]:
    """The given callbacks, then lockstep's defaults, then the checkpoint callbacks (as Lightning orders them):
    a checkpoint written in a hook holds what every other callback did in it (EarlyStopping's judgement). A
    checkpoint_dir means checkpoints: unless a ModelCheckpoint is given, the default one writes one per epoch
    and keeps the newest, plus last.ckpt."""
    given = [c for c in callbacks if isinstance(c, ModelCheckpoint)]
    savers = given or ([ModelCheckpoint()] if checkpoints else [])
    return [*(c for c in callbacks if not isinstance(c, ModelCheckpoint)),
            *([ThroughputMonitor()] if throughput else []), *([ProgressBar()] if progress else []), *savers]
