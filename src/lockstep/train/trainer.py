"""``lockstep.Trainer``: fit / validate / test / predict, built only on the runtime's public API."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from lockstep.runtime import Runtime, seed_everything
from lockstep.train import checkpoint as ckpt
from lockstep.train.callbacks import Callback
from lockstep.train.loggers import Logger, make_loggers
from lockstep.train.metrics import MetricStore, batch_size_of, weighted_value
from lockstep.train.module import Module, StepRouter
from lockstep.train.profilers import PyTorchProfiler, make_profiler
from lockstep.train.progress import ProgressBar, ThroughputMonitor


class Trainer:
    """Runs a ``lockstep.Module`` on every rank with the runtime's exact data, precision and collectives.

    ``devices``, ``num_nodes``, ``accelerator``, ``strategy``, ``precision``, ``seed``, ``deterministic``
    and ``timeout`` go to ``lockstep.Runtime``. ``batch_size`` (in ``fit`` etc.) is the global batch.
    Stop after ``max_epochs`` epochs or ``max_steps`` optimizer steps, whichever comes first.
    Creating the Trainer seeds every random generator with ``seed``: build the module after it.
    """

    def __init__(
        self, *, max_epochs: int | None = None, max_steps: int | None = None, devices: Any = "auto",
        num_nodes: int | None = None, accelerator: str | None = None, strategy: Any = None, precision: Any = None,
        accumulate_grad_batches: int = 1, gradient_clip_val: float | None = None,
        val_check_interval: int | None = None, log_every_n_steps: int = 50, seed: int = 0,
        deterministic: bool = False, checkpoint_dir: str | Path | None = None, resume: str | Path | None = None,
        callbacks: Sequence[Callback] = (), loggers: Sequence[Any] = ("csv",), log_dir: str | Path | None = None,
        profiler: Any = None, enable_progress_bar: bool = True, enable_throughput_monitor: bool = True,
        num_workers: int | None = None, timeout: float | None = None,
    ) -> None:
        if max_epochs is None and max_steps is None:
            raise ValueError("give max_epochs or max_steps (or both): the Trainer needs to know when to stop.")
        for name, value in (("accumulate_grad_batches", accumulate_grad_batches),
                            ("log_every_n_steps", log_every_n_steps)):
            if value < 1:
                raise ValueError(f"{name}={value}: must be at least 1.")
        if resume is not None and str(resume) == "auto" and checkpoint_dir is None:
            raise ValueError("resume='auto' looks in checkpoint_dir: give checkpoint_dir=... too.")
        self.max_epochs, self.max_steps = max_epochs, max_steps
        self.accumulate_grad_batches, self.gradient_clip_val = accumulate_grad_batches, gradient_clip_val
        self.val_check_interval, self.log_every_n_steps = val_check_interval, log_every_n_steps
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.resume = resume
        self.log_dir = Path(log_dir) if log_dir is not None else (self.checkpoint_dir or Path("runs/lockstep"))
        self.num_workers, self.num_nodes = num_workers, num_nodes
        seed_everything(seed)  # now, so that a module built after the Trainer starts from repeatable weights
        self._runtime_args = dict(accelerator=accelerator, devices=devices, strategy=strategy,
                                  precision=precision, seed=seed, deterministic=deterministic, timeout=timeout)
        self.config = {"max_epochs": max_epochs, "max_steps": max_steps, "devices": devices, "num_nodes": num_nodes,
                       "accelerator": accelerator, "strategy": strategy, "precision": precision,
                       "accumulate_grad_batches": accumulate_grad_batches, "gradient_clip_val": gradient_clip_val,
                       "log_every_n_steps": log_every_n_steps, "seed": seed}
        self.callbacks: list[Callback] = list(callbacks)
        if enable_throughput_monitor:
            self.callbacks.append(ThroughputMonitor())
        if enable_progress_bar:
            self.callbacks.append(ProgressBar())
        self._logger_specs, self.profiler = list(loggers), make_profiler(profiler)
        self._runtime: Runtime | None = None
        self._loggers: list[Logger] = []
        self.callback_metrics: dict[str, float] = {}
        self.progress_bar_metrics: set[str] = {"train_loss"}
        self.current_epoch = self.global_step = self.batches_done_in_epoch = self.samples_seen = 0
        self.steps_per_epoch, self.data_wait_s = 0, 0.0
        self.should_stop, self.at_step_boundary = False, False
        self.optimizers: list[torch.optim.Optimizer] = []
        self._schedulers: list[tuple[Any, str]] = []
        self._module: Module | None = None
        self._wrapped: Any = None
        self._loader: Any = None
        self._val_loader: Any = None
        self._resume_batches = 0
        self._stores: list[MetricStore] = []  # where self.log goes in the current stage
        self._epoch_store, self._window_store = MetricStore(), MetricStore()
        self._batch: Any = None

    # -- the runtime and where this rank sits ------------------------------------------------------
    @property
    def runtime(self) -> Runtime:
        """The Runtime, created on first use (this joins the process group, or self-launches)."""
        if self._runtime is None:
            self._runtime = Runtime(**self._runtime_args)
            if self.num_nodes is not None and self._runtime.num_nodes != self.num_nodes:
                raise ValueError(f"Trainer(num_nodes={self.num_nodes}) but the launcher started "
                                 f"{self._runtime.num_nodes} node(s): make them agree.")
        return self._runtime

    @property
    def is_global_zero(self) -> bool:
        return self.runtime.is_global_zero

    @property
    def is_logging_step(self) -> bool:
        return self.global_step % self.log_every_n_steps == 0

    # -- public entry points ------------------------------------------------------------------------
    def fit(self, module: Module, train_data: Any, val_data: Any = None, batch_size: int | None = None,
            val_batch_size: int | None = None) -> Trainer:
        """Train ``module`` on ``train_data`` (a dataset or DataLoader), validating on ``val_data``."""
        rt = self.runtime
        self._setup(module, with_optimizers=True)
        self._loader = rt.loader(train_data, batch_size=batch_size, shuffle=True, **self._loader_options())
        self.steps_per_epoch = len(self._loader)
        if val_data is not None:
            self._val_loader = rt.eval_loader(val_data, batch_size=val_batch_size or batch_size,
                                              **self._loader_options())
        if rt.is_global_zero:
            self._loggers = make_loggers(self._logger_specs, self.log_dir)
            for logger in self._loggers:
                logger.log_hyperparams({**self.config, **dict(getattr(module, "hparams", {}) or {})})
        self._restore()
        if isinstance(self.profiler, PyTorchProfiler):
            self.profiler.start(self.log_dir, rt.rank)
        try:
            self._fire("on_fit_start")
            self._fire("on_train_start")
            while not self._finished():
                self._train_epoch()
            self._fire("on_train_end")
            self._fire("on_fit_end")
        except BaseException as error:
            for callback in self.callbacks:
                callback.on_exception(self, module, error)
            raise
        finally:
            self._finish_reports()
        return self

    def validate(self, module: Module, data: Any, batch_size: int | None = None) -> dict[str, float]:
        """Run ``validation_step`` over ``data`` once; metrics are exact over the whole dataset."""
        return self._evaluate_once(module, data, batch_size, "validation_step")

    def test(self, module: Module, data: Any, batch_size: int | None = None) -> dict[str, float]:
        """Run ``test_step`` over ``data`` once; metrics are exact over the whole dataset."""
        return self._evaluate_once(module, data, batch_size, "test_step")

    def predict(self, module: Module, data: Any, batch_size: int | None = None) -> Any:
        """``predict_step`` outputs of every sample, in dataset order, on every rank (one row per sample)."""
        if self._module is not module:
            self._setup(module, with_optimizers=False)
        loader = self.runtime.eval_loader(data, batch_size=batch_size, **self._loader_options())
        self._wrapped.eval()
        with torch.no_grad():
            outputs = [self._wrapped("predict_step", batch, i) for i, batch in enumerate(loader)]
        return self.runtime.gather(outputs)

    def log_metrics(self, metrics: dict[str, float]) -> None:
        """Record already-reduced values (identical on every rank); rank 0's loggers write them."""
        self.callback_metrics.update(metrics)
        for logger in self._loggers:
            logger.log_metrics(metrics, self.global_step)

    def save_checkpoint(self, path: str | Path) -> None:
        """Every rank calls it; rank 0 writes ``path`` atomically. Holds all that resuming needs."""
        rt, module = self.runtime, self._require_module()
        state: dict[str, Any] = {
            "module": module.state_dict(),
            "optimizers": [o.state_dict() for o in self.optimizers],
            "schedulers": [s.state_dict() for s, _ in self._schedulers],
            "precision": rt.precision.state_dict(),
            "loop": {"epoch": self.current_epoch, "global_step": self.global_step,
                     "batches_done_in_epoch": self.batches_done_in_epoch, "samples_seen": self.samples_seen},
            "loader": self._loader.state_dict() if self._loader is not None else {},
            "rng": rt.all_gather(ckpt.capture_rng()),
            "epoch_metrics": rt.all_gather(self._epoch_store.state_dict()),
            "window_metrics": rt.all_gather(self._window_store.state_dict()),
            "world_size": rt.world_size,
            "config": {k: str(v) for k, v in self.config.items()},
            "callbacks": {f"{type(c).__name__}-{i}": c.state_dict() for i, c in enumerate(self.callbacks)},
        }
        self._fire("on_save_checkpoint", state)
        if rt.is_global_zero:
            ckpt.save_atomic(state, Path(path))
        rt.barrier()

    # -- set-up and resume --------------------------------------------------------------------------
    def _loader_options(self) -> dict[str, Any]:
        return {} if self.num_workers is None else {"num_workers": self.num_workers}

    def _require_module(self) -> Module:
        if self._module is None:
            raise RuntimeError("no module is set up: call fit, validate, test or predict first.")
        return self._module

    def _setup(self, module: Module, with_optimizers: bool) -> None:
        if not isinstance(module, Module):
            raise TypeError(f"the Trainer runs a lockstep.Module; got {type(module).__name__}: subclass "
                            "lockstep.Module and write training_step / configure_optimizers.")
        module.__dict__["_trainer"] = self
        self._module = module
        self.optimizers, self._schedulers = _configure_optimizers(module) if with_optimizers else ([], [])
        self._wrapped = self.runtime.setup(StepRouter(module), *self.optimizers)
        if self.optimizers:
            self._wrapped = self._wrapped[0]

    def _restore(self) -> None:
        if self.resume is None:
            return
        rt, module = self.runtime, self._require_module()
        found = self._find_checkpoint()
        if found is None:
            rt.print(f"lockstep: no checkpoint in {self.checkpoint_dir}; starting from scratch.")
            return
        path, state = found
        ckpt.load_module_state(module, state["module"], path)
        for optimizer, saved in zip(self.optimizers, state["optimizers"], strict=True):
            optimizer.load_state_dict(saved)
        for (scheduler, _), saved in zip(self._schedulers, state["schedulers"], strict=True):
            scheduler.load_state_dict(saved)
        rt.precision.load_state_dict(state["precision"])
        loop = state["loop"]
        self.current_epoch, self.global_step = int(loop["epoch"]), int(loop["global_step"])
        self.samples_seen, self._resume_batches = int(loop["samples_seen"]), int(loop["batches_done_in_epoch"])
        if self._resume_batches >= self.steps_per_epoch:
            self.current_epoch, self._resume_batches = self.current_epoch + 1, 0
        # The metric sums of the interrupted epoch and logging window, every rank's, go to rank 0:
        # the next reduce adds them up anyway, so the first values logged after resuming are exact.
        for store, key in ((self._epoch_store, "epoch_metrics"), (self._window_store, "window_metrics")):
            store.reset()
            if rt.is_global_zero and self._resume_batches:
                store.merge(state.get(key, []), rt.device)
        for i, callback in enumerate(self.callbacks):
            callback.load_state_dict(state["callbacks"].get(f"{type(callback).__name__}-{i}", {}))
        self._fire("on_load_checkpoint", state)
        if len(state["rng"]) == rt.world_size:
            ckpt.restore_rng(state["rng"][rt.rank])  # last: nothing may draw random numbers after it
        else:
            rt.print(f"lockstep: the checkpoint comes from {len(state['rng'])} processes, this run has "
                     f"{rt.world_size}: random states are not restored (the sample order still is).")
        rt.print(f"lockstep: resumed from {path} at epoch {self.current_epoch}, step {self.global_step}.")

    def _find_checkpoint(self) -> tuple[Path, dict[str, Any]] | None:
        """The checkpoint to resume from, the same on every rank, or an error that says why not.

        Each rank reads it from its own file system: one that the nodes do not share would
        otherwise resume rank 0 alone and train the others from scratch.
        """
        rt, resume, found, problem = self.runtime, self.resume, None, ""
        assert resume is not None
        try:
            if str(resume) == "auto":
                assert self.checkpoint_dir is not None
                found = ckpt.newest_valid(self.checkpoint_dir)
            else:
                found = Path(resume), ckpt.load(resume)
        except ckpt.CheckpointError as error:
            problem = str(error)
        mine = problem or (f"{found[0].name} (step {found[1]['loop']['global_step']})" if found else "none")
        seen = rt.all_gather((socket.gethostname(), mine))
        if len({what for _, what in seen}) > 1 or problem:
            lines = [f"  rank {r} on {host}: {what}" for r, (host, what) in enumerate(seen)]
            raise ckpt.CheckpointError(
                "the ranks cannot resume from the same checkpoint:\n" + "\n".join(lines) + "\n"
                "Rank 0 writes the checkpoints: put checkpoint_dir (or the resume path) on a file system "
                "that every node shares, or copy the file to every node."
            )
        return found

    # -- the loops ---------------------------------------------------------------------------------
    def _finished(self) -> bool:
        return (self.should_stop or (self.max_steps is not None and self.global_step >= self.max_steps)
                or (self.max_epochs is not None and self.current_epoch >= self.max_epochs))

    def _train_epoch(self) -> None:
        rt, loader, k = self.runtime, self._loader, self.accumulate_grad_batches
        start, self._resume_batches = self._resume_batches, 0
        loader.load_state_dict({"epoch": self.current_epoch, "batches_done": start})
        self.batches_done_in_epoch = start
        window, epoch_store = self._window_store, self._epoch_store
        if start == 0:  # a resumed epoch keeps the sums restored from the checkpoint
            window.reset()
            epoch_store.reset()
        self._stores = [window, epoch_store]
        self._fire("on_train_epoch_start")
        self._wrapped.train()
        batches = iter(loader)
        batch_idx = start
        while True:
            waited = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                break
            self.data_wait_s += time.perf_counter() - waited
            self._batch = batch
            self._fire("on_train_batch_start", batch, batch_idx)
            self.at_step_boundary = (batch_idx + 1) % k == 0 or batch_idx + 1 == self.steps_per_epoch
            with rt.no_sync(self._wrapped, enabled=not self.at_step_boundary):
                with self._hook("training_step"):
                    outputs = self._wrapped("training_step", batch, batch_idx)
                loss = _loss_of(outputs)
                self._log_metric("train_loss", loss.detach(), prog_bar=True)
                with self._hook("backward"):
                    rt.backward(loss / k if k > 1 else loss)
            self.samples_seen += loader.sampler.global_size(batch_idx)
            if self.at_step_boundary:
                self._optimizer_step()
                if self.is_logging_step:
                    self.log_metrics(window.reduce(rt))
                    window.reset()
            self.batches_done_in_epoch = batch_idx + 1
            self._fire("on_train_batch_end", outputs, batch, batch_idx)
            batch_idx += 1
            if self.at_step_boundary and rt.should_stop():
                self._preempted()
            if self.at_step_boundary and self.val_check_interval and self.global_step % self.val_check_interval == 0:
                self._validate_during_fit()
            if self.at_step_boundary and self._finished():
                break
        if self.batches_done_in_epoch < self.steps_per_epoch:
            return  # stopped mid-epoch (max_steps or should_stop)
        for scheduler, interval in self._schedulers:
            if interval == "epoch":
                scheduler.step()
        self.log_metrics({f"{name}_epoch": value for name, value in epoch_store.reduce(rt).items()})
        epoch_store.reset()
        if self._val_loader is not None and not self.val_check_interval:
            self._validate_during_fit()
        self._fire("on_train_epoch_end")
        self.current_epoch += 1

    def _preempted(self) -> None:
        """A preemption signal reached some rank: checkpoint at this step on every rank, requeue, exit."""
        rt = self.runtime
        folder = self.checkpoint_dir or self.log_dir
        path = folder / f"epoch={self.current_epoch}-step={self.global_step:08d}-preempted.ckpt"
        self.save_checkpoint(path)
        outcome = rt.requeue()
        rt.print(f"lockstep: preempted at step {self.global_step}; checkpoint {path}; {outcome}.")
        rt.close()  # fit's `finally` writes the reports
        raise SystemExit(0)

    def _optimizer_step(self) -> None:
        with self._hook("optimizer_step"):
            for optimizer in self.optimizers:
                if self.gradient_clip_val is not None:
                    self.runtime.clip_grad_norm_(self._wrapped, optimizer, self.gradient_clip_val)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            for scheduler, interval in self._schedulers:
                if interval == "step":
                    scheduler.step()
        self.global_step += 1
        self.profiler.step()

    def _validate_during_fit(self) -> None:
        stores = self._stores
        self._run_eval(self._val_loader, "validation_step")
        self._fire("on_validation_epoch_end")
        self._stores = stores
        self._wrapped.train()

    def _run_eval(self, loader: Iterable[Any], step: str) -> dict[str, float]:
        store = MetricStore()
        self._stores = [store]
        self._wrapped.eval()
        with torch.no_grad():
            for batch_idx, batch in enumerate(loader):
                self._batch = batch
                with self._hook(step):
                    self._wrapped(step, batch, batch_idx)
        metrics = store.reduce(self.runtime)  # once, after the loop: ranks may hold different batch counts
        self.log_metrics(metrics)
        return metrics

    def _evaluate_once(self, module: Module, data: Any, batch_size: int | None, step: str) -> dict[str, float]:
        if self._module is not module:
            self._setup(module, with_optimizers=False)
        if not hasattr(module, step):
            raise AttributeError(f"{type(module).__name__} has no {step}(batch, batch_idx): define it.")
        loader = self.runtime.eval_loader(data, batch_size=batch_size, **self._loader_options())
        return self._run_eval(loader, step)

    # -- metrics, callbacks, reports ---------------------------------------------------------------
    def _log_metric(self, name: str, value: Any, prog_bar: bool = False, batch_size: int | None = None) -> None:
        weight = batch_size if batch_size is not None else batch_size_of(self._batch)
        weighted = weighted_value(name, value, weight, self.runtime.device)
        for store in self._stores:
            store.add(name, weighted, weight)
        if prog_bar:
            self.progress_bar_metrics.add(name)

    def _hook(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Around a hook: tell the runtime where this rank is (for hang reports), and profile it."""
        self.runtime.mark(name)
        return self.profiler.profile(name)

    def _fire(self, hook: str, *args: Any) -> None:
        """Call ``hook`` on the callbacks that define it (a per-step call costs nothing otherwise)."""
        module = self._module
        for callback in self.callbacks:
            if getattr(type(callback), hook) is getattr(Callback, hook):
                continue
            method: Callable[..., None] = getattr(callback, hook)
            with self._hook(f"{type(callback).__name__}.{hook}"):
                method(self, module, *args)

    def _finish_reports(self) -> None:
        text = self.profiler.report(self.log_dir, self.runtime.rank)
        if text:
            self.runtime.print(f"profiler report ({self.profiler.name}), rank 0:\n{text}")
        for logger in self._loggers:
            logger.finalize()


def _loss_of(outputs: Any) -> torch.Tensor:
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if not isinstance(loss, torch.Tensor):
        raise TypeError("training_step must return the loss tensor or a dict holding 'loss'; "
                        f"got {type(outputs).__name__}.")
    return loss


def _configure_optimizers(module: Module) -> tuple[list[torch.optim.Optimizer], list[tuple[Any, str]]]:
    if not hasattr(module, "configure_optimizers"):
        raise AttributeError(f"{type(module).__name__} has no configure_optimizers(): define it to return an "
                             "optimizer (or a dict with 'optimizer' and 'lr_scheduler').")
    result = getattr(module, "configure_optimizers")()  # noqa: B009 - user-defined, not on nn.Module
    if isinstance(result, torch.optim.Optimizer):
        return [result], []
    if isinstance(result, dict):
        optimizers, schedulers = [result["optimizer"]], [result["lr_scheduler"]] if "lr_scheduler" in result else []
    elif isinstance(result, (list, tuple)) and len(result) == 2 and isinstance(result[0], (list, tuple)):
        optimizers, schedulers = list(result[0]), list(result[1])
    else:
        raise TypeError("configure_optimizers() must return an optimizer, a dict {'optimizer', 'lr_scheduler'} "
                        f"or ([optimizers], [schedulers]); got {type(result).__name__}.")
    parsed = []
    for scheduler in schedulers:
        if isinstance(scheduler, dict):
            interval = scheduler.get("interval", "epoch")
            if interval not in ("step", "epoch"):
                raise ValueError(f"lr_scheduler interval {interval!r}: use 'step' or 'epoch'.")
            parsed.append((scheduler["scheduler"], interval))
        else:
            parsed.append((scheduler, "epoch"))
    return optimizers, parsed
