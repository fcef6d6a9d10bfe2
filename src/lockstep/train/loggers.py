"""Metric loggers. The Trainer creates them on rank 0 only; other ranks log nothing."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any, Protocol


class Logger(Protocol):
    """What the Trainer calls on rank 0. A logger may also define ``log_checkpoint(path)``: the end of
    ``fit`` passes it the final checkpoint (the best one kept by ``ModelCheckpoint``)."""

    def log_hyperparams(self, params: dict[str, Any]) -> None: ...
    def log_metrics(self, metrics: dict[str, float], step: int) -> None: ...
    def finalize(self) -> None: ...


def plain_params(params: dict[str, Any]) -> dict[str, Any]:
    return {k: v if isinstance(v, (int, float, str, bool)) or v is None else str(v) for k, v in params.items()}


class CSVLogger:
    """``metrics.csv`` (one row per logging call; columns grow as metrics appear) and ``hparams.json``."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.path = self.folder / "metrics.csv"
        self.rows: list[dict[str, Any]] = []
        self.columns: list[str] = ["step"]

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        (self.folder / "hparams.json").write_text(json.dumps(plain_params(params), indent=2))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.rows.append({"step": step, **metrics})
        new = [k for k in metrics if k not in self.columns]
        if new or not self.path.exists():
            self.columns += new
            with open(self.path, "w", newline="") as handle:  # a new column: rewrite with the wider header
                writer = csv.DictWriter(handle, fieldnames=self.columns)
                writer.writeheader()
                writer.writerows(self.rows)
        else:
            with open(self.path, "a", newline="") as handle:
                csv.DictWriter(handle, fieldnames=self.columns).writerow(self.rows[-1])

    def finalize(self) -> None:
        return None


class JSONLinesLogger:
    """``metrics.jsonl``: one JSON object per logging call; the first line holds the hyperparameters."""

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")

    def _write(self, record: dict[str, Any]) -> None:
        with open(self.path, "a") as handle:
            handle.write(json.dumps(record) + "\n")

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self._write({"hparams": plain_params(params)})

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._write({"step": step, **metrics})

    def finalize(self) -> None:
        return None


class TensorBoardLogger:
    """TensorBoard event files (through the tensorboard package) under ``folder/tensorboard``."""

    def __init__(self, folder: str | Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(Path(folder) / "tensorboard"))

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        self.writer.add_text("hparams", json.dumps(plain_params(params), indent=2))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=step)

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


def make_loggers(specs: Any, folder: Path) -> list[Logger]:
    made: list[Logger] = []
    for spec in specs:
        if isinstance(spec, str):
            if spec not in LOGGERS:
                raise ValueError(f"unknown logger {spec!r}: use one of {', '.join(LOGGERS)} or a logger object.")
            made.append(LOGGERS[spec](folder))
        else:
            made.append(spec)
    return made
