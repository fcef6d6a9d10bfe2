"""The order of an optimizer step, written once: what ``optimizer.step()`` runs after ``rt.setup``
patched it, and what ``rt.clip_grad_norm_`` runs between the backward and the step.

A step of an optimizer set up by ``rt.setup``, top to bottom:

1. a background save that failed is raised now, not at the next save (``checkpoint/``);
2. the item count (``rt.backward(num_items=...)``): one all-reduce of the step's item counts,
   the gradients rescaled in place to those of the mean over every item (``parallel/num_items``);
   fault tolerance (``fault_tolerance/``): the gradients averaged over the replica groups of
   the step, then the commit vote; a step that does not commit ends here, untaken;
3. unscaling (``16-mixed``), when ``rt.clip_grad_norm_`` has not already done it, then clipping
   there (``parallel/grad_norm``): both in ``clip`` below, which the user calls between 2 and 4;
4. ``lockstep verify``'s checks of the gradients (``verify``);
5. the step through the precision: the GradScaler's step (skipped on inf/NaN) and update, or the
   optimizer's own step (``parallel/precision``);
6. ``lockstep verify``'s record of the weights after it.
"""

from __future__ import annotations

import types
import warnings
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lockstep.errors import UsageError
from lockstep.runtime._torch_compat import DCP_STATE_INIT_STEP, mark_wrapped_by_lr_scheduler
from lockstep.runtime.parallel.grad_norm import clip_grad_norm

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from lockstep.runtime.checkpoint.life import Checkpoints
    from lockstep.runtime.fault_tolerance.replication import Replication
    from lockstep.runtime.faults.watchdog import Watchdog
    from lockstep.runtime.parallel.num_items import ItemNormalizer
    from lockstep.runtime.parallel.precision import Precision
    from lockstep.runtime.verify import StepRecorder


_STEPS: weakref.WeakSet[OptimizerStep] = weakref.WeakSet()  # every Runtime's, for torch's clip_grad_norm_


def guard_torch_clip() -> None:
    """``torch.nn.utils.clip_grad_norm_`` refuses the gradients of parameters that a Runtime's optimizers step
    while that Runtime has not finished them (a port's line that ``rt.clip_grad_norm_`` replaces), naming what
    they wait for; for any other parameters, and any other time, it is torch's own."""
    utils = torch.nn.utils
    original = utils.clip_grad_norm_
    if getattr(original, "_lockstep_guard", False):
        return

    def clip_grad_norm_(parameters: Any, max_norm: float, *args: Any, **kwargs: Any) -> torch.Tensor:
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        for step in list(_STEPS):
            waiting = step.unfinished()
            if waiting is not None and step.steps_any(parameters):
                raise UsageError("torch.nn.utils.clip_grad_norm_ read this step's gradients before lockstep "
                                 f"finished them ({waiting}), so its norm and its clip would be wrong: call "
                                 "rt.clip_grad_norm_(model, optimizer, max_norm) between rt.backward and "
                                 "optimizer.step() instead.")
        return original(parameters, max_norm, *args, **kwargs)

    clip_grad_norm_._lockstep_guard = True  # type: ignore[attr-defined]
    clip_grad_norm_.__doc__, clip_grad_norm_.__wrapped__ = original.__doc__, original  # type: ignore[attr-defined]
    utils.clip_grad_norm_ = clip_grad_norm_  # type: ignore[assignment]


class OptimizerStep:
    """Owns the order of the optimizer step for one Runtime (see the module docstring)."""

    def __init__(self, precision: Precision, items: ItemNormalizer, checkpoints: Checkpoints,
                 watchdog: Watchdog, recorder: StepRecorder | None, replication: Replication,
                 batch: Callable[[], tuple[float, object]] = lambda: (1.0, None)) -> None:
        self.precision, self.items, self.checkpoints = precision, items, checkpoints
        self.watchdog, self.recorder, self.replication = watchdog, recorder, replication
        self._optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        self._batch = batch  # the current batch's loss weight (rt.backward multiplies its loss by it), and which it is
        self._backward_for: object = None  # the batch that an rt.backward was seen for
        self._warned = False
        self._clipping = False  # inside ``clip``, whose own call of torch's clip_grad_norm_ reads final gradients
        self._stepped: set[int] = set()  # fault tolerance: the optimizers stepped in this step (their ids)
        _STEPS.add(self)
        guard_torch_clip()

    def run(self, optimizer: torch.optim.Optimizer, step: Callable[[], Any], closure: bool = False) -> Any:
        """One optimizer step; ``step`` is the optimizer's own (unpatched) step (``closure``: it runs the
        backward itself)."""
        self.checkpoints.raise_if_failed()                      # 1
        if not closure:
            self._check_backward()
        self.items.finish_step()                                # 2
        if self.replication.fault_tolerant:  # (not DCP's step that creates the state: it does not come here)
            self._replicated_step(optimizer)
        if not self.replication.commit():  # decided at the step's first optimizer: its others follow it
            self.precision.step_not_taken(optimizer)  # gradients unscaled by a clip are dropped with the step
            return None
        if self.recorder is not None:
            self.recorder.before_step()                         # 4
        result = self.precision.optimizer_step(optimizer, step)  # 3 (unscale, if not done) and 5
        if self.recorder is not None:
            self.recorder.after_step()                          # 6
        return result

    def unfinished(self) -> str | None:
        """What this step's gradients wait for before they are final, or None (``clip`` and ``run`` finish them):
        read before that, by torch's own ``clip_grad_norm_``, they give a wrong norm and a wrong clip."""
        if self._clipping or not self.items.backwards_this_step:
            return None
        if self.items.counts_items:
            return "their division by the step's num_items"
        if self.replication.in_step:
            return "their average over the replica groups"
        if any(self.precision.scaled(optimizer) for optimizer in self._live()):
            return "their unscaling (16-mixed)"
        return None

    def steps_any(self, parameters: list[torch.Tensor]) -> bool:
        """Whether an optimizer of this Runtime steps one of ``parameters``."""
        held = {id(p) for p in _parameters_of(self._live())}
        return any(id(p) in held for p in parameters)

    def _live(self) -> list[torch.optim.Optimizer]:
        """The attached optimizers that still exist."""
        return [optimizer for ref in self._optimizers if (optimizer := ref()) is not None]

    def clip(self, model: nn.Module, optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer],
             max_norm: float, norm_type: float) -> torch.Tensor:
        """Between the backward and the step: 2 (so the norm is that of the final gradients), then 3, over the
        parameters of ``optimizers`` (one, or several clipped together by their total norm)."""
        self._check_backward()
        self.items.finish_step()
        if self.replication.in_step:
            self._reduce_over_replicas()
        optimizers = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
        for optimizer in optimizers:
            self.precision.unscale_(optimizer)
        with self.watchdog.step("clip_grad_norm_"):
            # the norm over all shards, meshes and pipeline stages, of the parameters these optimizers step: those
            # unscaled (another optimizer's gradients may still be scaled)
            held = {id(p) for p in _parameters_of(optimizers)}
            parameters: list[torch.Tensor] = [p for p in model.parameters() if id(p) in held]  # the model's first
            listed = {id(p) for p in parameters}
            for p in _parameters_of(optimizers):  # then those of other models these optimizers step
                if id(p) not in listed:
                    listed.add(id(p))
                    parameters.append(p)
            self._clipping = True
            try:
                return clip_grad_norm(parameters, max_norm, norm_type, getattr(model, "norm_across_stages", None))
            finally:
                self._clipping = False

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Route ``optimizer.step()`` through ``run``. The optimizer stays the same object, so LR
        schedulers and ``isinstance`` checks keep working. GradScaler calls ``optimizer.step()``
        itself, so a re-entrant call runs the original step."""
        if getattr(optimizer.step, "_lockstep_patched", False):
            return
        self._optimizers.append(weakref.ref(optimizer))
        self.items.watch(optimizer)
        original = optimizer.step
        inside = False
        run = self.run

        def patched(self: torch.optim.Optimizer, closure: Any = None) -> Any:
            nonlocal inside
            if inside or self.__dict__.get(DCP_STATE_INIT_STEP):  # GradScaler's call; DCP's state-creating step
                return original() if closure is None else original(closure)
            inside = True
            try:
                if closure is None:
                    return run(self, original)
                return run(self, lambda: original(finishing(closure)), closure=True)
            finally:
                inside = False

        def finishing(closure: Callable[[], Any]) -> Callable[[], Any]:
            """The closure, then the step's gradients finished (``num_items``'s division) before the optimizer
            reads them: the closure runs the backward inside the step (LBFGS calls it several times)."""
            def closure_then_finish() -> Any:
                loss = closure()
                items.finish_step()
                return loss
            return closure_then_finish

        items = self.items
        patched._lockstep_patched = True  # type: ignore[attr-defined]
        mark_wrapped_by_lr_scheduler(original, patched)  # a scheduler made before setup wrapped step(): ours calls it
        optimizer.step = types.MethodType(patched, optimizer)  # type: ignore[method-assign]

    def _check_backward(self) -> None:
        """A step after a batch split unevenly over the ranks (its loss weight is not 1) for which no backward
        went through ``rt.backward`` (a ported ``loss.backward()``): the gradients are then not the global
        batch's mean. Said once."""
        weight, batch = self._batch()
        if self._warned or weight == 1.0:
            return
        if self.items.backwards_this_step:  # seen now; a later optimizer of the same batch finds the count spent
            self._backward_for = batch
            return
        if batch is not None and batch == self._backward_for:
            return
        self._warned = True
        warnings.warn(
            f"lockstep: optimizer.step() after a batch that the ranks split unevenly (this rank's loss weight "
            f"{weight:.4g}), and no rt.backward since the last step: a plain loss.backward() averages the ranks' "
            "means as if every rank held as many rows, so the gradients are not those of the global batch's mean. "
            "Call rt.backward(loss) instead.", stacklevel=4)

    def _replicated_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Fault tolerance: the step's gradients averaged over the replica groups, once; a step needs the quorum
        that a training loader of ``rt.loader`` takes before its batches: an optimizer stepped again without one
        would train its group apart from the others (no average, the last commit's answer again), so it is
        refused."""
        if self.replication.in_step:
            self._reduce_over_replicas()
            self._stepped.clear()
        elif not self._stepped or id(optimizer) in self._stepped:
            raise UsageError("fault tolerance: optimizer.step() with no step begun: each step's batches must come "
                             "from a training loader made by rt.loader (before a step's batches it takes the "
                             "replica groups' quorum, which averages the step's gradients over the groups and "
                             "decides whether the step commits). A plain DataLoader or batches made by hand would "
                             "train each group apart from the others.")
        self._stepped.add(id(optimizer))

    def _reduce_over_replicas(self) -> None:
        """Every attached optimizer's gradients averaged over the replica groups (once a step)."""
        self.replication.reduce_gradients(_parameters_of(self._live()))


def _parameters_of(optimizers: Sequence[torch.optim.Optimizer]) -> list[torch.Tensor]:
    """Every parameter the optimizers step, group by group."""
    return [p for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]]
