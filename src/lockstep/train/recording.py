"""``Recorder``: what ``self.log`` records. Each value goes to the current stage's store (``sink``), weighted
by this rank's samples in the batch; the Trainer records the loss ``training_step`` returns as
``train_loss``, unless the module logs that name itself."""

from __future__ import annotations

import torch

from lockstep.errors import StateError
from lockstep.train.loop import LoopState
from lockstep.train.metrics import MetricStore, TrainingMetrics, weighted_value

LOSS_NAME = "train_loss"  # what the Trainer logs the loss training_step returns as


class Recorder:
    """Where a stage's logged values go. ``sink`` is the store of the stage under way (training's
    ``metrics.recent``, or an evaluation's), None between stages; ``device`` is where the sums live (the
    Runtime's). ``items_seen_local``: this rank's ``num_items`` so far (tokens, say), a device tensor."""

    def __init__(self, metrics: TrainingMetrics, loop: LoopState) -> None:
        self.metrics, self.loop = metrics, loop
        self.sink: MetricStore | None = None
        self.device = torch.device("cpu")
        self.items_seen_local: torch.Tensor | None = None
        self.loss_name: str | None = LOSS_NAME  # None: the module logs train_loss itself
        self.loss_recorded = False  # the returned loss was recorded in this fit

    @property
    def taken(self) -> bool:
        """The module logs ``train_loss`` itself."""
        return self.loss_name is None

    def start_fit(self) -> None:
        self.loss_name, self.loss_recorded = LOSS_NAME, False

    def log(self, name: str, value: float | torch.Tensor, batch_size: int | torch.Tensor | None,
            on_step: bool | None, on_epoch: bool | None) -> None:
        """The module's ``self.log``. Its own ``train_loss`` in training (Lightning's habit) takes the name: the
        returned loss is no longer recorded under it, for the rest of the fit. Where the module logs it only on
        some batches, the returned losses recorded before its first value leave the sums not yet logged (the
        epoch's value is then the module's alone)."""
        if name == self.loss_name and self.sink is self.metrics.recent:
            if self.loss_recorded:
                self.metrics.forget(LOSS_NAME)
            self.loss_name = None
        self._add(name, value, batch_size, on_step, on_epoch)

    def loss(self, loss: torch.Tensor, items: int | torch.Tensor | None) -> None:
        """The batch's returned loss into ``train_loss``; ``num_items`` into the items seen (a device tensor:
        counted without waiting for the device)."""
        if items is not None:
            count = torch.as_tensor(items).detach().double()
            self.items_seen_local = count if self.items_seen_local is None else self.items_seen_local + count
        if self.loss_name is not None:  # else the module logs train_loss itself
            self.loss_recorded = True
            self._add(LOSS_NAME, loss, items, None, None)  # detached there

    def _add(self, name: str, value: float | torch.Tensor, batch_size: int | torch.Tensor | None,
             on_step: bool | None, on_epoch: bool | None) -> None:
        """``value`` weighted by this rank's samples in the batch (the loader's exact count, whatever the batch's
        type) or by ``batch_size``, into the stage's sums (``on_step=False``/``on_epoch=False``: not into the
        logged steps' / the epoch's)."""
        sink = self.sink
        if sink is None:  # between stages the sums are already reduced: the value would vanish
            raise StateError(f"self.log({name!r}) was called outside training_step, validation_step and test_step "
                             "(e.g. in an epoch-end hook, configure_optimizers or predict_step), where nothing "
                             "would ever reduce it: log from a step, or pass reduced values to "
                             "trainer.log_metrics({...}).")
        if (on_step is not None or on_epoch is not None or self.metrics.routes) and sink is self.metrics.recent:
            self.metrics.route(name, on_step, on_epoch)  # training's two sums: the flags of this value
        rows = self.loop.batch_samples  # None outside a batch (an epoch-start hook): each call weighs 1
        weight = batch_size if batch_size is not None else rows if rows is not None else 1
        # a rank's zero-row batch (its shard ended, a stream's end) logs nothing, whatever batch_size says: its
        # step ran on a stand-in row (a forward that is a collective, FSDP's) or on no row (0 / 0)
        if rows == 0 or (type(weight) is int and weight == 0):
            return
        device = self.device  # a value elsewhere (a CPU number on a GPU run) moves
        if type(weight) is int and isinstance(value, torch.Tensor) and value.ndim == 0 and value.device == device:
            sink.add_scalar(name, value, weight)  # the per-step case
        else:
            sink.add(name, weighted_value(name, value, weight, device), weight)
