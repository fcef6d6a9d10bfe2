"""The learning-rate schedulers of ``configure_optimizers``, each with when it steps: Lightning's
scheduler configuration (``{"scheduler", "interval", "frequency", "monitor", "strict", "name"}``), read
once when the Trainer sets its module up. The Trainer's loop asks each one whether it is due."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lockstep.errors import ConfigError

_KEYS = {"scheduler", "interval", "frequency", "monitor", "strict", "name", "reduce_on_plateau"}


@dataclass(frozen=True)
class Scheduled:
    """A scheduler and when it steps: every ``frequency`` optimizer steps (``interval="step"``) or
    epochs (``"epoch"``). One that reduces on a plateau (``ReduceLROnPlateau``) steps with the value
    of ``monitor`` among the Trainer's ``callback_metrics``: at an epoch's end after its validation."""

    scheduler: Any
    interval: str = "epoch"
    frequency: int = 1
    monitor: str | None = None
    strict: bool = True  # a monitored value that is missing: an error (else a warning, and no step)
    name: str | None = None  # the LearningRateMonitor's name for its optimizer's rates

    @property
    def on_plateau(self) -> bool:
        return isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)

    def due(self, interval: str, count: int) -> bool:
        """Whether it steps now, ``count`` optimizer steps or epochs into the fit."""
        return interval == self.interval and count % self.frequency == 0

    def step(self, metrics: Mapping[str, float]) -> None:
        if not self.on_plateau:
            self.scheduler.step()
            return
        assert self.monitor is not None  # read() requires it
        value = metrics.get(self.monitor)
        if value is None:
            known = ", ".join(sorted(metrics)) or "none yet"
            message = (f"the scheduler {type(self.scheduler).__name__} monitors {self.monitor!r}, which no step "
                       f"has logged by this {self.interval}'s end (logged: {known}). Log it with self.log, or name "
                       "a logged metric in 'monitor'")
            if self.strict:
                raise ConfigError(message + " ('strict': False skips the step instead).")
            warnings.warn(f"lockstep: {message}; this step of the scheduler is skipped ('strict': False).",
                          stacklevel=2)
            return
        self.scheduler.step(float(value))


class Schedules(list[Scheduled]):
    """A fit's schedulers (``trainer.lr_schedulers``)."""

    def due(self, interval: str, count: int, on_plateau: bool) -> bool:
        """Whether any scheduler that reduces on a plateau (``on_plateau``), or any other, steps now."""
        return any(scheduled.on_plateau == on_plateau and scheduled.due(interval, count) for scheduled in self)

    def step(self, interval: str, count: int, metrics: Mapping[str, float], on_plateau: bool | None = None) -> None:
        """Step those due ``count`` optimizer steps or epochs into the fit (``on_plateau``: only those that
        reduce on a plateau, or only the others; at an epoch's end the former wait for its validation)."""
        for scheduled in self:
            if (on_plateau is None or scheduled.on_plateau == on_plateau) and scheduled.due(interval, count):
                scheduled.step(metrics)


def read(scheduler: Any, monitor: str | None = None) -> Scheduled:
    """One entry of ``configure_optimizers``'s schedulers: a scheduler (stepped each epoch), or a dict of
    Lightning's keys; ``monitor`` is the one given beside it at the top of the returned dict."""
    if not isinstance(scheduler, Mapping):
        scheduler = {"scheduler": scheduler}
    unknown = sorted(set(scheduler) - _KEYS)
    if unknown or "scheduler" not in scheduler:
        raise ConfigError(f"an lr_scheduler dict takes the keys {sorted(_KEYS)} and needs 'scheduler'; got "
                          f"{sorted(scheduler)}.")
    interval, frequency = scheduler.get("interval", "epoch"), scheduler.get("frequency", 1)
    if interval not in ("step", "epoch"):
        raise ConfigError(f"lr_scheduler interval {interval!r}: use 'step' or 'epoch'.")
    if isinstance(frequency, bool) or not isinstance(frequency, int) or frequency < 1:
        raise ConfigError(f"lr_scheduler frequency {frequency!r}: a whole number of at least 1 (steps or epochs "
                          "between two steps of the scheduler).")
    config = Scheduled(scheduler["scheduler"], interval, frequency, scheduler.get("monitor", monitor),
                       bool(scheduler.get("strict", True)), scheduler.get("name"))
    if scheduler.get("reduce_on_plateau") and not config.on_plateau:
        raise ConfigError("'reduce_on_plateau': True is for torch's ReduceLROnPlateau, which lockstep recognises "
                          f"itself; {type(config.scheduler).__name__} is stepped without a metric: drop the key.")
    if config.on_plateau and config.monitor is None:
        raise ConfigError("ReduceLROnPlateau steps with a metric: give its name in the lr_scheduler dict, "
                          "{'scheduler': ..., 'monitor': 'val_loss'} (or 'monitor' beside 'lr_scheduler').")
    return config
