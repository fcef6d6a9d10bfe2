"""The Trainer's evaluation passes: validation during a fit, ``validate``, ``test`` and ``predict``. Each runs
over an evaluation loader (every sample once, on one rank, in dataset order), with every rank on rank 0's
buffers (BatchNorm statistics), and reduces its metric sums once, after the pass (the ranks may hold
different numbers of batches)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lockstep.errors import ConfigError, UsageError
from lockstep.runtime import DistributedLoader
from lockstep.train.callbacks import ModelCheckpoint
from lockstep.train.loggers import make_loggers
from lockstep.train.metrics import MetricStore

if TYPE_CHECKING:
    from lockstep.train.module import Module
    from lockstep.train.trainer import Trainer


class Evaluation:
    """One Trainer's evaluation passes (``trainer.evaluation``)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer
        self.seconds_in_fit = 0.0  # the wall time of the fits' validations, their hooks' saves included

    def loader(self, data: Any, batch_size: int | None, options: dict[str, Any], stage: str) -> DistributedLoader:
        """``rt.eval_loader`` for ``stage``, refusing data that holds no samples before any step."""
        loader = self.trainer.runtime.eval_loader(data, batch_size=batch_size, **options)
        check_not_empty(loader, stage, None)
        return loader

    def once(self, module: Module, data: Any, batch_size: int | None, step: str,
             loader_options: dict[str, Any] | None, ckpt_path: str | Path | None = None) -> dict[str, float]:
        """``validate`` or ``test``: one pass of ``step`` over ``data``; its metrics."""
        t = self.trainer
        t._start(module, with_optimizers=False)
        self._load_weights(ckpt_path)
        if not hasattr(module, step):
            raise UsageError(f"{type(module).__name__} has no {step}(batch, batch_idx): define it.")
        loader = self.loader(data, batch_size, t._loader_options(loader_options), step.removesuffix("_step"))
        # before any fit (not one that resumes: a logger made now would start its files anew, losing the run's)
        if not t.loggers and t.config.resume is None and t.runtime.is_global_zero:
            t.loggers = make_loggers(t._logger_specs, t.log_dir)
        metrics = self.run(loader, step)
        for logger in t.loggers:
            logger.finalize()
        return metrics

    def after_resume(self) -> None:
        """A fit resumed from a checkpoint written at a step that a validation follows (``val_check_interval``),
        before that validation ran (a preemption's checkpoint, a callback's save at the batch's end): it runs
        now, as it did in the uninterrupted fit, before the next step."""
        t = self.trainer
        step = t.global_step
        if step > 0 and self.due_after(step) and t.loop.validated_at != step:
            self.during_fit()

    @property
    def inside_epochs(self) -> bool:
        """The fit validates every ``val_check_interval`` optimizer steps (not at the epochs' ends)."""
        return self.trainer.validates and bool(self.trainer.config.val_check_interval)

    def due_after(self, step: int) -> bool:
        """A validation inside the epochs follows optimizer step ``step``."""
        return self.inside_epochs and step % (self.trainer.config.val_check_interval or 1) == 0

    def at_fit_end(self) -> None:
        """Whatever ended the fit, its final step is validated (unless it just was). That validation was due to no
        schedule: the loop keeps what came before it (``LoopState.fit_end``), where a fit resumed from the final
        checkpoint continues, as one longer fit would have (EarlyStopping leaves it out)."""
        t = self.trainer
        if t.validates and t.loop.validated_at != t.global_step:
            t.loop.fit_end = {"metrics": dict(t.callback_metrics), "validated_at": t.loop.validated_at}
            self.during_fit()

    def during_fit(self) -> None:
        """Validation inside a fit: the training stage's metric sums are kept for after it."""
        t, started = self.trainer, time.perf_counter()
        assert t._val_loader is not None
        sink = t.recorder.sink
        self.run(t._val_loader, "validation_step")
        t.loop.validated_at = t.global_step
        t.fire("on_validation_epoch_end")
        t.fire("on_validation_end")
        t.recorder.sink = sink
        t._wrapped.train()
        self.seconds_in_fit += time.perf_counter() - started

    def run(self, loader: DistributedLoader, step: str) -> dict[str, float]:
        """One pass of ``step``; its metrics, reduced over the ranks and logged."""
        t = self.trainer
        store = MetricStore()
        t.recorder.sink = store
        t.runtime.sync_buffers(t._wrapped)  # every rank evaluates with rank 0's BatchNorm statistics
        t._wrapped.eval()
        batch_idx = -1
        with torch.no_grad():
            for batch_idx, batch in enumerate(loader):
                t.loop.batch_samples = loader.local_batch_size(batch_idx)
                t._call(step, self.step, step, batch, batch_idx)
        check_not_empty(loader, step.removesuffix("_step"), batch_idx >= 0)
        metrics = store.reduce(t.runtime)  # once, after the loop: ranks may hold different batch counts
        t.recorder.sink = None
        t.log_metrics(metrics)
        return metrics

    def predict(self, module: Module, data: Any, batch_size: int | None,
                loader_options: dict[str, Any] | None, ckpt_path: str | Path | None = None) -> Any:
        """``predict_step`` outputs of every sample, in dataset order, on every rank."""
        t = self.trainer
        rt = t._start(module, with_optimizers=False)
        self._load_weights(ckpt_path)
        loader = self.loader(data, batch_size, t._loader_options(loader_options), "predict")
        t.recorder.sink = None
        rt.sync_buffers(t._wrapped)  # every rank predicts with rank 0's BatchNorm statistics
        t._wrapped.eval()
        with torch.no_grad():
            outputs = [self.step("predict_step", batch, i) for i, batch in enumerate(loader)]
        check_not_empty(loader, "predict", bool(outputs))
        return rt.gather(outputs, loader=loader)

    def _load_weights(self, ckpt_path: str | Path | None) -> None:
        """The module's weights from ``ckpt_path`` (Lightning's spelling): ``"best"``, ``"last"`` or a folder."""
        if ckpt_path is None:
            return
        t = self.trainer
        rt = t.runtime
        if str(ckpt_path) == "best":
            best = next((c.best_model_path for c in t.callbacks if isinstance(c, ModelCheckpoint) and
                         c.best_model_path), None)
            if best is None:
                raise UsageError('ckpt_path="best": no ModelCheckpoint of this Trainer has saved a checkpoint yet '
                                 "(fit first, with checkpoint_dir or a ModelCheckpoint), or give a checkpoint's path.")
            found = rt.latest_checkpoint(best, exact=True)
        elif str(ckpt_path) == "last":
            if t.checkpoint_dir is None:
                raise UsageError('ckpt_path="last" needs the Trainer\'s checkpoint_dir, where it looks for the newest.')
            found = rt.latest_checkpoint(t.checkpoint_dir)
            if found is None:
                raise UsageError(f'ckpt_path="last": {t.checkpoint_dir} holds no intact checkpoint.')
        else:
            found = rt.latest_checkpoint(ckpt_path, exact=True)
        assert found is not None, "exact=True finds the folder or raises"
        rt.load(found, {"model": t.module}, verify=False)
        rt.print(f"lockstep: weights from {found.path} (step {found.step}).")

    def step(self, step: str, batch: Any, batch_idx: int) -> Any:
        """``validation_step``, ``test_step`` or ``predict_step`` (under ``torch.no_grad``). On pipeline stages the
        module's step runs as it is, and its calls of the module itself (``self(inputs)``) run the input through
        every stage in turn: every rank of the pipeline gets the model's output (docs/parallelism.md)."""
        t = self.trainer
        if t.runtime.pipeline_parallel_size == 1:
            return t._wrapped(step, batch, batch_idx)
        with t.module._calls_through(t._wrapped):
            return getattr(t.module, step)(batch, batch_idx)


def check_not_empty(loader: DistributedLoader, stage: str, yielded: bool | None) -> None:
    """Evaluating over no samples is a mistake (an empty split, a filter that kept nothing), refused
    as empty training data is: before any step where the data has a length, else (a stream
    without ``__len__``) once a pass yielded no batch, which happens on every rank at once."""
    try:
        empty = len(loader.dataset) == 0
    except TypeError:  # a stream without __len__: known once read
        empty = yielded is False
    if empty:
        raise ConfigError(f"the {stage} data ({type(loader.dataset).__name__}) holds no samples: {stage} would "
                          "cover nothing. Check the dataset's path, filter or split, or pass no data.")
