"""The Trainer against the runtime loop, single-process references, and its own promises."""

from __future__ import annotations

import pytest
import torch

from checks import trainer as tc
from lockstep.testing import run_ranks

pytestmark = pytest.mark.timeout(180)


def test_fit_on_2_processes_equals_the_runtime_loop():
    for fit, loop in run_ranks(lambda: (tc.fit_weights(), tc.runtime_loop_weights()), 2):
        assert (fit - loop).abs().max() <= 1e-6


def test_a_fit_on_3_processes_which_do_not_divide_its_global_batch_of_16_equals_one_process():
    single = tc.fit_weights()  # 103 samples: batches split 6+5+5, the last (7) 3+2+2
    for weights in run_ranks(tc.fit_weights, 3):
        assert (weights - single).abs().max() <= 1e-5


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
        # three reductions (steps 50 and 100, the epoch end), each one all-reduce; the names are gathered
        # at the first reduction of the window and of the epoch sums only (the second window reduction
        # finds them agreed), the dataset's length once, when the training loader is made, and the ranks'
        # seeds and layouts once each, when the Runtime is made, the Trainer's settings once: a few syncs per
        # reduction, none per step (100 steps would make at least 100)
        assert counts["all_reduce"] == 3 and counts["all_gather_object"] == 6, counts
        assert counts["item"] + counts["tolist"] <= 4 * 3, counts


def test_accumulating_2_batches_of_8_equals_batches_of_16_on_2_processes():
    for difference in run_ranks(tc.accumulation_matches_big_batch, 2):
        assert difference <= 1e-6


def test_resume_refuses_checkpoint_folders_that_the_ranks_do_not_share(tmp_path):
    for message in run_ranks(tc.resume_from_unshared_folders, 2, str(tmp_path)):
        assert "the ranks cannot resume from the same checkpoint" in message
        assert "rank 0 on" in message and ".ckpt (step 4)" in message  # the fit's final step
        assert "rank 1 on" in message and ": none" in message
        assert "file system that every node shares" in message


def test_a_fit_given_other_settings_on_each_rank_is_refused_at_once():
    # else rank 0 ends after 4 steps and rank 1 waits in its fifth step's all-reduce until the timeout
    for message in run_ranks(tc.fit_with_settings_by_rank, 2, timeout=60):
        assert "different Trainer settings" in message
        assert "max_steps is 4 on rank 0, 6 on rank 1" in message
        assert "gradient_clip_val is None on rank 0, 1.0 on rank 1" in message
        assert "accumulate_grad_batches" not in message  # the same on both


def test_a_two_process_fit_raises_no_warning(tmp_path):
    # Any FutureWarning or DeprecationWarning here would be lockstep's: the fit calls only lockstep.
    for rank_warnings in run_ranks(tc.warnings_of_a_fit, 2, str(tmp_path)):
        assert rank_warnings == []



def test_logged_values_reduce_to_sample_weighted_means_whether_or_not_the_ranks_logged_the_same_names():
    """The names are gathered at the first reduce, and again when a rank logs a new one; otherwise one
    all-reduce covers the values. Each result is the hand-computed weighted mean over the ranks that
    logged the name (a rank that logged nothing adds nothing)."""
    alike = [{"loss": 1.5}, {"loss": 1.5}, {"loss": 4.0}]
    assert run_ranks(tc.reduced_metrics, 2, True) == [alike] * 2
    differing = [{"loss": 1.5}, {"loss": 1.5, "only_on_0": 1.0, "only_on_1": 2.0}, {"loss": 4.0}]
    assert run_ranks(tc.reduced_metrics, 2, False) == [differing] * 2
    assert run_ranks(tc.reduced_metrics, 3, True) == [[{"loss": 2.0}, {"loss": 2.0}, {"loss": 4.0}]] * 3


@pytest.mark.parametrize("strategy, stream", [("fsdp", False), ("ddp", True)])
def test_a_rank_without_rows_logs_nothing_whatever_batch_size_says(strategy, stream):
    """5 samples in global batches of 3 on 3 processes: the last batch leaves a rank with no row. Under FSDP
    its step runs on a stand-in row (the forward is a collective), on a stream on an empty batch (0 / 0);
    token-weighted values (batch_size= the token count) equal the hand computation over the whole data."""
    reference = tc.masked_reference()
    for metrics in run_ranks(tc.masked_validation, 3, strategy, stream):
        for name, value in reference.items():
            assert metrics[name] == pytest.approx(value, abs=1e-6), (name, metrics)


def test_callback_metrics_are_the_same_on_every_rank_also_with_checkpoints(tmp_path):
    """Each rank's seconds blocked by a save were a callback metric of its own (they differ by rank)."""
    first, second = run_ranks(tc.callback_metrics_with_checkpoints, 2, str(tmp_path))
    assert first == second and "val_loss" in first and "checkpoint_blocked_s" not in first
    assert "checkpoint_blocked_s" in (tmp_path / "metrics.csv").read_text().splitlines()[0]
