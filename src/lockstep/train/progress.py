"""The rank-0 progress bar (rich) and the throughput monitor."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from lockstep.runtime import FlopCount
from lockstep.train.callbacks import Callback
from lockstep.train.flops import mfu, peak_flops

if TYPE_CHECKING:
    from lockstep.train.module import Module
    from lockstep.train.trainer import Trainer


class ThroughputMonitor(Callback):
    """Samples/s, items/s (the ``num_items`` a ``training_step`` returns, e.g. tokens), step time, the
    fraction of step time spent waiting for data and, where the peak is known, MFU (model FLOPs
    utilisation), every logging step.

    Cheap: it reads clocks the Trainer already keeps, and counts FLOPs once, over the forward of the
    first training batch (``lockstep.train.flops``), unless the module gives ``flops_per_sample``.
    Model FLOPs are three times the forward's (the backward's products are twice the forward's),
    so work recomputed in the backward (activation checkpointing, flash attention) is not counted:
    MFU, not hardware utilisation, comparable with 6 × parameters per token. When the data
    wait passes ``advise_above``, rank 0 prints its advice once.
    """

    def __init__(self, advise_above: float = 0.2) -> None:
        self.advise_above = advise_above
        self.advised = False
        self._mark: tuple[float, int, float, int, float] | None = None
        self._paused = 0.0  # seconds between the fit's epochs (their ends' saves, the next epoch's start)
        self._left_epoch: float | None = None
        self._items_then = 0.0
        self.flops_per_sample: float | None = None
        self._peak: float | None = None
        self._refused_mfu = False

    def on_train_start(self, trainer: Trainer, module: Module) -> None:
        self._mark, self._items_then, self._left_epoch = None, 0.0, None
        given = getattr(module, "flops_per_sample", None)
        self.flops_per_sample = float(given() if callable(given) else given) if given is not None else None
        self._peak = peak_flops(trainer.runtime.device, trainer.runtime.precision.name)
        # A failed fit's counter of this monitor stops and leaves (another monitor's stays: it counts for that one).
        for stale in [c for c in trainer.callbacks if isinstance(c, _FirstForwardFlops) and c.monitor is self]:
            stale.stop()
            trainer.callbacks.remove(stale)
        if self.flops_per_sample is None and self._peak is not None:
            trainer.callbacks.append(_FirstForwardFlops(self))

    def on_train_epoch_end(self, trainer: Trainer, module: Module) -> None:
        self._left_epoch = time.perf_counter()  # after the epoch's validation, before the checkpoints' saves

    def on_train_epoch_start(self, trainer: Trainer, module: Module) -> None:
        if self._left_epoch is not None:
            self._paused += time.perf_counter() - self._left_epoch
            self._left_epoch = None

    def on_train_log(self, trainer: Trainer, module: Module) -> None:
        """The rates since the last logging step, over the training time alone: validations (with the saves
        their hooks make) and the time between epochs are left out, as Lightning's monitor leaves them."""
        now, samples, wait = time.perf_counter(), trainer.samples_seen, trainer.data_wait_s
        away = self._paused + trainer.evaluation.seconds_in_fit
        elapsed = now - self._mark[0] - (away - self._mark[4]) if self._mark is not None else 0.0  # training time
        items = self._items_per_s(trainer, elapsed)  # every rank
        if self._mark is not None:
            _, samples_then, wait_then, steps_then, _ = self._mark
            steps = trainer.global_step - steps_then
            if elapsed > 0 and steps > 0:
                fraction = (wait - wait_then) / elapsed
                rate = (samples - samples_then) / elapsed
                trainer.log_metrics({"samples_per_s": rate, **items,
                                     "step_time_s": elapsed / steps, "data_wait_fraction": fraction,
                                     **self._mfu(trainer, rate)})
                if fraction > self.advise_above and not self.advised:
                    self.advised = True
                    trainer.runtime.print(
                        f"lockstep: {fraction:.0%} of step time is spent waiting for data. Raise num_workers "
                        "(Trainer(num_workers=...)), enable pin_memory on GPUs, or make __getitem__ cheaper.")
        self._mark = (now, samples, wait, trainer.global_step, away)
        self._log_stragglers(trainer)

    @staticmethod
    def _log_stragglers(trainer: Trainer) -> None:
        """Rank 0's straggler view (``rt.step_times()``), to its loggers only: known on rank 0 alone, so
        never a callback metric that the ranks could disagree on."""
        report = trainer.runtime.step_times() if trainer.is_global_zero and trainer.loggers else {}
        values = {k: float(v) for k, v in report.items() if k.startswith("step_time/")}
        if values:
            for logger in trainer.loggers:
                logger.log_metrics(values, trainer.global_step)

    def _items_per_s(self, trainer: Trainer, elapsed: float) -> dict[str, float]:
        """The items (``num_items``: tokens, say) of every data-parallel rank per second since the last
        mark; one all-reduce per logging step, when the module gives ``num_items``."""
        local = trainer.recorder.items_seen_local
        if local is None:
            return {}
        rt = trainer.runtime
        total = float(rt.all_reduce(local.clone(), op="sum")) / rt.tensor_parallel_size
        then, self._items_then = self._items_then, total
        return {"items_per_s": (total - then) / elapsed} if elapsed > 0 else {}

    def _mfu(self, trainer: Trainer, samples_per_s: float) -> dict[str, float]:
        if self.flops_per_sample is None or self._peak is None:
            return {}
        value = mfu(self.flops_per_sample, samples_per_s, self._peak, trainer.runtime.world_size)
        if value is None and not self._refused_mfu:
            self._refused_mfu = True
            trainer.runtime.print(
                f"lockstep: {self.flops_per_sample:.3g} FLOPs per sample at {samples_per_s:.3g} samples/s would use "
                f"more than the devices' peak ({self._peak:.3g} FLOP/s each): the FLOP count or the peak is wrong, "
                "so no MFU is reported. Set LOCKSTEP_PEAK_FLOPS, or give the module a flops_per_sample.")
        return {"mfu": value} if value is not None else {}


class _FirstForwardFlops(Callback):
    """Counts the FLOPs of the first training batch's forward for the monitor, then leaves the Trainer's
    callbacks: the steps after it call no hook of its (a per-step cost of the monitor otherwise)."""

    def __init__(self, monitor: ThroughputMonitor) -> None:
        self.monitor = monitor
        self._counting: FlopCount | None = None

    def on_train_batch_start(self, trainer: Trainer, module: Module, batch: Any, batch_idx: int) -> None:
        if self._counting is None:  # a pipeline batch of a step not taken (fault tolerance) ends without its end
            rt = trainer.runtime
            self._counting = FlopCount(tp=rt.tensor_parallel_size, cp=rt.context_parallel_size)
            self._counting.start()

    def on_before_backward(self, trainer: Trainer, module: Module, loss: Any) -> None:
        self._counted(trainer)

    def on_train_batch_end(self, trainer: Trainer, module: Module, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._counted(trainer)  # pipeline stages have no on_before_backward: the batch's end stops the count

    def on_exception(self, trainer: Trainer, module: Module, error: BaseException) -> None:
        self.stop()  # a batch that raised: what ran after it (another fit) is neither counted nor eager

    def stop(self) -> int | None:
        """End the count (torch's counting mode, eager compiled regions), if it runs: the FLOPs counted."""
        counting, self._counting = self._counting, None
        return counting.stop() if counting is not None else None

    def _counted(self, trainer: Trainer) -> None:
        flops = self.stop()
        if flops is not None:
            rows = trainer.local_batch_samples
            self.monitor.flops_per_sample = 3 * flops / rows if rows else None
            trainer.callbacks.remove(self)


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
        if self._progress is not None:
            self._progress.update(self._task, advance=1)

    def on_train_log(self, trainer: Trainer, module: Module) -> None:
        """The logging step's values, once logged (after its batch's end)."""
        if self._progress is None:
            return
        shown = {k: v for k, v in trainer.callback_metrics.items() if k in trainer.progress_bar_metrics}
        if "samples_per_s" in trainer.callback_metrics:
            shown["samples_per_s"] = trainer.callback_metrics["samples_per_s"]
        self._progress.update(self._task, stats=_stats(shown))

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
