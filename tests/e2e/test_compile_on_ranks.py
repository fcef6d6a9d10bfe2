"""torch.compile through lockstep: regional, in place, before DDP/FSDP wrap; clean keys; eager's weights."""

from __future__ import annotations

import pytest

from checks import compile as compile_checks
from lockstep.testing import run_ranks

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize(("strategy", "user_compiled"), [("ddp", False), ("fsdp", False), ("ddp", True)])
def test_compiled_on_2_processes_matches_eager_without_graph_breaks_and_with_clean_keys(strategy, user_compiled):
    for result in run_ranks(compile_checks.compiled_against_eager, 2, strategy, user_compiled, timeout=280):
        assert (result["compiled"] - result["eager"]).abs().max() <= 1e-4
        assert result["names"] == ["blocks.0", "blocks.1", "blocks.2"]
        assert result["graph_breaks"] == {} and result["frames"] >= 1, result
        assert result["keys"] == sorted(compile_checks.Net().state_dict())  # no _orig_mod.


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_model_whose_blocks_come_in_many_layouts_is_compiled_whole_on_2_processes_and_matches_eager(strategy):
    """Blocks of 5 layouts: compile=True compiles the model whole before DDP or FSDP (its blocks still FSDP's
    shard groups) wrap it; the weights after 4 steps are eager's."""
    for result in run_ranks(compile_checks.compiled_against_eager, 2, strategy, False, "Widening", timeout=280):
        assert result["names"] == [""]
        assert (result["compiled"] - result["eager"]).abs().max() <= 1e-4
        assert result["frames"] >= 1, result
        assert result["keys"] == sorted(compile_checks.Widening().state_dict())
