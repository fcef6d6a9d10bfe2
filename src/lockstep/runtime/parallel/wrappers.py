"""What ``Runtime.setup`` hands back: the model behind a thin wrapper (the optimizer's patched step is
``optimizer_step.py``'s)."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from lockstep.errors import UsageError
from lockstep.runtime._torch_compat import compiled_inner
from lockstep.runtime.faults.stragglers import StepClock
from lockstep.runtime.faults.watchdog import Watchdog
from lockstep.runtime.parallel.precision import Precision
from lockstep.runtime.parallel.tensor_parallel import explain_failure
from lockstep.runtime.tree import empty_rows, map_tensors


def model_output(output: Any) -> Any:
    """What the loss function receives (and a pipeline stage hands on): a Hugging Face model's ``logits``, else the
    output itself."""
    logits = getattr(output, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else output


def model_inputs(batch: Any) -> torch.Tensor:
    """What the model is called with: a dict's ``input_ids`` (a Hugging Face batch), a tuple's first item,
    or the batch itself."""
    found = (batch.get("input_ids") if isinstance(batch, Mapping) else
             batch[0] if isinstance(batch, (tuple, list)) and batch else batch)
    if not isinstance(found, torch.Tensor):
        raise UsageError(f"the model's input in a batch of type {type(batch).__name__} is not a tensor: give "
                         "inputs=lambda batch: ... to rt.forward_backward.")
    return found


class WrappedModule(nn.Module):
    """Runs the strategy's module (e.g. DDP) under the precision's forward context.

    Attribute access, ``state_dict`` and ``load_state_dict`` go to your own module, so names and
    checkpoint keys are exactly those of the unwrapped model. With gradients disabled (evaluation),
    ``forward`` calls ``eval_module`` instead, which for DDP is your module itself: evaluation then
    issues no collective, so ranks holding different numbers of batches cannot hang.

    A forward that is a collective (FSDP's) must run on every rank even where the evaluation loader
    handed out a zero-row padding batch, and many models cannot run on zero rows (a reshape with
    ``-1``, a DTensor view). ``stand_in`` gives, while such a batch is current, the real row each
    of its tensors was cut from: the forward runs on that row and its output is cut to zero rows.
    """

    def __init__(
        self, forward_module: nn.Module, eval_module: nn.Module, module: nn.Module,
        precision: Precision, stand_in: Callable[[], dict[int, torch.Tensor]] | None = None,
        watchdog: Watchdog | None = None, replicas: int = 1, clock: StepClock | None = None,
        ring: Callable[[nn.Module, Any, bool], contextlib.AbstractContextManager[None] | None] | None = None,
        batches: Any = None,
    ) -> None:
        super().__init__()
        self._forward_module = forward_module
        self.__dict__["_forward_target"] = forward_module  # the same, read per forward without nn.Module's lookup
        self.__dict__["_eval_module"] = eval_module
        self.__dict__["module"] = module
        self.__dict__["_precision"] = precision
        self.__dict__["_stand_in"] = stand_in
        self.__dict__["_watchdog"] = watchdog  # a forward that is a collective: watched (and timed) as one
        self.__dict__["_clock"] = clock  # else only timed, for the straggler report
        self.__dict__["_ring"] = ring  # context parallel: a forward on a cut batch runs its attention as a ring
        self.__dict__["_batches"] = batches  # told which handed-out batch a training forward trains on
        # running statistics (BatchNorm) that each data-parallel replica (of ``replicas``) moves with its own rows
        self.__dict__["_tracks_stats"] = replicas > 1 and tracks_statistics(module)

    @property
    def forward_module(self) -> nn.Module:
        """The strategy's module (e.g. ``DistributedDataParallel``), for its own API such as comm hooks."""
        return self._forward_module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        own = self.__dict__
        if own["_tracks_stats"] and self.training and torch.is_grad_enabled():
            own["module"].__dict__[STATISTICS_MOVED] = True  # until rt.sync_buffers
        rows = own["_stand_in"]() if own["_stand_in"] is not None else None
        if rows:  # a zero-row padding batch: run on the row it was cut from, hand back zero rows
            args, kwargs = map_tensors(lambda t: rows.get(id(t), t), (args, kwargs))
        watchdog: Watchdog | None = own["_watchdog"]
        clock = own["_clock"]
        if watchdog is not None:
            with watchdog.step("forward"):  # its all-gathers (FSDP) and tensor-parallel collectives
                output = self._forward(args, kwargs)
        elif clock is None:
            output = self._forward(args, kwargs)
        else:
            clock.enter("forward")  # the straggler report times training forwards (the clock leaves out the others)
            try:
                output = self._forward(args, kwargs)
            finally:
                clock.leave()
        return empty_rows(output) if rows else output

    def _forward(self, args: Any, kwargs: Any) -> Any:
        own = self.__dict__
        training = torch.is_grad_enabled()
        batches = own["_batches"]
        if training and batches is not None:
            if batches.evaluated is not None and not self.training and batches.evaluates((args, kwargs)):
                training = False  # an eval batch under grad mode, the model in eval mode: no data-parallel collective
            else:  # which batch the loop holds this forward trains on
                batches.bypassed = False
                batches.take((args, kwargs))
        target = own["_forward_target"] if training else own["_eval_module"]
        ring = own["_ring"]
        context = ring(own["module"], (args, kwargs), training) if ring is not None else None
        precision: Precision = own["_precision"]
        try:  # costs nothing until something raises
            if context is None and not precision.transforms_forward:  # 32-true: nothing to add on the hot path
                output = target(*args, **kwargs)
            else:
                with context or contextlib.nullcontext():  # a cut batch: attention over every cp rank's part
                    args, kwargs = precision.convert_input((args, kwargs))
                    with precision.forward_context():
                        output = target(*args, **kwargs)
                    output = precision.convert_output(output)
        except (RuntimeError, ValueError) as error:  # a tensor-parallel plan that does not fit the model's flow
            explained = explain_failure(error, own["module"])
            if explained is None:
                raise
            raise explained from error
        return output

    def train(self, mode: bool = True) -> WrappedModule:
        """``model.eval()`` after training on several ranks, whose BatchNorm statistics each moved with its
        own rows: said once, as every rank would evaluate (and save) a different model."""
        module = self.__dict__["module"]
        if not mode and module.__dict__.get(STATISTICS_MOVED) and not module.__dict__.get(_WARNED):
            module.__dict__[_WARNED] = True
            warnings.warn("lockstep: model.eval() after training on several ranks: each rank's BatchNorm running "
                          "statistics moved with its own rows, so the ranks would evaluate different models. Call "
                          "rt.sync_buffers(model) before evaluating (every rank gets rank 0's; the Trainer does "
                          "this itself).", stacklevel=3)
        return super().train(mode)

    def no_sync(self) -> Any:
        """``with model.no_sync():``, DistributedDataParallel's habit, said in lockstep's spelling."""
        raise UsageError("model.no_sync() is DistributedDataParallel's: for the model rt.setup returned, write "
                         "`with rt.no_sync(model):` (the same accumulation, under every strategy).")

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["module"], name)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__["module"].state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.__dict__["module"].load_state_dict(state_dict, strict=strict, assign=assign)


#: Set on a module (its ``__dict__``) while its running statistics moved since the last ``rt.sync_buffers``.
STATISTICS_MOVED = "_lockstep_statistics_moved"
_WARNED = "_lockstep_statistics_warned"


def tracks_statistics(module: nn.Module) -> bool:
    """Whether ``module`` holds running statistics that a training forward moves with this rank's rows alone
    (BatchNorm's; SyncBatchNorm's cover the global batch)."""
    return any(isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats
               and not isinstance(m, nn.SyncBatchNorm) for m in module.modules())


def unwrap(module: nn.Module) -> nn.Module:
    """Your own module behind what ``Runtime.setup`` returned, or behind ``torch.compile``'s wrapper
    (the module itself otherwise)."""
    if isinstance(module, WrappedModule):
        return module.__dict__.get("module", module)
    inner = compiled_inner(module)
    return inner if isinstance(inner, nn.Module) else module
