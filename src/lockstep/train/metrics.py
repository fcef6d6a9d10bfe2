"""Metrics logged with ``self.log``: accumulated on the device, reduced across ranks on demand."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from lockstep.errors import ConfigError


class MetricStore:
    """Sample-weighted sums (device tensors) and sample counts per metric name.

    Adding never syncs: counts are batch sizes the host already knows, or device tensors (counts
    of tokens a module passed as ``batch_size``). A step's scalar (``add_scalar``) is only kept: the
    kept values are summed in float64 in a few operations when read, or every ``FOLD_EVERY`` values.
    """

    FOLD_EVERY = 256  # kept values per name before they are summed (bounds what a long epoch keeps)

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}
        self._counts: dict[str, float | torch.Tensor] = {}
        self._kept: dict[str, dict[float, list[torch.Tensor]]] = {}  # name -> weight -> scalar tensors
        self._agreed: list[str] | None = None  # the names of every rank at the last reduce (the same on all)

    def add(self, name: str, weighted: torch.Tensor, weight: float | torch.Tensor) -> None:
        """Add ``weighted`` (a float64 scalar tensor: value times ``weight``) to ``name``."""
        if name in self._sums:
            self._sums[name] += weighted
            self._counts[name] += weight
        else:  # copies: later adds are in place, and the caller may hand the same tensors to another store
            self._sums[name] = weighted.clone()
            tensor = weight.detach().to(torch.float64, copy=True) if isinstance(weight, torch.Tensor) else None
            self._counts[name] = tensor if tensor is not None else float(weight)

    def add_scalar(self, name: str, value: torch.Tensor, weight: float) -> None:
        """The per-step path: keep ``value`` (a 0-dim tensor on the device the sums live on, the Runtime's),
        without its graph, with its ``weight``.

        An in-place float64 add costs a tensor operation per step and name; keeping costs two list
        operations, and the sum of 256 kept values costs about what 30 adds would.
        """
        if value.grad_fn is not None and not value._is_view():  # an operation's result (the loss): kept as it is
            value = value.data if type(value) is torch.Tensor else value.detach()  # .data: no dispatch, no view
        else:  # a parameter or buffer (or a view) may change in place before the sum: its value now
            value = value.detach().clone()
        by_weight = self._kept.get(name)  # not setdefault: its default would be built on every call
        if by_weight is None:
            by_weight = self._kept[name] = {}
        kept = by_weight.get(weight)
        if kept is None:
            kept = by_weight[weight] = []
        kept.append(value)
        if len(kept) >= self.FOLD_EVERY:
            self._fold(name)

    def _fold(self, name: str) -> None:
        """Sum ``name``'s kept values into its float64 sum: per weight, one stack and one sum."""
        for weight, values in self._kept.pop(name, {}).items():
            self.add(name, torch.stack(values).to(torch.float64).sum() * weight, weight * len(values))

    def _fold_all(self) -> None:
        for name in list(self._kept):
            self._fold(name)

    def drain(self) -> dict[str, tuple[torch.Tensor, float | torch.Tensor]]:
        """Each name's weighted sum and count, the store then empty."""
        self._fold_all()
        drained = {name: (total, self._counts[name]) for name, total in self._sums.items()}
        self.reset()
        return drained

    def reduce(self, runtime: Any) -> dict[str, float]:
        """Every rank's sums and counts added up, in one all-reduce.

        The all-reduce covers the names the ranks agreed on at an earlier reduce, and a flag that a
        rank raises when it logged a name outside them; then (at the first reduce, and whenever a new
        name appears) the names of every rank are gathered and the sums reduced again over their union.
        Every rank must call it; a rank that logged nothing (no batches) still takes part.
        """
        self._fold_all()
        mine = set(self._sums)
        if self._agreed is not None:
            reduced = self._summed(runtime, self._agreed, new_names=not mine <= set(self._agreed))
            if reduced is not None:
                return reduced
        self._agreed = sorted({n for rank_names in runtime.all_gather(sorted(mine)) for n in rank_names})
        reduced = self._summed(runtime, self._agreed, new_names=False)
        assert reduced is not None, "no rank logs a name outside the union of every rank's names"
        return reduced

    def _summed(self, runtime: Any, names: list[str], new_names: bool) -> dict[str, float] | None:
        """The sums and counts of ``names`` over every rank, by name; None when some rank flagged a name
        outside ``names`` (every rank then gets None: the flag is summed with the values)."""
        device = runtime.device
        zero = torch.zeros((), dtype=torch.float64, device=device)
        sums = [self._sums.get(n, zero) for n in names]
        counts = [torch.as_tensor(self._counts.get(n, 0.0), dtype=torch.float64, device=device) for n in names]
        flag = torch.tensor(float(new_names), dtype=torch.float64, device=device)
        *totals, flagged = runtime.all_reduce(torch.stack([*sums, *counts, flag]), op="sum").tolist()
        if flagged:
            return None
        total_sums, total_counts = totals[:len(names)], totals[len(names):]
        return {n: s / c for n, s, c in zip(names, total_sums, total_counts, strict=True) if c > 0}

    def reset(self) -> None:
        self._sums.clear()
        self._counts.clear()
        self._kept.clear()

    def forget(self, name: str) -> None:
        """Drop ``name``'s values so far."""
        self._sums.pop(name, None)
        self._counts.pop(name, None)
        self._kept.pop(name, None)

    def state_dict(self) -> dict[str, Any]:
        self._fold_all()
        return {"sums": {n: t.detach().cpu() for n, t in self._sums.items()},
                "counts": {n: float(c) for n, c in self._counts.items()}}

    def merge(self, states: list[dict[str, Any]], device: torch.device) -> None:
        """Add saved sums and counts (e.g. every rank's, from a checkpoint): the reduce adds them anyway."""
        for state in states:
            for name, value in state["sums"].items():
                self.add(name, value.to(device=device, dtype=torch.float64), state["counts"][name])


class TrainingMetrics:
    """The sums behind logged training metrics: the current logging ``window`` and the current ``epoch``.

    A step's values land in ``recent`` alone (one list append per value); ``settle`` sums them once
    and adds that to the window and the epoch: at a logging step, at the epoch's end and before a
    checkpoint. In a fault-tolerant fit a step's values settle when the step commits (``end_step``) and
    are dropped when it does not (its batches come again).
    """

    def __init__(self) -> None:
        self.recent, self.window, self.epoch = MetricStore(), MetricStore(), MetricStore()
        self.routes: dict[str, tuple[bool, bool]] = {}  # name -> (not in the window, not in the epoch)
        self.commits = False  # fault tolerance: ``recent`` holds the step under way until it commits
        self.restored_mid_epoch = False  # a checkpoint's sums of the epoch under way, its start's values in them

    def sink_at_epoch_start(self) -> MetricStore:
        """Where the values logged at an epoch's start go: ``recent``; nowhere (a store of their own) when the
        epoch's sums came from a checkpoint written inside it, which holds them already."""
        restored, self.restored_mid_epoch = self.restored_mid_epoch, False
        return MetricStore() if restored else self.recent

    def reset(self) -> None:
        self.recent.reset()
        self.window.reset()
        self.epoch.reset()
        self.routes.clear()

    def start_epoch(self) -> None:
        """A new epoch's sums. The logging window goes on: the steps since the last logging step are in the
        next one's values, also across an epoch's end."""
        self.recent.reset()
        self.epoch.reset()
        self.routes.clear()

    def route(self, name: str, on_step: bool | None, on_epoch: bool | None) -> None:
        """Where ``self.log(name, on_step=, on_epoch=)`` sends the value: ``on_step=False`` keeps it out of
        the logged steps' window, ``on_epoch=False`` out of the epoch's value. Values logged before a
        change of the flags keep the flags they were logged with (they settle first)."""
        flags = (on_step is False, on_epoch is False)
        if self.routes.get(name, (False, False)) != flags:
            if not self.commits:  # in a fault-tolerant fit ``recent`` holds this step's values alone
                self.settle()
            self.routes[name] = flags

    def settle(self) -> None:
        """The recent values into the window and the epoch."""
        for name, (total, count) in self.recent.drain().items():
            no_window, no_epoch = self.routes.get(name, (False, False))
            if not no_window:
                self.window.add(name, total, count)
            if not no_epoch:
                self.epoch.add(name, total, count)

    def newest(self, runtime: Any, reduce: bool) -> dict[str, float]:
        """The recent values settled; with ``reduce``, the window's values so far (their mean over the ranks
        and the steps since the last logging step, as it will write them; a collective), the window kept."""
        self.settle()
        return self.window.reduce(runtime) if reduce else {}

    def forget(self, name: str) -> None:
        """Drop ``name``'s values not yet logged, in the step, the logging window and the epoch."""
        for store in (self.recent, self.window, self.epoch):
            store.forget(name)

    def window_values(self, runtime: Any) -> dict[str, float]:
        """The logging window's values (the recent ones settled first), reduced over the ranks (a collective);
        the window kept."""
        self.settle()
        return self.window.reduce(runtime)

    def end_step(self, committed: bool) -> None:
        if committed:
            self.settle()
        else:
            self.recent.reset()

    @contextlib.contextmanager
    def after_commit(self, step_ended: bool) -> Iterator[None]:
        """Around the hooks at a batch's end. In a fault-tolerant fit, after a step that committed
        (``step_ended``), what they log is the committed step's: it counts at once, as in any fit (a
        checkpoint saved in those hooks keeps it), and a later step that does not commit cannot drop it."""
        if not (step_ended and self.commits):
            yield
            return
        self.commits = False
        try:
            yield
        finally:
            self.commits = True
            self.settle()

    def state_dict(self, runtime: Any) -> dict[str, Any]:
        """Every rank's sums (a collective: every rank must call it); in a fault-tolerant fit without the
        step under way, whose values count once it commits."""
        if not self.commits:
            self.settle()
        return {"epoch_metrics": runtime.all_gather(self.epoch.state_dict()),
                "window_metrics": runtime.all_gather(self.window.state_dict())}

    def load_state_dict(self, runtime: Any, state: dict[str, Any], mid_epoch: bool) -> None:
        """Every rank's saved sums go to rank 0: the next reduce adds them up anyway, so the first
        values logged after resuming are exact. At an epoch start the epoch's sums are new; the logging
        window goes on."""
        self.reset()
        self.restored_mid_epoch = mid_epoch
        if runtime.is_global_zero:
            self.window.merge(state.get("window_metrics", []), runtime.device)
            if mid_epoch:
                self.epoch.merge(state.get("epoch_metrics", []), runtime.device)


def weighted_value(name: str, value: float | torch.Tensor, weight: float | torch.Tensor,
                   device: torch.device) -> torch.Tensor:
    """``value * weight`` as a float64 scalar tensor on ``device`` (no host sync for device tensors)."""
    tensor = torch.as_tensor(value).detach()
    if tensor.numel() != 1:
        raise ConfigError(f"self.log({name!r}, ...) needs a scalar; got a tensor of shape {tuple(tensor.shape)}.")
    weighted = tensor.to(device=device, dtype=torch.float64).reshape(())
    if isinstance(weight, torch.Tensor):  # a count of 0 (a rank's share without tokens) adds nothing, not 0/0 * 0
        weight = weight.detach().to(device=device, dtype=torch.float64).reshape(())
        return torch.where(weight == 0, torch.zeros_like(weighted), weighted * weight)
    return weighted * weight
