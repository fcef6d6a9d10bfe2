"""``CurrentBatch``: the training batch the loop trains on, and the loss weight ``rt.backward`` applies to
its loss; the ``BatchObserver`` protocol through which a loader tells it which batch it hands out. Also the
position hang reports show, and the evaluation batch a forward under grad mode must not train on."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Protocol

import torch

from lockstep.errors import ConfigError, UsageError
from lockstep.runtime.faults.watchdog import Watchdog
from lockstep.runtime.tree import tensors

if TYPE_CHECKING:
    from lockstep.runtime.data.loader import DistributedLoader

_LOOKAHEAD = 8  # CurrentBatch tells apart at most this many batches the loop holds at once


class BatchObserver(Protocol):
    """Told when a loader's pass starts, when it hands out batch ``step`` (then the batch itself), and when its
    pass ends (its last batch is then no longer current). A batch stays current until the next one replaces
    it, or a forward names another that the loop still holds: the window in which ``rt.backward`` applies
    its loss weight.
    """

    def pass_started(self, loader: DistributedLoader) -> None: ...
    def batch_started(self, loader: DistributedLoader, step: int) -> None: ...
    def handed(self, loader: DistributedLoader, batch: Any) -> None: ...
    def padded(self, stand_in: dict[int, Any]) -> None: ...
    def batch_ended(self, loader: DistributedLoader) -> None: ...


class CurrentBatch:
    """The ``BatchObserver`` of a Runtime: the training batch the loop trains on, and the loss weight it
    brings; the loader of the latest pass (``rt.gather``'s default). Eval batches only move the position
    that hang reports show.

    The batch handed out last is current until the next one, or until its pass ends. A loop may hold
    several (it fetched the next batch before training on this one, to know which is the last, or a
    prefetcher did; it fetched a step's micro-batches first): a training forward then names the one it
    trains on by its tensors (the batch's own or views of them; a tensor with no elements, or one that
    several held batches share, names none), else the oldest of those the loop still holds (refused where that
    one was trained on and the next differs in loss weight: ``_one_reading``). The latest
    batch is kept as handed out, the earlier ones' tensors weakly: a batch the loop let go of (one it
    skipped) is never chosen, and no batch outlives the loop's own references.
    """

    def __init__(self, watchdog: Watchdog) -> None:
        self.watchdog = watchdog
        self.loader: DistributedLoader | None = None
        self.step = 0  # the current training batch's number in its loader's epoch
        self.loss_weight = 1.0
        self.backward_seen = False  # rt.backward ran since the latest training batch was handed out
        # the training batches handed out that the loop may still hold: [loader, step, loss weight, the batch
        # (its tensors' weak references, _Weak, once a later batch is handed out), whether a forward trained on
        # it], oldest first
        self.held: list[list[Any]] = []
        self.ended = False  # the current batch's pass ended (a look-ahead's last batch may still be trained on)
        self.evaluated: weakref.ref[torch.Tensor] | None = None  # the eval batch handed out (its first tensor)
        self.bypassed = False  # the latest training forward ran on an eval batch, outside the data-parallel wrapper
        self.last: DistributedLoader | None = None  # the loader of the latest pass: rt.gather's default
        # While a zero-row padding batch is current: id of each of its tensors -> the one real row it was
        # cut from. A forward that is a collective runs on the real row and returns zero rows.
        self.stand_in: dict[int, Any] = {}

    def pass_started(self, loader: DistributedLoader) -> None:
        self.last = loader
        self.held = [entry for entry in self.held if entry[0] is not loader]  # a pass left (break) is over

    def padded(self, stand_in: dict[int, Any]) -> None:
        self.stand_in = stand_in

    def batch_started(self, loader: DistributedLoader, step: int) -> None:
        self.watchdog.batch = ("train" if loader.training else "eval", loader.epoch, step)
        self.stand_in = {}
        if loader.training:
            if self.loader is not None and self.loader is not loader and not self.backward_seen:
                _one_weight_for_both(self.loader, self.step, loader, step)  # two loaders' batches in one loss (zip)
            self.loader, self.step, self.loss_weight = loader, step, loader.loss_weight(step)
            self.backward_seen = self.ended = False
            if self.watchdog.clock is not None:  # the straggler report times the steps
                self.watchdog.clock.batch(loader)

    def handed(self, loader: DistributedLoader, batch: Any) -> None:
        """The batch itself, kept with its loss weight: strongly while it is the latest (the loop holds it then),
        then its tensors weakly (a loop that holds several batches names one by any of its tensors)."""
        first = _first(batch)
        if first is None:
            return
        if not loader.training:
            self.evaluated = weakref.ref(first)
            return
        held = self.held
        if held:
            self._let_go()
        held.append([loader, self.step, self.loss_weight, batch, False])
        if len(held) > _LOOKAHEAD:  # a loop that reads batches without training on them
            del held[0]

    def _let_go(self) -> None:
        """The latest batch is no longer the latest: forgotten once trained on, else its tensors kept weakly."""
        latest = self.held[-1]
        if latest[4]:
            self.held.pop()
        elif type(latest[3]) is not _Weak:
            latest[3] = _Weak(weakref.ref(t) for t in tensors(latest[3]))

    def take(self, inputs: Any) -> None:
        """A training forward on ``inputs``: the held batch it trains on becomes current (see the class)."""
        held = self.held
        if not held:  # a forward on data no rt.loader handed out
            return
        if len(held) == 1 and not self.ended and held[0][1] == self.step and held[0][0] is self.loader:
            held[0][4] = True
            return  # a plain loop: the one batch it holds is the current one
        alive = [(entry, kept) for entry in held if (kept := _tensors(entry))]  # the batches the loop holds
        held[:] = [entry for entry, _ in alive]
        given = {_storage(t) for t in tensors(inputs)}
        # each batch's own memory: not an empty tensor's (every one starts at 0), nor one several batches share
        owned = [{_storage(t) for t in kept if t.numel()} for _, kept in alive]
        shared = {s for i, mine in enumerate(owned) for s in mine if any(s in other for other in owned[i + 1:])}
        chosen = next((entry for (entry, _), mine in zip(alive, owned, strict=True) if (mine - shared) & given), None)
        if chosen is None and len(held) > 1 and not self.ended:
            chosen = held[0]  # tensors made from a batch's: the oldest the loop holds
            _one_reading(chosen, next((entry for entry in held if not entry[4]), None))
        elif chosen is None and self.ended:  # after the pass: a look-ahead's last batch, else other data
            chosen = next((entry for entry in held if not entry[4]), None)
        if chosen is not None:
            self.loader, self.step, self.loss_weight, chosen[4] = chosen[0], chosen[1], chosen[2], True
        elif self.ended:  # no batch of the pass is current any more
            self.loader, self.loss_weight = None, 1.0

    def evaluates(self, inputs: Any) -> bool:
        """Whether a forward under grad mode is given the evaluation batch handed out (its tensors): it runs
        without the data-parallel wrapper's collectives (DDP's buffer broadcast), since the ranks' evaluation
        shards differ in length and a rank without a batch would never meet them."""
        first = self.evaluated() if self.evaluated is not None else None
        self.bypassed = first is not None and _storage(first) in {_storage(t) for t in tensors(inputs)}
        return self.bypassed

    def backward_started(self) -> None:
        """``rt.backward``: refused after a forward that ran outside the data-parallel wrapper (``evaluates``)."""
        self.backward_seen = True
        if self.bypassed:
            self.bypassed = False
            raise UsageError("rt.backward after a forward on a batch of rt.eval_loader under grad mode, with the model "
                             "in eval mode: that forward ran without the data-parallel wrapper (the ranks' "
                             "evaluation shards differ in length), so its gradients would not be averaged over the "
                             "ranks. Train on rt.loader's batches (or call model.train() first).")

    def rows(self) -> list[int] | None:
        """The dataset indices of the current training batch's rows on this rank (None: no lockstep loader's)."""
        local = getattr(self.loader.sampler, "local_indices", None) if self.loader is not None else None
        return list(local(self.step)) if local is not None else None

    def batch_ended(self, loader: DistributedLoader) -> None:
        self.stand_in = {}
        if not loader.training:
            self.evaluated = None
        if loader is self.loader:
            if self.held:
                self._let_go()
            self.loader, self.loss_weight, self.ended = None, 1.0, True
            if self.watchdog.clock is not None:
                self.watchdog.clock.pass_ended()


def _one_reading(oldest: list[Any], untrained: list[Any] | None) -> None:
    """A forward on tensors made from a held batch's, where the oldest was trained on already: it trains on the
    oldest again (a second loss on one batch) or on the next (a step's micro-batches fetched first), and only the
    loop knows which. Where their loss weights differ (a short last batch), refused: a guess is a wrong gradient."""
    if oldest[4] and untrained is not None and untrained[2] != oldest[2]:
        raise UsageError(
            f"a training forward on tensors made from a batch's (x.float(), a normalisation), while the loop holds "
            f"batches {oldest[1]} and {untrained[1]}: rt.backward cannot tell which it trains on, and their loss "
            f"weights differ ({oldest[2]:.4g} and {untrained[2]:.4g}: a short last batch split unevenly over the "
            "ranks). Give the model the batch's own tensors (or views of them), converting inside its forward.")


def _first(batch: Any) -> torch.Tensor | None:
    """A batch's first tensor: at once for a tensor, a tuple or list, or a dict whose first item is one."""
    if isinstance(batch, torch.Tensor):
        return batch
    head = batch[0] if isinstance(batch, (tuple, list)) and batch else (
        next(iter(batch.values()), None) if isinstance(batch, dict) else None)
    return head if isinstance(head, torch.Tensor) else next(tensors(batch), None)


class _Weak(tuple):  # type: ignore[type-arg]
    """A held batch's tensors, as weak references (a tuple of the batch's own is a batch)."""


def _tensors(entry: list[Any]) -> list[torch.Tensor]:
    """A held batch's tensors that still exist (none once the loop let go of the batch)."""
    kept = entry[3]
    if type(kept) is _Weak:
        return [t for ref in kept if (t := ref()) is not None]
    return list(tensors(kept))


def _storage(tensor: torch.Tensor) -> int:
    """Where ``tensor``'s memory starts: the same for a batch's tensor and every view of it (a tensor without
    storage of its own, a subclass's: itself)."""
    try:
        return tensor.untyped_storage().data_ptr()
    except RuntimeError:  # a subclass that has no storage to give says so with one
        return id(tensor)


def _one_weight_for_both(first: DistributedLoader, first_step: int, second: DistributedLoader, step: int) -> None:
    """``rt.backward`` weighs a step's loss by one loss weight, the current batch's: when the batches of
    two training loaders are current together, both global batches must be split alike over the ranks
    (the same number of samples, or each a multiple of the ranks). Judged from the global batch sizes
    alone, so every rank decides alike."""
    sizes = first.global_batch_size(first_step), second.global_batch_size(step)
    ranks = getattr(second.sampler, "world_size", 1)
    if sizes[0] != sizes[1] and any(size % ranks for size in sizes):
        raise ConfigError(
            f"two training loaders hand out the batches of one step (zipped, e.g.): {sizes[0]} and {sizes[1]} "
            f"samples, split unevenly over the {ranks} data-parallel ranks. rt.backward weighs the step's loss "
            "by one batch's weight, which would be wrong for the other's part of the loss. Pass drop_last=True "
            f"to both loaders, with batch sizes that are equal or each a multiple of {ranks}.")
