"""FSDP2: the same model as one process and as DDP, built empty, evaluated exactly, in less memory."""

from __future__ import annotations

import pytest
import torch

import lockstep
from checks import fsdp as fc
from lockstep.testing import rank_outcomes, run_ranks

pytestmark = pytest.mark.timeout(240)


def test_bf16_mixed_equals_a_hand_written_fsdp2_loop_with_the_same_policy():
    assert max(run_ranks(fc.bf16_against_plain_fsdp2, 2)) <= 1e-6


def test_float8_under_fsdp_equals_a_hand_written_fsdp2_loop_over_torchao():
    pytest.importorskip("torchao.float8")
    assert max(run_ranks(fc.bf16_against_plain_fsdp2, 2, "float8")) <= 1e-6


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", lockstep.Parallel(replicate=2), ("ddp", lockstep.Parallel(pp=2))],
                         ids=["ddp", "fsdp", "hsdp", "pp"])
def test_ranks_that_build_the_model_from_different_seeds_start_from_rank_0s_weights(strategy):
    """DDP broadcasts rank 0's weights; FSDP would shard each rank's own initialisation, and pipeline stages
    keep each their own rank's modules: a model no rank built. Every rank starts from rank 0's, as under DDP."""
    results = run_ranks(fc.built_unseeded, 4, strategy)
    assert not torch.equal(results[0]["mine_before"]["embed.weight"], results[1]["mine_before"]["embed.weight"])
    for rank, result in enumerate(results):
        assert result["after"], rank
        for name, value in result["after"].items():
            assert torch.equal(value, results[0]["rank0_before"][name]), (rank, name)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ranks_that_build_models_of_other_shapes_are_all_told_so_before_any_hang(strategy):
    outcomes = rank_outcomes(fc.built_other_shapes, 2, strategy, timeout=60)
    for outcome in outcomes:
        assert not outcome.ok and "differs between the ranks in the number, shapes or dtypes of its parameters" in str(
            outcome.error), outcome.error
        assert "rank 0: 10 tensors, 3588 elements; rank 1: 10 tensors, 1028 elements" in str(outcome.error)


def test_a_model_built_empty_allocates_only_its_shards_and_initialises_them():
    results = run_ranks(fc.built_empty, 2)
    for result in results:
        assert result["local_numel"] * 2 == result["full_numel"]
        assert result["finite"] and result["optimizer_holds_model"]
        assert 0.05 < result["embed_std"] < 0.5  # nn.Linear(8, 64)'s init: uniform in +-1/sqrt(8)
    assert not torch.equal(results[0]["embed_rows"], results[1]["embed_rows"])  # shards differ


def test_evaluation_with_uneven_batch_counts_neither_hangs_nor_adds_rows():
    results = run_ranks(fc.evaluation_under_fsdp, 3)
    model = fc.make_stack()
    with torch.no_grad():
        expected = model(fc.checks.make_data(1001).tensors[0])
    assert [len(r["rows"]) for r in results] == [112, 112, 112]
    assert results[2]["rows"][-1] == 0  # rank 2 ran its padding batch with zero rows
    for result in results:
        assert torch.equal(result["indices"], torch.arange(1001))
        assert torch.allclose(result["outputs"], expected, atol=1e-6)


def test_an_optimizer_that_already_stepped_cannot_follow_the_shards():
    message = run_ranks(fc.stepped_optimizer_is_refused, 2)[0]
    assert "give rt.setup an optimizer that has taken no step yet" in message


def test_configure_model_builds_on_the_meta_device_under_fsdp():
    for result in run_ranks(fc.trainer_configure_model, 2):
        assert result["sharded"] and result["local_rows"] == 2  # head: 4 rows over 2 ranks
        assert result["steps"] == 3


def test_full_state_dict_gathers_the_shards_on_rank_0_or_on_every_rank():
    results = run_ranks(fc.full_state_dicts, 2)
    reference = results[0]["by_hand"]
    assert results[0]["sharded"] and set(reference) == set(fc.make_stack().state_dict())
    assert results[1]["rank0"] == {}
    for got in (results[0]["rank0"], results[0]["every"], results[1]["every"]):
        assert set(got) == set(reference)
        for name, value in got.items():
            assert value.device.type == "cpu" and not isinstance(value, torch.distributed.tensor.DTensor)
            assert torch.equal(value, reference[name]), name


def test_infinity_norm_clipping_with_a_shard_left_empty_equals_torchs_clipping_on_one_process():
    # 3 ranks shard the head's bias of 4 rows as 2, 2 and 0: torch's infinity norm refused rank 2's empty shard
    reference = run_ranks(fc.train, 1, "single", "32-true", 1, 0.05, 1, 103, 16, float("inf"), True)[0]
    unclipped = run_ranks(fc.train, 1, "single", "32-true", 1, None, 1)[0]
    assert (reference - unclipped).abs().max() > 1e-3  # the clipping bites
    for weights in run_ranks(fc.train, 3, "fsdp", "32-true", 1, 0.05, 1, 103, 16, float("inf")):
        assert torch.allclose(weights, reference, atol=1e-6, rtol=0)


def test_cpu_offload_on_one_process_stays_fsdp_and_trains_as_one_process_does():
    result = run_ranks(fc.offloaded_on_one_process, 1)[0]
    assert result["sharded"] and not result["group_left"]
    single = run_ranks(fc.train, 1, "single", "32-true", 1, None, 1)[0]
    assert torch.allclose(result["weights"], single, atol=1e-6, rtol=0)
