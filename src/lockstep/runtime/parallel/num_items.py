"""Losses averaged over items (tokens), normalised over the whole optimizer step, on any world size.

A rank's loss is the mean over its own ``n_r`` items of a micro-batch. The mean over every item
of the step is ``sum_r sum_m n_rm * loss_rm / N`` with ``N`` the step's total, which no rank
knows before the step ends. So each backward runs on ``loss * n / c`` (a sum, divided by a
constant ``c`` that every rank shares), the gradient reduction averages over the ``W`` ranks as
usual, and before the optimizer uses the gradients one all-reduce of the local counts gives
``N`` and the gradients are multiplied by ``W * c / N``. ``c`` is the power of two at or below
the larger of the two previous steps' mean items per rank (for the first step, the first
micro-batch's, from one extra all-reduce at the run's first backward; a single short step, a
pass's last, does not lower it): it keeps the backward's magnitude near the loss's own, as float16
loss scaling needs, and being a power of two it changes no bit of the result (a resumed run, which
calibrates again, stays bitwise equal).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch

from lockstep.errors import ConfigError
from lockstep.runtime._torch_compat import constant_divisor, foreach_mul_, to_local
from lockstep.runtime.parallel.mesh import Membership


class ItemNormalizer:
    """The item counts of the current optimizer step, and the gradient correction they give."""

    def __init__(self, membership: Membership, device: torch.device,
                 all_reduce_sum: Callable[[torch.Tensor], Any], cp: int = 1) -> None:
        self.membership, self.device = membership, device
        self.cp = cp  # context parallel: each of the cp ranks of a row counts its own part's items
        self._all_reduce_sum = all_reduce_sum
        self._optimizers: list[weakref.ref[torch.optim.Optimizer]] = []
        self._pending: torch.Tensor | None = None  # this rank's items since the last step (float64)
        self._plain_backwards = 0  # backwards without num_items in the same step: a mix is refused
        # c, the same on every rank; a device tensor, so that nothing here waits for the device.
        self.scale = torch.ones((), dtype=torch.float64, device=device)
        self._calibrated = False  # c is set from real counts: at the first backward, then every step
        self._last_mean: torch.Tensor | None = None  # the previous step's mean items per rank
        # What the first step's losses were divided by, with their counts (None after the first step).
        self._first_divisors: list[tuple[float | None, torch.Tensor]] | None = []

    def watch(self, optimizer: torch.optim.Optimizer) -> None:
        self._optimizers.append(weakref.ref(optimizer))

    def loss_factor(self, num_items: int | float | torch.Tensor, loss: torch.Tensor | None = None,
                    dtype: torch.dtype | None = None) -> torch.Tensor:
        """What this micro-batch's mean loss is multiplied by before its backward: ``n / c``, in ``dtype``, else
        float32 or the loss's own wider dtype. ``loss``: looked at in the first step only, for a division by the
        accumulation steps."""
        if self._plain_backwards:
            raise ConfigError(_MIXED)
        if not any(ref() is not None for ref in self._optimizers):  # no step would divide these gradients
            raise ConfigError(_NO_OPTIMIZER)
        count = torch.as_tensor(num_items).detach().to(device=self.device, dtype=torch.float64)
        if count.numel() != 1:
            raise ConfigError(f"num_items must be one number (this rank's items in the batch); got shape "
                              f"{tuple(count.shape)}.")
        count = count.reshape(())
        if not self._calibrated:  # once per run: a c of 1 would inflate the first backward n-fold (fp16 overflow)
            self._calibrated = True
            self.scale = _power_of_two_at_most(self._sum_over_ranks(count) / self._gradient_peers)
        self._pending = count if self._pending is None else self._pending + count
        if self._first_divisors is not None and loss is not None:
            self._first_divisors.append((constant_divisor(loss), count))
        # float32 (what a float16 loss's backward is scaled in), float64 for a float64 loss: a fractional count
        # (a weighted mean's weight sum) is not rounded below the loss's own precision
        if dtype is None:
            dtype = torch.promote_types(loss.dtype, torch.float32) if loss is not None else torch.float32
        return (count / self.scale).to(dtype)

    @property
    def counts_items(self) -> bool:
        """Whether a backward of this step gave ``num_items``: the gradients wait for ``finish_step``."""
        return self._pending is not None

    @property
    def backwards_this_step(self) -> bool:
        """Whether ``rt.backward`` (with or without ``num_items``) ran since the last optimizer step."""
        return bool(self._plain_backwards) or self._pending is not None

    def plain_backward(self) -> None:
        if self._pending is not None:
            raise ConfigError(_MIXED)
        self._plain_backwards += 1

    def finish_step(self) -> None:
        """Before gradients are used (clipping, the optimizer step): one all-reduce, one in-place scale.

        Runs once per step: later calls in the same step (a second optimizer) find nothing pending.
        """
        self._plain_backwards = 0
        if self._pending is None:
            return
        first, self._first_divisors = self._first_divisors, None
        if first is not None and _divided_by_accumulation(first):
            k = len(first)
            warnings.warn(
                f"lockstep: every loss of the first optimizer step was divided by {k:g}, its number of micro-batches, "
                f"and given to rt.backward with num_items. If that is a division by the accumulation steps, it "
                f"shrinks the gradient {k:g} times: with num_items the gradient is already the mean over every item "
                "of every micro-batch of the step, so remove it (docs/models.md, 'Token-averaged losses'). If it "
                f"belongs to the loss itself (a mean of {k:g} terms, half a squared error), nothing is wrong.",
                stacklevel=4)
        pending, self._pending = self._pending, None
        total = self._sum_over_ranks(pending)
        # no item anywhere (every label masked): the gradients are zero, and stay so; else divided by the total,
        # also one below 1 (the weight sum of a weighted mean)
        factor = (self._gradient_peers * self.scale) / torch.where(total > 0, total, torch.ones_like(total))
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        seen: set[int] = set()
        for ref in self._optimizers:
            optimizer = ref()
            for group in optimizer.param_groups if optimizer is not None else ():
                for param in group["params"]:
                    if param.grad is None or id(param) in seen:
                        continue
                    seen.add(id(param))
                    grad = to_local(param.grad)
                    by_device.setdefault(grad.device, []).append(grad)
        for device, grads in by_device.items():
            for dtype in {g.dtype for g in grads}:
                same = [g for g in grads if g.dtype == dtype]
                foreach_mul_(same, factor.to(device=device, dtype=dtype))
        # c for the next step: from the larger of this step's and the previous step's mean, so that one short step
        # (a pass's last) does not shrink it below the next full step's items (a float16 backward would overflow)
        mean = total / self._gradient_peers
        self.scale = _power_of_two_at_most(mean if self._last_mean is None else torch.maximum(mean, self._last_mean))
        self._last_mean = mean

    @property
    def _gradient_peers(self) -> int:
        """The ranks each gradient is averaged over: the data-parallel ones, times the context-parallel ring."""
        return self.membership.size * self.cp

    def _sum_over_ranks(self, count: torch.Tensor) -> torch.Tensor:
        """The items over every rank: the Runtime's sum over the data-parallel ranks (the identity on one
        process) is the sum over every rank divided by the batch peers, the cp ranks among them; times cp, it
        is the sum over every rank divided by the tp and pp peers, who hold the same items."""
        total = self._all_reduce_sum(count.clone())
        return total * self.cp if self.cp > 1 else total


def _divided_by_accumulation(losses: list[tuple[float | None, torch.Tensor]]) -> bool:
    """Whether every loss of a step of several micro-batches was divided by their number (the 1/k of a
    plain loop), and not by its own count (a mean written as ``sum / n``, where ``n`` may equal k).
    Reads the counts (one wait for the device) only when every divisor is k: in the first step only."""
    k = len(losses)
    if k < 2 or any(divisor != k for divisor, _ in losses):
        return False
    return any(value != k for value in torch.stack([count for _, count in losses]).tolist())


def _power_of_two_at_most(value: torch.Tensor) -> torch.Tensor:
    """The largest power of two at or below ``value`` (1 for anything below 1), on the device."""
    return torch.exp2(torch.floor(torch.log2(value.clamp(min=1.0))))


_NO_OPTIMIZER = (
    "rt.backward was given num_items, but no optimizer was given to rt.setup: the gradients are divided by the "
    "step's items in the optimizer's step, which lockstep runs only for the optimizers rt.setup returns, so they "
    "would stay multiplied by num_items. Pass the optimizer to rt.setup (model, optimizer = rt.setup(model, "
    "optimizer)); one built from model.parameters() before setup is re-pointed to the parameters setup makes.")
_MIXED = ("rt.backward was called with num_items for some micro-batches of this optimizer step and without it "
          "for others: give num_items to every backward of a step, or to none.")
