"""The rank-0 progress bar (rich) and the throughput monitor."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from lockstep.train.callbacks import Callback

if TYPE_CHECKING:
    from lockstep.train.module import Module
    from lockstep.train.trainer import Trainer


class ThroughputMonitor(Callback):
    """Samples/s, step time and the fraction of step time spent waiting for data, every logging step.

    Cheap: it reads clocks the Trainer already keeps. When the data wait passes ``advise_above``,
    rank 0 prints its advice once.
    """

    def __init__(self, advise_above: float = 0.2) -> None:
        self.advise_above = advise_above
        self.advised = False
        self._mark: tuple[float, int, float, float] | None = None

    def on_train_start(self, trainer: Trainer, module: Module) -> None:
        self._mark = None

    def on_train_batch_end(self, trainer: Trainer, module: Module, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not (trainer.at_step_boundary and trainer.is_logging_step):
            return
        now, samples, wait = time.perf_counter(), trainer.samples_seen, trainer.data_wait_s
        if self._mark is not None:
            then, samples_then, wait_then, steps_then = self._mark
            elapsed = now - then
            steps = trainer.global_step - steps_then
            if elapsed > 0 and steps > 0:
                fraction = (wait - wait_then) / elapsed
                trainer.log_metrics({"samples_per_s": (samples - samples_then) / elapsed,
                                     "step_time_s": elapsed / steps, "data_wait_fraction": fraction})
                if fraction > self.advise_above and not self.advised:
                    self.advised = True
                    trainer.runtime.print(
                        f"lockstep: {fraction:.0%} of step time is spent waiting for data. Raise num_workers "
                        "(Trainer(num_workers=...)), enable pin_memory on GPUs, or make __getitem__ cheaper.")
        self._mark = (now, samples, wait, trainer.global_step)


class ProgressBar(Callback):
    """Rank 0's progress: a rich bar in a terminal, one plain line per epoch in logs.

    Epochs count from 1 (``epoch 3/10``), as in the lines scripts print. While an epoch runs the
    bar shows the last logging window's values; when it ends, the epoch's own values (the
    ``*_epoch`` metrics, the same numbers the loggers write) and the latest validation. Without a
    terminal (output to a file or pipe) nothing is redrawn: each epoch's line is printed when the
    epoch ends, so it sits in order with everything else the script prints.
    """

    def __init__(self) -> None:
        self._progress: Any = None
        self._task: Any = None
        self._live: bool | None = None

    @staticmethod
    def epoch_label(trainer: Trainer) -> str:
        total = trainer.config.max_epochs
        return f"epoch {trainer.current_epoch + 1}" + (f"/{total}" if total is not None else "")

    def on_train_epoch_start(self, trainer: Trainer, module: Module) -> None:
        if not trainer.is_global_zero:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        if self._live is None:
            self._live = Console().is_terminal
        if not self._live:
            return
        if self._progress is None:
            self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeRemainingColumn(), TextColumn("{task.fields[stats]}"))
            self._progress.start()
        self._task = self._progress.add_task(self.epoch_label(trainer), total=trainer.steps_per_epoch, stats="")
        self._progress.update(self._task, completed=trainer.batches_done_in_epoch)

    def on_train_batch_end(self, trainer: Trainer, module: Module, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._progress is None:
            return
        fields = {}
        if trainer.is_logging_step:
            shown = {k: v for k, v in trainer.callback_metrics.items() if k in trainer.progress_bar_metrics}
            if "samples_per_s" in trainer.callback_metrics:
                shown["samples_per_s"] = trainer.callback_metrics["samples_per_s"]
            fields["stats"] = _stats(shown)
        self._progress.update(self._task, advance=1, **fields)

    def on_train_epoch_end(self, trainer: Trainer, module: Module) -> None:
        if not trainer.is_global_zero:
            return
        metrics = trainer.callback_metrics
        shown = {name: metrics.get(f"{name}_epoch", metrics.get(name)) for name in sorted(trainer.progress_bar_metrics)}
        stats = _stats({k: v for k, v in shown.items() if v is not None})
        if self._progress is not None:
            self._progress.update(self._task, stats=stats)
        elif self._live is False:
            steps = trainer.batches_done_in_epoch
            print(f"{self.epoch_label(trainer)}  {steps}/{trainer.steps_per_epoch or '?'} batches  {stats}", flush=True)

    def on_train_end(self, trainer: Trainer, module: Module) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def on_exception(self, trainer: Trainer, module: Module, exception: BaseException) -> None:
        self.on_train_end(trainer, module)


def _stats(values: dict[str, float]) -> str:
    return "  ".join(f"{k} {v:.4g}" for k, v in values.items())
