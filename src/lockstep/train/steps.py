"""One training batch's forward and backward, chosen once when the Trainer sets its module up: on the
whole model (the module's ``training_step``, then the backward), or on pipeline stages (the module's
``forward`` cut into stages, whose schedule runs the backward with the forward). The Trainer's loop calls
the chosen one for every batch and asks nothing about the layout."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from lockstep.errors import UsageError
from lockstep.train.module import loss_of

if TYPE_CHECKING:
    from lockstep.train.trainer import Trainer


class WholeModelStep:
    """``training_step`` on the whole model, its loss recorded, ``on_before_backward``, then the backward:
    normalised over every item of the step with ``num_items``, else divided by the accumulation."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def __call__(self, batch: Any, batch_idx: int) -> Any:
        t = self.trainer
        k = t.config.accumulate_grad_batches
        outputs = t._call("training_step", t._wrapped, "training_step", batch, batch_idx)
        loss, items = loss_of(outputs)
        t.recorder.loss(loss, items)
        scaled = loss / k if k > 1 and items is None else loss  # what the backward gets (Lightning's hook gets it too)
        if t._hooks.runs(1):
            t.fire("on_before_backward", scaled)
        backward = t._runtime.backward  # type: ignore[union-attr]  # set up: the Runtime exists
        if items is not None:
            t._call("backward", backward, loss, items)
        else:
            t._call("backward", backward, scaled)
        return outputs


class PipelineStep:
    """A batch on pipeline stages: the module's ``loss_fn(output, batch)`` on the last stage, with
    ``num_items(batch)`` when the module defines it (docs/parallelism.md)."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def __call__(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        t = self.trainer
        module, k = t.module, t.config.accumulate_grad_batches
        loss_fn, count = getattr(module, "loss_fn", None), getattr(module, "num_items", None)
        if loss_fn is None:
            raise UsageError(f"{type(module).__name__} runs on pipeline stages (pp > 1), where no rank holds the whole "
                             "model for training_step: define loss_fn(self, output, batch), the loss of the rows of "
                             "batch from the model's output (and forward(self, inputs), the model).")
        scaled = loss_fn if count is not None or k == 1 else (lambda output, rows: loss_fn(output, rows) / k)
        loss = t._call("training_step", functools.partial(t.runtime.forward_backward, num_items=count,
                                                           inputs=getattr(module, "inputs", None)),
                       t._wrapped, batch, scaled)
        outputs = {"loss": loss * k if k > 1 else loss} if count is None else {"loss": loss, "num_items": count(batch)}
        t.recorder.loss(outputs["loss"], outputs.get("num_items"))
        return outputs


def batch_step_for(trainer: Trainer, staged: bool) -> WholeModelStep | PipelineStep:
    """The batch step of a module set up whole, or on pipeline stages (``staged``)."""
    return PipelineStep(trainer) if staged else WholeModelStep(trainer)
