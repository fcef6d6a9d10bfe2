"""Gloo reads some non-contiguous inputs in storage order (pytorch#192920): every lockstep collective and the
gradient paths give the right values for transposed, stepped, channels-last and expanded tensors."""

from __future__ import annotations

import pytest
import torch

from checks import dist as checks
from lockstep.testing import run_ranks

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_every_collective_and_the_gradients_are_right_on_non_contiguous_tensors(strategy):
    expected = checks.non_contiguous_reference()
    one, two = expected["ranks"]
    for got in run_ranks(checks.non_contiguous_collectives, 2, strategy):
        for op in ("sum", "mean", "max"):
            for kind, value in got["all_reduce"][op].items():
                assert torch.equal(value, expected[op][kind]), (op, kind, value, expected[op][kind])
        for rank, values in enumerate(got["all_gather"]):
            for kind, value in values.items():
                assert torch.equal(value, expected["ranks"][rank][kind]), ("all_gather", rank, kind)
        for kind, value in got["broadcast"].items():
            assert torch.equal(value, two[kind]), ("broadcast", kind)
        for kind, value in got["gather"].items():
            assert torch.equal(value, torch.cat([one[kind], two[kind]])), ("gather", kind)
        assert torch.allclose(got["weights"], expected["weights"], atol=1e-6, rtol=0), \
            float((got["weights"] - expected["weights"]).abs().max())
        assert torch.equal(got["offset"], expected["offset"])
