"""Data as real jobs have it: the lazy permutation, user samplers, streams, huge datasets and
outputs in dataset order, each against a single-process run or a hand computation."""

from __future__ import annotations

import pytest
import torch

from checks import data as checks
from lockstep.runtime.data.order import FeistelPermutation
from lockstep.runtime.seed import mix_seed
from lockstep.testing import rank_outcomes, run_ranks

pytestmark = pytest.mark.timeout(180)


# -- samplers, streams and ordered gathers on 1, 2, 3 and 4 processes ---------------------------------
def _expected_gather() -> dict:
    x = torch.stack([checks.features(i)[0] for i in range(101)])
    return {"index": torch.arange(101), "double": 2 * x}


@pytest.fixture(scope="module")
def single_process():
    return checks.sampler_and_stream_batches()


@pytest.mark.parametrize("world", [2, 4])
def test_samplers_and_streams_give_the_same_global_batches_on_any_world_size(world, single_process):
    reference = single_process
    assert len(reference["stream"]) == 2 * 32 and len(reference["stream"][31]) == 1003 - 31 * 32
    assert reference["stream"][:32] == [list(range(32 * s, min(32 * s + 32, 1003))) for s in range(32)]
    assert len(reference["weighted"]) == 2 * 7 and reference["weighted"][:7] != reference["weighted"][7:]
    assert sorted(i for batch in reference["grouped"] for i in batch) == list(range(203))
    # Workers on 2 ranks; on 4 (whose spawned ranks start workers by spawning too) the main process reads.
    for result in run_ranks(checks.sampler_and_stream_batches, world, 2 if world == 2 else 0):
        assert result["weighted"] == reference["weighted"]
        assert result["grouped"] == reference["grouped"]
        assert result["stream"] == reference["stream"]
        assert result["trained"]["batches"] == reference["trained"]["batches"]
        assert torch.allclose(result["trained"]["weights"], reference["trained"]["weights"], atol=1e-5, rtol=0)
        # outputs of a shuffled training pass come back in dataset order, merged from per-batch dicts
        for key, expected in _expected_gather().items():
            assert torch.equal(result["gathered"][key], expected), key


def test_ranks_seeded_each_with_its_own_seed_share_one_data_order_and_keep_their_own_draws():
    """Runtime(seed=42 + rank): the order is rank 0's (every sample once, the global batches of the one-process run
    with seed 42); each rank's generator keeps its own seed."""
    reference = checks.seeded_per_rank()
    assert sorted(i for batch in reference["batches"] for i in batch) == list(range(99))
    results = run_ranks(checks.seeded_per_rank, 3)
    for result in results:
        assert result["seed"] == 42 and result["batches"] == reference["batches"]
    assert results[0]["draw"] == reference["draw"] and len({result["draw"] for result in results}) == 3


def test_outputs_of_a_shuffled_training_pass_on_3_processes_come_back_in_dataset_order():
    for gathered in run_ranks(checks.shuffled_gather, 3):
        for key, expected in _expected_gather().items():
            assert torch.equal(gathered[key], expected), key


def test_a_stream_that_ends_on_one_rank_first_fails_on_every_rank():
    for message in run_ranks(checks.stream_end_is_agreed, 2, timeout=60):
        assert "the stream ended at step 4 on 1 of 2 ranks" in message, message


def test_a_billion_sample_dataset_starts_and_resumes_at_once():
    results = run_ranks(checks.billion_samples, 2)
    for result in results:
        assert result["kind"] == "feistel-1"
        assert result["first_s"] < 2 and result["resume_s"] < 2, result
        assert result["extra_mb"] < 200, result
    first, later = results[0]["first"], results[0]["later"]
    permutation = FeistelPermutation(10**9, mix_seed(0, 0))
    assert torch.equal(torch.cat(first), permutation(torch.arange(64)))
    assert torch.equal(torch.cat(later), permutation(torch.arange(64 * 10**6, 64 * 10**6 + 64)))



def test_data_already_split_by_rank_is_refused_by_the_training_loader_naming_each_ranks_length():
    """lockstep splits the data itself: a per-rank shard would be split again (half the data per epoch), or, with
    unequal lengths, the ranks would disagree on the number of steps and all-reduce mismatched batches."""
    from checks import dist as checks
    from lockstep.testing import run_ranks

    for evaluation, stage in ((False, "training"), (True, "evaluation")):
        for message in run_ranks(checks.loader_of_sharded_data, 2, evaluation):
            assert f"the {stage} data (TensorDataset) holds a different number of samples on each rank (rank 0: 10, " \
                   "rank 1: 9)" in message, message
            assert "give every rank the whole dataset" in message


def test_a_loader_given_another_batch_size_or_shuffle_on_each_rank_is_refused_naming_each():
    """Each rank drew its rows from its own global batches (16 and 17, shuffled on rank 0 only): rank 0 saw 32 of
    the 64 samples, rank 1 30, with no error."""
    from checks import dist as checks
    from lockstep.testing import run_ranks

    training = [dict(batch_size=16, shuffle=True), dict(batch_size=17, shuffle=False)]
    for message in run_ranks(checks.loader_of_rank_settings, 2, False, training):
        assert "the training loader was made with other settings on each rank (rank 0: batch_size=16, shuffle=True, " \
               "drop_last=False; rank 1: batch_size=17, shuffle=False, drop_last=False)" in message, message
    for message in run_ranks(checks.loader_of_rank_settings, 2, True, [dict(batch_size=8), dict(batch_size=4)]):
        assert "the evaluation loader was made with other settings on each rank (rank 0: batch_size=8; rank 1: " \
               "batch_size=4)" in message, message
    assert run_ranks(checks.loader_of_rank_settings, 2, False, [dict(batch_size=16)] * 2) == ["accepted"] * 2


def test_a_torchrun_dataloader_given_as_it_is_says_its_per_rank_batch_is_read_as_the_global_one():
    from checks import dist as checks
    from lockstep.testing import run_ranks

    for as_is, with_global in run_ranks(checks.torchrun_loader_warnings, 2):
        assert as_is == ["lockstep: this DataLoader's batch_size=6 is taken as the global batch, split over the ranks; "
                         "with its DistributedSampler of 2 replicas it was each rank's. For the same steps, pass "
                         "batch_size=12 to rt.loader (the global batch)."], as_is
        assert with_global == []


def test_an_evaluation_loader_made_on_rank_0_only_stops_with_a_report_naming_the_line_instead_of_a_shard():
    """``if rt.rank == 0:`` around evaluation would evaluate rank 0's shard alone, silently: making the loader
    is a collective, so rank 0 stops there and the report names where each rank is."""
    from checks import dist as checks
    from lockstep.testing import run_ranks

    told = run_ranks(checks.evaluation_on_rank_0_only, 2, timeout=90)
    assert told[0].startswith("CollectiveError: rank 0: all_gather #1 at dist.py:"), told[0]
    assert "rank 1: last at barrier #1 at dist.py:" in told[0], told[0]
    assert told[1] != "no error", told[1]


def test_zipped_training_loaders_train_exactly_or_are_refused_when_one_weight_cannot_serve_both():
    """11 and 12 samples in global batches of 4 on 2 processes: with drop_last, the plain loop's weights; without,
    the last step's batches (3 and 4 samples) need different loss weights, and every rank says so before it."""
    reference = checks.zipped_by_hand(drop_last=True)
    for weights in run_ranks(checks.zipped_loaders, 2, True):
        assert (weights - reference).abs().max() < 1e-6
    assert (checks.zipped_loaders(False) - checks.zipped_by_hand(False)).abs().max() < 1e-6  # one process: exact
    outcomes = rank_outcomes(checks.zipped_loaders, 2, False)
    assert all("two training loaders hand out the batches of one step" in str(o.error) for o in outcomes), outcomes
    # used in turn, a step a batch (multi-task), each loss has its own batch's weight: exact, short batches too
    reference = checks.zipped_by_hand(False, alternate=True)
    for weights in run_ranks(checks.zipped_loaders, 2, False, (11, 12), True):
        assert (weights - reference).abs().max() < 1e-6


@pytest.mark.parametrize("how", ["same", "derived", "two", "two_dicts", "skip", "skip_derived", "skip_tuples"])
def test_a_loop_that_holds_several_batches_or_skips_one_weighs_each_loss_by_its_own_batch(how):
    """The next batch fetched before the backward (the last batch, split 2/1, would otherwise lend its weight to
    the batch before it, and the last get none: 0.84 off on 2 processes); two batches fetched at once; a batch
    passed over before its forward. Against the plain loop over the same global batches, on 1 and 2 processes."""
    reference = checks.looked_ahead_by_hand(skip=1 if how.startswith("skip") else None, n=7 if how == "two_dicts"
                                            else 11)
    for weights in [checks.looked_ahead(how), *run_ranks(checks.looked_ahead, 2, how)]:
        assert (weights - reference).abs().max() < 1e-6


def test_a_loop_holding_two_batches_of_other_weights_that_trains_on_tensors_made_from_them_is_refused():
    """Two batches fetched, then a forward on ``x * 1.0`` of each: the second (the last, split 2/1) cannot be told
    from the first, trained on already; it took the first's loss weight (1.0, for 4/3 and 2/3), with no error.
    One process: every weight is 1, and the weights are the plain loop's."""
    from lockstep.testing import RanksFailed

    assert (checks.looked_ahead("two_derived") - checks.looked_ahead_by_hand(n=7)).abs().max() < 1e-6
    with pytest.raises(RanksFailed, match="rt.backward cannot tell which it trains on, and their loss weights differ"):
        run_ranks(checks.looked_ahead, 2, "two_derived")


def test_evaluation_without_no_grad_on_uneven_shards_runs_no_collective_of_ddp_and_keeps_dataset_order():
    reference = checks.evaluated_by_hand()
    for predictions in run_ranks(checks.evaluated_under_grad_mode, 2):
        assert torch.equal(predictions, reference)


def test_a_global_batch_size_smaller_than_the_ranks_is_refused_when_the_loader_is_made():
    for messages in run_ranks(checks.global_batches_smaller_than_the_ranks, 2):
        assert messages == ["global batch_size=1 is smaller than the 2 data-parallel ranks: some ranks would get no "
                            "rows in every step. Give a batch_size of at least 2."] * 2, messages


def test_a_batch_sampler_batch_smaller_than_the_ranks_is_refused_on_every_rank_by_name():
    for message in run_ranks(checks.batch_sampler_with_a_batch_of_one, 2):
        assert "global batch 1 of the batch sampler holds 1 sample(s) for 2 data-parallel ranks" in message, message


def test_a_training_stream_whose_last_batch_leaves_a_rank_without_rows_is_refused_on_every_rank():
    for said, total in run_ranks(checks.stream_with_a_last_batch_smaller_than_the_ranks, 3):
        assert "the stream's last global batch (step 2) holds 1 items for 3 ranks" in said and total == 6.0, said


def test_gathered_rows_of_an_index_drawn_twice_come_in_the_order_one_process_reads_them():
    """A sampler that draws with replacement hands out an index several times: in dataset order, its rows
    follow their places in the pass, on 2 processes as on 1 (not rank 0's first)."""
    alone = checks.gathered_with_repeats()
    assert any(a[0] == b[0] for a, b in zip(alone, alone[1:], strict=False))  # some index comes twice
    assert [index for index, _ in alone] == sorted(index for index, _ in alone)
    for rows in run_ranks(checks.gathered_with_repeats, 2):
        assert rows == alone
