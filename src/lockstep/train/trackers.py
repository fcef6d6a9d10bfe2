"""Experiment-tracker loggers: Weights & Biases and MLflow (optional extras ``lockstep[wandb]``, ``lockstep[mlflow]``).

Like every logger they act on rank 0 only: the run is opened at the first call the Trainer makes
(the hyperparameters), so a script may build the logger on every rank and only rank 0 creates a
run. At the end of ``fit`` each gets the final checkpoint's path: recorded always, and uploaded as
an artifact with ``log_model=True`` (a checkpoint is a folder of shard files).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from lockstep.errors import MissingExtraError
from lockstep.train.loggers import plain_params as _plain


def _needs(package: str, extra: str) -> Any:
    try:
        return __import__(package)
    except ImportError as error:
        raise MissingExtraError(f"this logger needs {package}: pip install 'lockstep[{extra}]'") from error


class WandbLogger:
    """A Weights & Biases run: hyperparameters as its config, metrics by step, the checkpoint as a model artifact.

    ``mode="offline"`` writes the run under ``save_dir/wandb`` without a network (``wandb sync``
    uploads it later); by default wandb's own setting (``WANDB_MODE``) decides, and without an API
    key (``WANDB_API_KEY`` or ``wandb login``) the run is written offline, in one line saying so.
    ``save_dir`` defaults to the Trainer's ``log_dir``. Other keyword arguments go to
    ``wandb.init`` (``entity``, ``group``, ``tags``, ...).

    A resumed ``fit`` continues the checkpoint's wandb run (its id is saved in each checkpoint);
    wandb keeps what the run logged after the checkpoint and ignores the resumed run's values for
    those steps.
    """

    def __init__(self, project: str = "lockstep", name: str | None = None, save_dir: str | Path | None = None,
                 mode: str | None = None, log_model: bool = False, **init_kwargs: Any) -> None:
        _needs("wandb", "wandb")
        self.project, self.name, self.mode = project, name, mode
        self.save_dir = Path(save_dir) if save_dir is not None else None
        self.log_model, self.init_kwargs = log_model, init_kwargs
        self.run: Any = None
        self.run_id: str | None = None  # kept once the run finished: what is logged later (a test after the fit)
        # reopens it, as one Lightning run holds a fit and its test

    def default_dir(self, folder: Path) -> None:
        """The Trainer's ``log_dir``, where ``save_dir`` was not given."""
        if self.save_dir is None:
            self.save_dir = folder

    def state_dict(self) -> dict[str, Any]:
        return {"id": self.run_id} if self.run_id is not None else {}

    def resume(self, step: int, state: dict[str, Any] | None) -> None:
        if state and isinstance(state.get("id"), str) and "id" not in self.init_kwargs:
            self.init_kwargs.update(id=state["id"], resume="allow")

    def _start(self, config: dict[str, Any] | None = None) -> Any:
        if self.run is None:
            import wandb

            folder = self.save_dir or Path("runs/lockstep")
            folder.mkdir(parents=True, exist_ok=True)
            again = {"id": self.run_id, "resume": "allow"} if self.run_id is not None else {}
            options: dict[str, Any] = {"project": self.project, "name": self.name, "dir": str(folder),
                                       "config": config, **self.init_kwargs, **again}
            try:
                self.run = wandb.init(**{"mode": self.mode, **options})
            except wandb.errors.UsageError as error:
                if self.mode is not None or os.environ.get("WANDB_MODE") or "api key" not in str(error).lower():
                    raise
                print(f"lockstep: no Weights & Biases API key (set WANDB_API_KEY or run `wandb login`): the run is "
                      f"written offline under {folder / 'wandb'}; `wandb sync` uploads it.", flush=True)
                self.run = wandb.init(**{"mode": "offline", **options})
            self.run_id = self.run.id
        return self.run

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        if self.run is None:
            self._start(_plain(params))
        else:
            self.run.config.update(_plain(params), allow_val_change=True)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self._start().log(dict(metrics), step=step)

    def log_checkpoint(self, path: Path) -> None:
        run = self._start()
        run.summary["checkpoint_path"] = str(path)
        if self.log_model:
            import wandb

            artifact = wandb.Artifact(f"model-{run.id}", type="model", metadata={"path": str(path)})
            artifact.add_dir(str(path)) if path.is_dir() else artifact.add_file(str(path))
            run.log_artifact(artifact, aliases=["latest"])

    def finalize(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


class MLflowLogger:
    """An MLflow run: parameters, metrics by step, the checkpoint path as a tag (and files with ``log_model``).

    ``tracking_uri`` defaults to MLflow's own setting (``MLFLOW_TRACKING_URI``); for a local store
    give ``"sqlite:////path/to/mlflow.db"``, or ``"file:/path/to/mlruns"`` (MLflow 3 wants
    ``MLFLOW_ALLOW_FILE_STORE=true`` for that). It talks to MLflow through ``MlflowClient``, so it
    touches no global MLflow state (an active run of the script stays untouched).
    """

    def __init__(self, experiment: str = "lockstep", run_name: str | None = None, tracking_uri: str | None = None,
                 log_model: bool = False, tags: dict[str, str] | None = None) -> None:
        _needs("mlflow", "mlflow")
        self.experiment, self.run_name, self.tracking_uri = experiment, run_name, tracking_uri
        self.log_model, self.tags = log_model, dict(tags or {})
        self.client: Any = None
        self.run_id: str | None = None
        self._open = False  # the run finished (finalize): what is logged later (a test after the fit) reopens it

    def state_dict(self) -> dict[str, Any]:
        return {"run_id": self.run_id} if self.run_id is not None else {}

    def resume(self, step: int, state: dict[str, Any] | None) -> None:
        """Continue the checkpoint's run (MLflow keeps every value logged, also those after the
        checkpoint: the resumed run logs those steps again)."""
        run_id = state.get("run_id") if state else None
        if self.run_id is not None or not isinstance(run_id, str):
            return
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=self.tracking_uri)
        try:
            client.get_run(run_id)
        except Exception as error:  # noqa: BLE001 - MLflow raises its own errors for a run it does not hold
            print(f"lockstep: MLflow run {run_id} of the checkpoint is not in this tracking store ({error}); "
                  "a new run is started.", flush=True)
            return
        client.update_run(run_id, status="RUNNING")
        self.client, self.run_id, self._open = client, run_id, True

    def _start(self) -> str:
        if self.run_id is None:
            from mlflow.tracking import MlflowClient

            self.client = MlflowClient(tracking_uri=self.tracking_uri)
            found = self.client.get_experiment_by_name(self.experiment)
            experiment_id = found.experiment_id if found is not None else self.client.create_experiment(self.experiment)
            run = self.client.create_run(experiment_id, run_name=self.run_name, tags=self.tags)
            self.run_id, self._open = run.info.run_id, True
        elif not self._open:
            self.client.update_run(self.run_id, status="RUNNING")
            self._open = True
        return self.run_id

    def log_hyperparams(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        run_id = self._start()
        values = {k: str(v)[:6000] for k, v in _plain(params).items()}
        # A resumed run keeps its parameters (MLflow never changes one): a changed value becomes a tag.
        logged = self.client.get_run(run_id).data.params
        for key in [k for k in values if k in logged]:
            if logged[key] != values[key]:
                self.client.set_tag(run_id, f"resumed.{key}", values[key])
            del values[key]
        self.client.log_batch(run_id, params=[Param(k, v) for k, v in values.items()])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        run_id, now = self._start(), int(time.time() * 1000)
        self.client.log_batch(run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    def log_checkpoint(self, path: Path) -> None:
        run_id = self._start()
        self.client.set_tag(run_id, "checkpoint_path", str(path))
        if self.log_model:
            if path.is_dir():
                self.client.log_artifacts(run_id, str(path), artifact_path=f"checkpoints/{path.name}")
            else:
                self.client.log_artifact(run_id, str(path), artifact_path="checkpoints")

    def finalize(self) -> None:
        if self.run_id is not None and self._open:
            self.client.set_terminated(self.run_id)
            self._open = False
