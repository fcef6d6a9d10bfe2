"""``lockstep.Module``: a ``torch.nn.Module`` with step methods and ``self.log``, driven by the Trainer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from lockstep.train.trainer import Trainer


class Module(nn.Module):
    """Subclass it and write the steps the Trainer calls (as in a LightningModule):

    - ``training_step(batch, batch_idx)`` returns the loss, or a dict holding ``"loss"``;
    - ``validation_step``, ``test_step`` (log metrics with ``self.log``) and ``predict_step``
      (returns the predictions for the batch), each only when you use it;
    - ``configure_optimizers()`` returns an optimizer, a dict ``{"optimizer": ..., "lr_scheduler":
      scheduler or {"scheduler": ..., "interval": "step" | "epoch"}}``, or a pair of lists
      ``([optimizers], [schedulers])``.

    The steps run on every rank, inside the precision's autocast, on this rank's share of the batch.
    """

    def __init__(self) -> None:
        super().__init__()
        self.__dict__["_trainer"] = None

    @property
    def trainer(self) -> Trainer:
        trainer = self.__dict__.get("_trainer")
        if trainer is None:
            raise RuntimeError("this module is not attached to a Trainer: call it from Trainer.fit/validate/...")
        return trainer

    @property
    def device(self) -> torch.device:
        return self.trainer.runtime.device

    def log(self, name: str, value: float | torch.Tensor, *, prog_bar: bool = False,
            batch_size: int | None = None) -> None:
        """Record a metric for this step; no host sync.

        Values accumulate on the device, weighted by the batch size (this rank's share, inferred
        from the batch when not given). They are reduced over all ranks every ``log_every_n_steps``
        and at the end of each epoch, where the value is exact over the whole dataset.
        """
        self.trainer._log_metric(name, value, prog_bar=prog_bar, batch_size=batch_size)


class StepRouter(nn.Module):
    """Calls a step method by name through ``forward``, so DDP's forward hooks see every step."""

    def __init__(self, module: Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, step: str, *args: Any) -> Any:
        return getattr(self.module, step)(*args)
