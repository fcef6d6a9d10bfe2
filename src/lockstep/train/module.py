"""``lockstep.Module``: a ``torch.nn.Module`` with step methods and ``self.log``, driven by the Trainer."""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from lockstep.errors import StateError, UsageError
from lockstep.train.schedulers import Schedules
from lockstep.train.schedulers import read as schedulers_read

if TYPE_CHECKING:
    from lockstep.runtime import Runtime
    from lockstep.train.trainer import Trainer


#: Where ``Module._calls_through`` keeps the model that ``self(...)`` calls instead (not a submodule).
_THROUGH = "_lockstep_pipeline"


class MetricSink(Protocol):
    """Where ``Module.log`` sends a metric (the Trainer, while it runs the module)."""

    def record_metric(self, name: str, value: float | torch.Tensor, *, prog_bar: bool = False,
                      batch_size: int | torch.Tensor | None = None, on_step: bool | None = None,
                      on_epoch: bool | None = None) -> None: ...


class Module(nn.Module):
    """Subclass it and write the steps the Trainer calls (as in a LightningModule):

    - ``training_step(batch, batch_idx)`` returns the loss, or a dict holding ``"loss"`` and
      optionally ``"num_items"``: the number of items (tokens) the loss is a mean over, so that the
      step's gradient is that of the mean over every item of the global batch (``rt.backward``);
    - ``validation_step``, ``test_step`` (log metrics with ``self.log``) and ``predict_step``
      (returns the predictions for the batch; by default ``self(batch)``), each only when you use it;
    - ``configure_optimizers()`` returns an optimizer, a dict ``{"optimizer": ..., "lr_scheduler":
      scheduler or {"scheduler": ..., "interval": "step" | "epoch"}}``, or a pair of lists
      ``([optimizers], [schedulers])``.

    The steps run on every rank, inside the precision's autocast, on this rank's share of the batch.

    On pipeline stages (``pp > 1``) no rank holds the whole model, so training runs ``forward(inputs)``
    cut into stages and ``loss_fn(output, batch)`` (optionally ``num_items(batch)``) instead of
    ``training_step``; the evaluation steps run as they are, and ``self(inputs)`` inside them runs the
    input through every stage (docs/parallelism.md).
    """

    def __init__(self) -> None:
        super().__init__()
        self._trainer_ref: weakref.ref[Trainer] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        through = self.__dict__.pop(_THROUGH, None)  # an evaluation step on pipeline stages
        if through is None:
            return super().__call__(*args, **kwargs)
        try:  # through every stage, whose own call of this module (a stage of one rank is the model) is its forward
            return through(*args, **kwargs)
        finally:
            self.__dict__[_THROUGH] = through

    @contextlib.contextmanager
    def _calls_through(self, model: nn.Module) -> Iterator[None]:
        """Inside the block, ``self(...)`` calls ``model`` (the Trainer's evaluation steps on pipeline stages:
        the model that runs every stage in turn)."""
        self.__dict__[_THROUGH] = model
        try:
            yield
        finally:
            del self.__dict__[_THROUGH]

    def attach(self, trainer: Trainer) -> None:
        """Called by the Trainer that runs this module; ``self.trainer`` and ``self.log`` then reach it.

        The module keeps a weak reference, so copying or saving it never copies the Trainer.
        """
        self._trainer_ref = weakref.ref(trainer)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())
        state["_trainer_ref"] = None  # a weak reference cannot be pickled; the Trainer is not part of the module
        return state

    @property
    def trainer(self) -> Trainer:
        trainer = self._trainer_ref() if self._trainer_ref is not None else None
        if trainer is None:
            raise StateError("this module is not attached to a Trainer: call it from Trainer.fit/validate/...")
        return trainer

    @property
    def device(self) -> torch.device:
        return self.trainer.runtime.device

    def predict_step(self, batch: Any, batch_idx: int | None = None) -> Any:
        """The predictions for ``batch``: by default ``self(batch)``, as Lightning's; override it to predict
        otherwise (unpack the inputs from a batch of ``(inputs, targets)``, say)."""
        if type(self).forward is nn.Module.forward:
            raise UsageError(f"{type(self).__name__} has neither predict_step(batch, batch_idx) nor forward: define "
                             "predict_step to return the batch's predictions (by default it returns self(batch)).")
        return self(batch)

    def log(self, name: str, value: float | torch.Tensor, *, prog_bar: bool = False,
            batch_size: int | torch.Tensor | None = None, on_step: bool | None = None,
            on_epoch: bool | None = None, reduce_fx: Any = "mean", **lightning: Any) -> None:
        """Record a metric for this step; no host sync.

        Values accumulate on the device, weighted by this rank's samples in the batch (counted by
        the loader; ``batch_size`` overrides it, e.g. with a count of tokens, which may be a
        tensor). They are reduced over all ranks every ``log_every_n_steps`` and at the end of
        each epoch, where the value is exact over the whole dataset.

        Lightning's spellings keep their meaning where lockstep has one: in ``training_step``,
        ``on_step=False`` leaves the value out of the logged steps and ``on_epoch=False`` out of the
        epoch's value (``NAME_epoch``; also in a fault-tolerant fit, where a step's values count once it
        commits); ``reduce_fx`` is the mean only (``"mean"``, ``"avg"``, ``torch.mean``). ``sync_dist``,
        ``sync_dist_group``, ``rank_zero_only``, ``logger``, ``enable_graph`` and
        ``add_dataloader_idx`` are taken and change nothing: every value is reduced over all ranks,
        exactly, detached, and goes to every logger (docs/migrating-from-lightning.md).
        """
        unknown = sorted(set(lightning) - _LIGHTNING_LOG_OPTIONS)
        if unknown:
            raise UsageError(f"self.log({name!r}, ...) takes no {', '.join(unknown)}: its options are prog_bar, "
                             "batch_size, on_step, on_epoch (and Lightning's sync_dist, logger, ... which change "
                             "nothing here).")
        if reduce_fx is not torch.mean and str(reduce_fx).lower() not in ("mean", "avg"):
            raise UsageError(f"self.log({name!r}, reduce_fx={reduce_fx!r}): lockstep reduces a metric by its "
                             "sample-weighted mean over the whole dataset only; log the values and reduce them "
                             "yourself, or pass reduce_fx='mean'.")
        if on_step is False and on_epoch is False:
            raise UsageError(f"self.log({name!r}, on_step=False, on_epoch=False) would log nothing: leave one of "
                             "them True (or out).")
        if not isinstance(value, (torch.Tensor, int, float)) and callable(getattr(value, "compute", None)):
            raise UsageError(f"self.log({name!r}, {type(value).__name__}(...)): lockstep logs tensors and numbers, "
                             "each the mean over the batch's samples, weighed and reduced over the whole dataset "
                             "exactly. Log what the metric returns for the batch (self.log(name, metric(preds, "
                             "target))): exact for a mean such as accuracy; for other metrics call metric.compute() "
                             "in an epoch-end hook and pass it to self.trainer.log_metrics.")
        sink: MetricSink = self.trainer
        sink.record_metric(name, value, prog_bar=prog_bar, batch_size=batch_size, on_step=on_step,
                           on_epoch=on_epoch)

    def log_dict(self, metrics: Mapping[str, float | torch.Tensor], **options: Any) -> None:
        """``self.log`` of each entry, with the same options (Lightning's ``log_dict``)."""
        for name, value in metrics.items():
            self.log(name, value, **options)

    def save_hyperparameters(self, *names: str, ignore: str | Sequence[str] = ()) -> None:
        """Keep the arguments of the ``__init__`` that calls it (all, or ``names``) in ``self.hparams``,
        as Lightning does; the Trainer logs them with its own settings at the start of a fit."""
        frame = inspect.currentframe()
        caller = frame.f_back if frame is not None else None
        if caller is None or caller.f_code.co_name != "__init__":
            raise UsageError("save_hyperparameters() keeps the arguments of __init__: call it inside __init__.")
        code = caller.f_code
        arguments = code.co_varnames[1:code.co_argcount + code.co_kwonlyargcount]
        skipped = {ignore} if isinstance(ignore, str) else set(ignore)
        chosen = names or arguments
        missing = [name for name in chosen if name not in arguments]
        if missing:
            raise UsageError(f"save_hyperparameters({', '.join(map(repr, missing))}): __init__ takes no such "
                             "argument.")
        self.hparams.update({name: caller.f_locals[name] for name in chosen if name not in skipped})

    @property
    def hparams(self) -> Hyperparameters:
        """What ``save_hyperparameters`` kept (a dict whose keys read as attributes too, ``self.hparams.lr``;
        empty until it is called)."""
        saved = self.__dict__.get("_lockstep_hparams")
        if saved is None:
            saved = self.__dict__["_lockstep_hparams"] = Hyperparameters()
        return saved  # type: ignore[no-any-return]

    @hparams.setter
    def hparams(self, values: Mapping[str, Any]) -> None:
        self.__dict__["_lockstep_hparams"] = Hyperparameters(values)


class Hyperparameters(dict[str, Any]):
    """``Module.hparams``: a dict whose keys read as attributes too, as Lightning's ``AttributeDict``."""

    def __getattr__(self, name: str) -> Any:
        if name in self:
            return self[name]
        return super().__getattribute__(name)  # Python's own AttributeError for a name it does not hold


#: What Lightning's ``self.log`` takes that changes nothing in lockstep (every value is reduced exactly).
_LIGHTNING_LOG_OPTIONS = {"sync_dist", "sync_dist_group", "rank_zero_only", "logger", "enable_graph",
                          "add_dataloader_idx", "metric_attribute"}


class StepRouter(nn.Module):
    """Calls a step method by name through ``forward``, so DDP's forward hooks see every step."""

    layout_root = "module"  # a tensor-parallel plan and pp_stages name the user's module's submodules

    def __init__(self, module: Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, step: str | torch.Tensor, *args: Any) -> Any:
        module: Any = self._modules["module"]  # what self.module reads, without nn.Module's slower attribute lookup
        if type(step) is str:
            return getattr(module, step)(*args)
        return module(step, *args)  # a pipeline stage: the module's own forward on what it receives


def configure_model(module: Module, rt: Runtime) -> None:
    """Call the module's ``configure_model()`` once, under FSDP on the meta device (nothing allocated:
    setup then materialises only this rank's shards)."""
    hook = getattr(module, "configure_model", None)
    if hook is None or getattr(module, "_lockstep_configured", False):
        return
    with rt.init_module(empty=rt.shards_model):
        hook()
    module.__dict__["_lockstep_configured"] = True


def configure_optimizers(module: Module) -> tuple[list[torch.optim.Optimizer], Schedules]:
    """The module's optimizers, and its schedulers with when each steps (``train/schedulers.py``)."""
    if not hasattr(module, "configure_optimizers"):
        raise UsageError(f"{type(module).__name__} has no configure_optimizers(): define it to return an "
                         "optimizer (or a dict with 'optimizer' and 'lr_scheduler').")
    result = getattr(module, "configure_optimizers")()  # noqa: B009 - user-defined, not on nn.Module
    monitor = None
    if isinstance(result, torch.optim.Optimizer):
        return [result], Schedules()
    if isinstance(result, (list, tuple)) and result and all(isinstance(o, torch.optim.Optimizer) for o in result):
        return list(result), Schedules()  # [optimizer, ...], as Lightning takes it
    if isinstance(result, dict):
        unknown = sorted(set(result) - {"optimizer", "lr_scheduler", "monitor"}, key=str)
        if unknown or "optimizer" not in result:
            raise UsageError(f"configure_optimizers() returned a dict with the keys {sorted(result, key=str)}: it "
                             "takes 'optimizer' (needed), 'lr_scheduler' and 'monitor'. A scheduler's own keys "
                             "('interval', 'frequency', ...) go in the lr_scheduler dict: {'optimizer': opt, "
                             "'lr_scheduler': {'scheduler': sched, 'interval': 'step'}}.")
        optimizers, schedulers = [result["optimizer"]], [result["lr_scheduler"]] if "lr_scheduler" in result else []
        monitor = result.get("monitor")
    elif isinstance(result, (list, tuple)) and len(result) == 2 and isinstance(result[0], (list, tuple)):
        optimizers, schedulers = list(result[0]), list(result[1])
    else:
        raise UsageError("configure_optimizers() must return an optimizer, a list of optimizers, a dict "
                         "{'optimizer', 'lr_scheduler'} or ([optimizers], [schedulers]); got "
                         f"{type(result).__name__}.")
    return optimizers, Schedules(schedulers_read(scheduler, monitor) for scheduler in schedulers)


def loss_of(outputs: Any) -> tuple[torch.Tensor, int | torch.Tensor | None]:
    """The loss in what ``training_step`` returned (the tensor itself, or the dict's ``"loss"``), and
    the dict's ``"num_items"``: how many items (tokens) the loss is a mean over, or None."""
    if type(outputs) is torch.Tensor:  # the common case, without an abstract-class check per step
        return outputs, None
    if outputs is None:
        raise UsageError("training_step returned None. Lightning skips such a batch; here every rank takes part in "
                         "each step's gradient all-reduce, so a batch cannot be skipped on one rank: return a loss for "
                         "every batch (leave unwanted samples out of the dataset, or weigh their loss by 0).")
    loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
    if not isinstance(loss, torch.Tensor):
        raise UsageError("training_step must return the loss tensor or a dict holding 'loss'; "
                         f"got {type(outputs).__name__}.")
    return loss, outputs.get("num_items") if isinstance(outputs, Mapping) else None
