"""Metric loggers. The Trainer creates them on rank 0 only; other ranks log nothing."""

from __future__ import annotations

import contextlib
import csv
import json
import os
from pathlib import Path
from typing import Any, Protocol

from lockstep.errors import ConfigError


class Logger(Protocol):
    """What the Trainer calls on rank 0. A logger may also define:

    - ``log_checkpoint(path)``: the end of ``fit`` passes it the final checkpoint (the best one kept
      by ``ModelCheckpoint``);
    - ``state_dict()``: saved in each checkpoint (a tracker's run id);
    - ``resume(step, state)``: called after a resume, before anything is logged, with the step the
      checkpoint was written at and the saved ``state_dict()`` (None if there was none): continue
      the run, and drop what was logged after ``step`` (the resumed run logs it again).
    """

    def log_hyperparams(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def finalize(self) -> None: ...


def plain_params(params: dict[str, Any]) -> dict[str, Any]:
    return {k: v if isinstance(v, (int, float, str, bool)) or v is None else str(v) for k, v in params.items()}


class CSVLogger:
    """``metrics.csv`` (one row per step; columns grow as metrics appear) and ``hparams.json``."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / "metrics.csv"
        self.rows: list[dict[str, Any]] = []
        self.columns: list[str] = ["step"]
        self._last_row_at = 0  # the byte offset of the file's last row

    def state_dict(self) -> dict[str, Any]:
        """The rows written, and the last one as it stands: values its step may still log after a checkpoint (an
        epoch's end, a validation) are not the checkpoint's, and the resumed run logs them again."""
        return {"rows": len(self.rows), "last": dict(self.rows[-1]) if self.rows else None}

    def resume(self, step: int, state: dict[str, Any] | None) -> None:
        """Keep the rows of ``metrics.csv`` written at the checkpoint (``state``; without one, those up to
        ``step``); a row that cannot be read ends what is kept."""
        kept, last = _saved_records(state, "rows"), state.get("last") if state else None
        self.rows, self.columns = [], ["step"]
        with contextlib.suppress(OSError, csv.Error, UnicodeDecodeError):
            with open(self.path, newline="") as handle:
                reader = csv.DictReader(handle)
                self.columns = [c for c in reader.fieldnames or [] if c] or ["step"]
                for row in reader:
                    if (len(self.rows) >= kept) if kept is not None else not _up_to(row, step):
                        break
                    self.rows.append({k: v for k, v in row.items() if k in self.columns})
        if kept and len(self.rows) == kept and isinstance(last, dict) and _up_to(last, step):
            self.rows[-1] = {k: v for k, v in last.items() if k in self.columns}  # as it stood at the checkpoint
        self._rewrite()

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        (self.folder / "hparams.json").write_text(json.dumps(plain_params(params), indent=2))

    def _rewrite(self) -> None:
        with open(self.path, "w", newline="") as handle:  # the header names every column
            writer = csv.DictWriter(handle, fieldnames=self.columns)
            writer.writeheader()
            writer.writerows(self.rows[:-1])
            self._last_row_at = handle.tell()  # where the last row starts: its step may log more values
            writer.writerows(self.rows[-1:])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        last = self.rows[-1] if self.rows else None
        merge = last is not None and str(last["step"]) == str(step) and not set(metrics) & set(last)
        if merge:  # more values of the step just logged (an epoch's end, validation): the same row
            assert last is not None
            last.update(metrics)
        else:
            self.rows.append({"step": step, **metrics})
        new = [k for k in metrics if k not in self.columns]
        if new or not self.path.exists():
            self.columns += new
            self._rewrite()  # a new column: the header widens
            return
        with open(self.path, "r+" if merge else "a", newline="") as handle:
            if merge:  # the step's row is the file's last line: write it anew
                handle.seek(self._last_row_at)
                handle.truncate()
            else:
                handle.seek(0, os.SEEK_END)
                self._last_row_at = handle.tell()
            csv.DictWriter(handle, fieldnames=self.columns).writerow(self.rows[-1])

    def finalize(self) -> None:
        return None


class JSONLinesLogger:
    """``metrics.jsonl``: one JSON object per logging call; the first line holds the hyperparameters."""

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.previous = self.path.read_text(errors="replace") if self.path.is_file() else ""  # for resume
        self.path.write_text("")
        self.records = 0  # the records of metrics in the file

    def state_dict(self) -> dict[str, Any]:
        return {"records": self.records}

    def resume(self, step: int, state: dict[str, Any] | None) -> None:
        """Keep the hyperparameter lines and the records written at the checkpoint (``state``; without one,
        those up to ``step``); an unreadable line ends what is kept."""
        wanted, kept = _saved_records(state, "records"), []
        self.records = 0
        for line in self.previous.splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                break
            if not isinstance(record, dict):
                break
            if "hparams" not in record:
                if (self.records >= wanted) if wanted is not None else not _up_to(record, step):
                    break
                self.records += 1
            kept.append(line + "\n")
        self.path.write_text("".join(kept))

    def _write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self._write({"hparams": plain_params(params)})

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._write({"step": step, **metrics})
        self.records += 1

    def finalize(self) -> None:
        return None


class TensorBoardLogger:
    """TensorBoard event files (through the tensorboard package) under ``folder/tensorboard``."""

    def __init__(self, folder: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.folder = Path(folder) / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.folder))
        self.resumed = False
        self.newest: tuple[int, dict[str, float]] = (-1, {})  # the newest step logged, and its values so far

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.newest[0], "values": dict(self.newest[1])}

    def resume(self, step: int, state: dict[str, Any] | None) -> None:
        """TensorBoard discards the events of the earlier run from ``step`` on (its ``purge_step``): those of
        ``step`` logged after the checkpoint would come twice. Those logged before it (``state``) are written
        again."""
        from torch.utils.tensorboard import SummaryWriter

        kept = state.get("values") if isinstance(state, dict) else None  # None: a checkpoint from before it was kept
        saved = kept if isinstance(kept, dict) and state.get("step") == step else None  # type: ignore[union-attr]
        self.writer.close()
        self.writer = SummaryWriter(log_dir=str(self.folder), purge_step=step if isinstance(kept, dict) else step + 1)
        self.resumed = True
        if saved is not None:
            self.log_metrics({k: v for k, v in saved.items() if isinstance(k, str) and isinstance(v, (int, float))},
                             step)

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        if not self.resumed:  # again, at step 0 after later steps, it would make TensorBoard drop them all
            self.writer.add_text("hparams", json.dumps(plain_params(params), indent=2))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=step)
        newest = self.newest[1] if self.newest[0] == step else {}
        self.newest = (step, {**newest, **metrics})

    def finalize(self) -> None:
        self.writer.flush()
        self.writer.close()


def _wandb(folder: Path) -> Logger:
    from lockstep.train.trackers import WandbLogger

    return WandbLogger(save_dir=folder)


def _mlflow(folder: Path) -> Logger:
    """MLflow's own tracking URI when set (``MLFLOW_TRACKING_URI``), else a SQLite store ``folder/mlflow.db``."""
    from lockstep.train.trackers import MLflowLogger

    folder.mkdir(parents=True, exist_ok=True)
    uri = None if os.environ.get("MLFLOW_TRACKING_URI") else f"sqlite:///{(folder / 'mlflow.db').resolve()}"
    return MLflowLogger(tracking_uri=uri)


LOGGERS: dict[str, Any] = {"csv": CSVLogger, "jsonl": JSONLinesLogger, "tensorboard": TensorBoardLogger,
                           "wandb": _wandb, "mlflow": _mlflow}


def _up_to(record: dict[str, Any], step: int) -> bool:
    """Whether ``record`` (a row read back) was logged at ``step`` or before; False if it names no step."""
    try:
        return int(record["step"]) <= step
    except (KeyError, TypeError, ValueError):
        return False


def _saved_records(state: dict[str, Any] | None, key: str) -> int | None:
    """How many records a logger had written at the checkpoint (its saved ``key``), or None without one."""
    count = state.get(key) if isinstance(state, dict) else None
    return count if type(count) is int and count >= 0 else None


def resume_loggers(loggers: list[Logger], saved: list[dict[str, Any]], step: int) -> None:
    """Continue each logger after a resume at ``step``, with its saved state when the checkpoint has
    one for a logger of its type (matched in order)."""
    states: dict[str, list[Any]] = {}
    for entry in saved:
        if isinstance(entry, dict) and isinstance(entry.get("type"), str):
            states.setdefault(entry["type"], []).append(entry.get("state"))
    for logger in loggers:
        mine = states.get(type(logger).__name__)
        state = mine.pop(0) if mine else None
        resume = getattr(logger, "resume", None)
        if callable(resume):
            resume(step, state if isinstance(state, dict) else None)


def make_loggers(specs: Any, folder: Path) -> list[Logger]:
    if isinstance(specs, str):  # loggers="csv": one logger, not its letters
        specs = [specs]
    made: list[Logger] = []
    for spec in specs:
        if isinstance(spec, str):
            if spec not in LOGGERS:
                raise ConfigError(f"unknown logger {spec!r}: use one of {', '.join(LOGGERS)} or a logger object.")
            made.append(LOGGERS[spec](folder))
        else:
            default_dir = getattr(spec, "default_dir", None)
            if callable(default_dir):  # a logger object whose folder was left to the Trainer
                default_dir(folder)
            made.append(spec)
    return made
