"""Experiment trackers for real, offline: a wandb run file and an MLflow file store, read back."""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest

import lockstep
from checks import trainer as tc

pytestmark = pytest.mark.timeout(120)


def _wandb_records(path: Path):
    """The protobuf records of a ``.wandb`` run file (LevelDB log blocks of 32 KiB after a 7-byte header)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, parts = 7, 32768, b""
    while pos + 7 <= len(data):
        room = block - pos % block
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if room >= 7 else (0, 0, 0)
        if length == 0 and kind == 0:
            pos += room
            continue
        parts, pos = parts + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = pb.Record()
            record.ParseFromString(parts)
            parts = b""
            yield record


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def _fit(tmp_path, logger) -> lockstep.Trainer:
    trainer = tc.quiet_trainer(max_epochs=2, log_every_n_steps=2, loggers=[logger], checkpoint_dir=tmp_path / "ckpt")
    trainer.fit(tc.Classifier(), tc.checks.make_data(64), tc.checks.make_data(32, seed=1), batch_size=16)
    return trainer


def test_wandb_offline_run_holds_hyperparameters_metrics_by_step_and_the_checkpoint(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_SILENT", "true")
    trainer = _fit(tmp_path, lockstep.WandbLogger(project="t", save_dir=tmp_path, mode="offline", log_model=True))
    # run.finish() hands the records to wandb's service process, which writes the run file on its own time
    # (found 7 bytes long once in about 8 runs): its teardown, as at the process's exit, waits for the write.
    import wandb

    wandb.teardown()
    (run_file,) = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    history, config, summary, artifacts, kinds = {}, {}, {}, [], []
    for record in _wandb_records(run_file):
        kind = record.WhichOneof("record_type")
        kinds.append(kind)
        if kind == "history":
            row = {_key(item): json.loads(item.value_json) for item in record.history.item}
            history.setdefault(record.history.step.num, {}).update(row)
        elif kind == "run":
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "artifact":
            artifacts.append((record.artifact.type, sorted(entry.path for entry in record.artifact.manifest.contents)))
        elif kind == "summary":
            summary.update({_key(item): json.loads(item.value_json) for item in record.summary.update})
    assert [step for step, row in sorted(history.items()) if "train_loss" in row] == [2, 4, 6, 8], \
        _wandb_diagnosis(run_file, kinds, history, trainer)
    assert history[8]["val_acc"] == pytest.approx(trainer.callback_metrics["val_acc"])
    assert history[8]["train_loss_epoch"] == pytest.approx(trainer.callback_metrics["train_loss_epoch"])
    assert config["max_epochs"] == 2 and config["log_every_n_steps"] == 2
    assert summary["checkpoint_path"].endswith("epoch=2-step=00000008.ckpt")
    ((kind, files),) = artifacts
    assert kind == "model" and ".metadata" in files and any(f.endswith(".distcp") for f in files), files


def _wandb_diagnosis(run_file: Path, kinds: list[str], history: dict, trainer: lockstep.Trainer) -> str:
    """What the run file held, and the end of wandb's own logs: for a failure that happens once in many runs."""
    logs = "\n".join(f"--- {log.name} (end)\n" + "\n".join(log.read_text(errors="replace").splitlines()[-40:])
                     for log in sorted((run_file.parent / "logs").glob("*.log")))
    return (f"{run_file} ({run_file.stat().st_size} bytes): records {kinds}; history {history}; the Trainer's "
            f"metrics {trainer.callback_metrics}, step {trainer.global_step}\n{logs}")


def test_mlflow_file_store_holds_parameters_metrics_by_step_and_the_checkpoint_files(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch
    uri = (tmp_path / "mlruns").as_uri()
    trainer = _fit(tmp_path, lockstep.MLflowLogger(experiment="t", tracking_uri=uri, log_model=True))
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["max_epochs"] == "2"
    losses = client.get_metric_history(run.info.run_id, "train_loss")
    assert [m.step for m in losses] == [2, 4, 6, 8]
    (val_acc,) = client.get_metric_history(run.info.run_id, "val_acc")[-1:]
    assert val_acc.step == 8 and val_acc.value == pytest.approx(trainer.callback_metrics["val_acc"])
    checkpoint = Path(run.data.tags["checkpoint_path"])
    assert checkpoint.name == "epoch=2-step=00000008.ckpt"
    uploaded = {a.path for a in client.list_artifacts(run.info.run_id, f"checkpoints/{checkpoint.name}")}
    assert uploaded and all(p.startswith("checkpoints/") for p in uploaded)


def test_the_mlflow_string_spec_logs_to_a_sqlite_store_in_the_log_folder(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    trainer = tc.quiet_trainer(max_steps=2, log_every_n_steps=1, loggers=("mlflow",), log_dir=tmp_path)
    trainer.fit(tc.Classifier(), tc.checks.make_data(32), batch_size=16)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("lockstep").experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")] == [1, 2]


def _fit_and_resume(tmp_path, make_logger) -> None:
    """Two epochs, then a third resumed from the checkpoint, each with a new logger object."""
    for epochs in (2, 3):
        trainer = tc.quiet_trainer(max_epochs=epochs, log_every_n_steps=2, loggers=[make_logger()],
                                   checkpoint_dir=tmp_path / "ckpt", resume="auto")
        trainer.fit(tc.Classifier(), tc.checks.make_data(64), batch_size=16)


def test_wandb_without_a_key_runs_offline_in_the_log_folder_and_a_resume_continues_its_run(
        tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb")
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc, no wandb settings
    monkeypatch.setenv("WANDB_SILENT", "true")
    _fit_and_resume(tmp_path, lambda: lockstep.WandbLogger(project="t"))
    out = capsys.readouterr().out
    assert out.count("lockstep: no Weights & Biases API key") == 2, out
    runs = sorted((tmp_path / "ckpt" / "wandb").glob("offline-run-*"))  # the Trainer's log_dir
    ids = {re.match(r"offline-run-\d+_\d+-([a-z0-9]+)", run.name).group(1) for run in runs}
    assert len(runs) == 2 and len(ids) == 1  # the resumed fit continued the run id


def test_mlflow_resume_continues_the_checkpoints_run(tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    _fit_and_resume(tmp_path, lambda: lockstep.MLflowLogger(experiment="t", tracking_uri=uri))
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    assert run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")] == [2, 4, 6, 8, 10, 12]
    assert run.data.params["max_epochs"] == "2" and run.data.tags["resumed.max_epochs"] == "3"


def test_a_test_after_the_fit_logs_into_the_fits_run(tmp_path, monkeypatch):
    """As one Lightning run holds a fit and its test; before, each test (or validate) after a fit started a run
    of its own, without the fit's parameters."""
    pytest.importorskip("mlflow")
    pytest.importorskip("wandb")
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_SILENT", "true")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    trainer = _fit(tmp_path, lockstep.MLflowLogger(experiment="t", tracking_uri=uri))
    module = tc.Classifier()
    trainer.test(module, tc.checks.make_data(40, seed=2), batch_size=16)
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("t").experiment_id])
    assert run.info.status == "FINISHED" and run.data.params["max_epochs"] == "2"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")] == [2, 4, 6, 8]
    assert len(client.get_metric_history(run.info.run_id, "val_acc")) == 3  # 2 validations, then the test

    trainer = _fit(tmp_path / "w", lockstep.WandbLogger(project="t", save_dir=tmp_path / "w", mode="offline"))
    trainer.validate(module, tc.checks.make_data(40, seed=2), batch_size=16)
    runs = sorted((tmp_path / "w" / "wandb").glob("offline-run-*"))
    ids = {re.match(r"offline-run-\d+_\d+-([a-z0-9]+)", run.name).group(1) for run in runs}
    assert len(runs) == 2 and len(ids) == 1  # the validation reopened the fit's run (wandb writes it apart offline)


def test_tensorboard_and_csv_keep_the_steps_before_a_resume_once(tmp_path):
    import csv

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for epochs in (2, 3):
        trainer = tc.quiet_trainer(max_epochs=epochs, log_every_n_steps=2, loggers=("csv", "tensorboard"),
                                   checkpoint_dir=tmp_path, resume="auto")
        trainer.fit(tc.Classifier(), tc.checks.make_data(64), batch_size=16)
        if epochs == 2:  # as if the first run had gone on past its checkpoint before it died
            with open(tmp_path / "metrics.csv", "a") as handle:
                handle.write("10,99.0" + "," * (len(open(tmp_path / "metrics.csv").readline().split(",")) - 2) + "\n")
            later = lockstep.TensorBoardLogger(tmp_path)
            later.log_metrics({"train_loss": 99.0}, 10)
            later.finalize()

    rows = [(int(r["step"]), float(r["train_loss"])) for r in csv.DictReader(open(tmp_path / "metrics.csv"))
            if r.get("train_loss")]
    assert [step for step, _ in rows] == [2, 4, 6, 8, 10, 12] and 99.0 not in [v for _, v in rows]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    scalars = [(e.step, e.value) for e in events.Scalars("train_loss")]
    assert [step for step, _ in scalars] == [2, 4, 6, 8, 10, 12] and 99.0 not in [v for _, v in scalars]


class _SaveThenCrash(lockstep.Callback):
    """A checkpoint at step ``save`` (written at the batch's end: the epoch's end and its validation, which log
    values at the same step, come after it), then a crash at step ``crash``."""

    def __init__(self, folder: Path, save: int, crash: int) -> None:
        self.folder, self.save, self.crash = folder, save, crash

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.save:
            trainer.save_checkpoint(self.folder / "at-save")
        elif trainer.global_step == self.crash:
            raise RuntimeError("crash")


def test_a_resume_from_a_checkpoint_before_its_steps_later_values_logs_each_value_once(tmp_path):
    """A checkpoint at an epoch's last batch comes before that step's epoch values and validation: the run that
    went on past it had logged them, and the resumed run logs them again. CSV, JSON lines and TensorBoard then
    hold each value once, as the uninterrupted run's logs do (the checkpoint's own blocked time aside)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def fit(folder: Path, *callbacks, resume=None) -> None:
        trainer = tc.quiet_trainer(max_epochs=3, log_every_n_steps=2, loggers=("csv", "jsonl", "tensorboard"),
                                   log_dir=folder, callbacks=list(callbacks), resume=resume)
        trainer.fit(tc.Classifier(), tc.checks.make_data(64), tc.checks.make_data(16), batch_size=16)

    def logged(folder: Path) -> dict[str, list]:
        skip = {"step", "checkpoint_blocked_s"}
        rows = [{k: float(v) for k, v in row.items() if v and k not in skip} | {"step": int(row["step"])}
                for row in __import__("csv").DictReader(open(folder / "metrics.csv"))]
        records = [json.loads(line) for line in open(folder / "metrics.jsonl")]
        records = [{k: v for k, v in r.items() if k not in skip} | {"step": r["step"]} for r in records
                   if "hparams" not in r and set(r) - skip]
        events = EventAccumulator(str(folder / "tensorboard"))
        events.Reload()
        scalars = sorted((tag, e.step, e.value) for tag in events.Tags()["scalars"] if tag not in skip
                         for e in events.Scalars(tag))
        return {"csv": [r for r in rows if len(r) > 1], "jsonl": records, "tensorboard": scalars}

    fit(tmp_path / "whole")
    with pytest.raises(RuntimeError, match="crash"):
        fit(tmp_path / "cut", _SaveThenCrash(tmp_path, save=4, crash=6))
    fit(tmp_path / "cut", resume=str(tmp_path / "at-save"))
    whole, resumed = logged(tmp_path / "whole"), logged(tmp_path / "cut")
    assert [r["step"] for r in resumed["csv"]] == [r["step"] for r in whole["csv"]], resumed["csv"]
    for kind in ("csv", "jsonl"):
        assert len(resumed[kind]) == len(whole[kind]), (kind, resumed[kind])
        for mine, theirs in zip(resumed[kind], whole[kind], strict=True):
            assert mine.keys() == theirs.keys() and all(mine[k] == pytest.approx(theirs[k], rel=1e-6) for k in mine)
    assert [(tag, step) for tag, step, _ in resumed["tensorboard"]] == [(tag, step) for tag, step, _ in
                                                                          whole["tensorboard"]]
    assert [v for *_, v in resumed["tensorboard"]] == pytest.approx([v for *_, v in whole["tensorboard"]], rel=1e-6)


def test_tensorboard_resumed_at_a_step_it_logged_nothing_at_before_the_checkpoint_keeps_that_steps_values_once(
        tmp_path):
    """A checkpoint at step 10 whose newest logged step is 5: step 10's validation, logged after it by the run
    that went on, is discarded (the resumed run logs it again), and step 5's values stay."""
    import time

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    first = lockstep.TensorBoardLogger(tmp_path)
    first.log_metrics({"train_loss": 1.0}, 5)
    state = first.state_dict()  # the checkpoint of step 10
    first.log_metrics({"val_loss": 2.0}, 10)
    first.finalize()
    time.sleep(1.1)  # the next event file's name (its second) sorts after the first's
    resumed = lockstep.TensorBoardLogger(tmp_path)
    resumed.resume(10, state)
    resumed.log_metrics({"val_loss": 2.0}, 10)
    resumed.finalize()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("val_loss")] == [(10, 2.0)]
    assert [(e.step, e.value) for e in events.Scalars("train_loss")] == [(5, 1.0)]
