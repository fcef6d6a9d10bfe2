"""The Trainer against the runtime loop, single-process references, and its own promises."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest
import torch

import dist_checks as checks
import trainer_checks as tc
from lockstep.testing import run_ranks

pytestmark = pytest.mark.timeout(180)


def test_fit_on_2_processes_equals_the_runtime_loop():
    for fit, loop in run_ranks(lambda: (tc.fit_weights(), tc.runtime_loop_weights()), 2):
        assert (fit - loop).abs().max() <= 1e-6


def test_validation_accuracy_on_3_processes_equals_one_process():
    single = tc.validation_metrics()
    assert single["val_acc"] == pytest.approx(240 / 1001, abs=1e-7)  # a hand count of the same model
    for metrics in run_ranks(tc.validation_metrics, 3):
        assert abs(metrics["val_acc"] - single["val_acc"]) <= 1e-7
        assert abs(metrics["val_loss"] - single["val_loss"]) <= 1e-6


def test_predict_returns_every_sample_in_dataset_order():
    single = tc.predictions()
    assert single.shape == (1001, 4)
    for rows in run_ranks(tc.predictions, 3):
        assert rows.shape == (1001, 4)
        assert torch.allclose(rows, single, atol=1e-6)


def test_early_stopping_stops_every_rank_at_the_same_step():
    results = run_ranks(tc.early_stopping_step, 2, timeout=120)
    assert results[0] == results[1]
    steps, stopped_at, epochs = results[0]
    # 64 samples / global batch 16 = 4 steps per epoch; the first validation sets the best, the next two
    # do not improve (lr=0): patience 2 runs out after the third epoch
    assert stopped_at == steps == 3 * 4
    assert epochs == 3


def test_logging_does_no_host_sync_per_step():
    for counts in run_ranks(tc.count_host_syncs, 2):
        assert counts["steps"] == 100
        # three reductions (steps 50 and 100, the epoch end), each one name gather and one all-reduce:
        # a few syncs per reduction, none per step (100 steps would make at least 100)
        assert counts["all_reduce"] == 3 and counts["all_gather_object"] == 3, counts
        assert counts["item"] + counts["tolist"] <= 4 * 3, counts


def test_fit_on_one_process_equals_the_runtime_loop():
    assert torch.equal(tc.fit_weights(), tc.runtime_loop_weights())
    assert checks.flat_weights(tc.Classifier()).shape == tc.fit_weights().shape


def test_fit_needs_a_stop_condition_and_a_module():
    with pytest.raises(ValueError, match="fit needs a stopping rule: give the Trainer max_epochs or max_steps"):
        tc.quiet_trainer().fit(tc.Classifier(), checks.make_data(8), batch_size=4)
    with pytest.raises(TypeError, match="runs a lockstep.Module"):
        tc.quiet_trainer(max_epochs=1).fit(torch.nn.Linear(2, 2), checks.make_data(8), batch_size=4)


def test_accumulating_2_batches_of_8_equals_batches_of_16_on_2_processes():
    for difference in run_ranks(tc.accumulation_matches_big_batch, 2):
        assert difference <= 1e-6


def test_val_check_interval_validates_every_n_steps(tmp_path):
    trainer = tc.quiet_trainer(max_epochs=1, val_check_interval=2, loggers=("jsonl",), log_dir=tmp_path,
                               gradient_clip_val=0.5)
    trainer.fit(tc.Classifier(), tc.checks.make_data(96), tc.checks.make_data(20, seed=3), batch_size=16)
    import json

    steps = [r["step"] for r in map(json.loads, open(tmp_path / "metrics.jsonl")) if "val_acc" in r]
    assert steps == [2, 4, 6]


def test_16_mixed_trainer_runs_and_reports_finite_loss():
    trainer = tc.quiet_trainer(max_epochs=1, precision="16-mixed", log_every_n_steps=2)
    trainer.fit(tc.Classifier(), tc.checks.make_data(64), batch_size=16)
    assert 0 < trainer.callback_metrics["train_loss"] < 10


def test_resume_refuses_checkpoint_folders_that_the_ranks_do_not_share(tmp_path):
    for message in run_ranks(tc.resume_from_unshared_folders, 2, str(tmp_path)):
        assert "the ranks cannot resume from the same checkpoint" in message
        assert "rank 0 on" in message and ".ckpt (step 3)" in message
        assert "rank 1 on" in message and ": none" in message
        assert "file system that every node shares" in message


def test_a_two_process_fit_raises_no_warning(tmp_path):
    # Any FutureWarning or DeprecationWarning here would be lockstep's: the fit calls only lockstep.
    for rank_warnings in run_ranks(tc.warnings_of_a_fit, 2, str(tmp_path)):
        assert rank_warnings == []


def test_settings_are_one_frozen_config_that_reaches_the_logged_hparams(tmp_path):
    trainer = tc.quiet_trainer(max_steps=2, val_check_interval=1, timeout=30, num_workers=0, loggers=("csv",),
                               log_dir=tmp_path)
    with pytest.raises(RuntimeError, match="no Runtime yet"):
        trainer.runtime  # noqa: B018 - reading a property must not start processes or join a group
    assert trainer.is_global_zero
    module = tc.Classifier()
    trainer.fit(module, checks.make_data(32), checks.make_data(16), batch_size=8)
    logged = json.loads((tmp_path / "hparams.json").read_text())
    assert (logged["val_check_interval"], logged["timeout"], logged["num_workers"], logged["deterministic"]) == \
        (1, 30, 0, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        trainer.config.max_steps = 3  # type: ignore[misc]
    copied = pickle.loads(pickle.dumps(module))  # the module holds its Trainer weakly: copies leave it
    assert torch.equal(copied.net[0].weight, module.net[0].weight)
    with pytest.raises(RuntimeError, match="not attached"):
        copied.trainer  # noqa: B018


def test_metrics_of_mapping_batches_are_exact_over_the_dataset():
    module = tc.MappingBatches()
    data = checks.make_data(45)  # batches of 20, 20 and 5: a plain mean of batch means would be off
    loader = torch.utils.data.DataLoader(data, batch_size=20, collate_fn=tc.collate_to_mapping)
    metrics = tc.quiet_trainer(max_epochs=1).validate(module, loader)
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(module(data.tensors[0]), data.tensors[1])
    assert abs(metrics["val_loss"] - float(expected)) < 1e-6


# -- what a user gets told -------------------------------------------------------------------------
class _EmptyStream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(())


def test_empty_training_data_is_an_error_and_a_batch_larger_than_the_data_is_said(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"the training data \(TensorDataset\) holds no samples"):
        tc.quiet_trainer(max_epochs=1).fit(tc.Classifier(), checks.make_data(0), batch_size=8)
    with pytest.raises(ValueError, match="yielded no batch in epoch 1: an empty stream"):
        tc.quiet_trainer(max_steps=5).fit(tc.Classifier(), _EmptyStream(), batch_size=8)
    with pytest.raises(ValueError, match="drop_last=True drops the only batch"):
        tc.quiet_trainer(max_epochs=1).fit(tc.Classifier(), checks.make_data(5), batch_size=8,
                                           loader_options={"drop_last": True})
    assert not list(tmp_path.rglob("*.ckpt"))
    trainer = tc.quiet_trainer(max_epochs=2)
    trainer.fit(tc.Classifier(), checks.make_data(5), batch_size=8)
    assert "batch_size=8 is larger than the training data (5 samples): each epoch is one step of 5" in \
        capsys.readouterr().out
    assert trainer.global_step == 2


def test_a_resume_path_that_is_no_checkpoint_says_what_it_is(tmp_path):
    (tmp_path / "a-file").write_text("")
    (tmp_path / "a-folder").mkdir()
    cases = {"missing": "no such checkpoint", "a-file": "a file, not a checkpoint folder",
             "a-folder": r"not a lockstep checkpoint \(it holds no lockstep.json\)"}
    for name, message in cases.items():
        with pytest.raises(Exception, match=message) as raised:
            tc.quiet_trainer(max_epochs=1, resume=tmp_path / name).fit(tc.Classifier(), checks.make_data(8),
                                                                      batch_size=4)
        assert "rank" not in str(raised.value) and "file system" not in str(raised.value)


def test_early_stopping_on_train_loss_with_epochs_shorter_than_the_logging_interval():
    """Epochs of 2 steps, logging every 50: train_loss holds each epoch's value at its end, as
    train_loss_epoch, and EarlyStopping judges it per epoch when there is no validation."""
    stopper = tc.lockstep.EarlyStopping(monitor="train_loss", patience=2, min_delta=1e-5)
    trainer = tc.quiet_trainer(max_epochs=20, callbacks=[stopper])
    trainer.fit(tc.Classifier(lr=0.0), checks.make_data(16), batch_size=8)  # never improves
    assert trainer.callback_metrics["train_loss"] == trainer.callback_metrics["train_loss_epoch"]
    assert trainer.current_epoch == 3 and stopper.stopped_at_step == 6
