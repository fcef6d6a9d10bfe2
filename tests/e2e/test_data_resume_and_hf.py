"""Data as real jobs have it: the lazy permutation, user samplers, streams, huge datasets and
outputs in dataset order, each against a single-process run or a hand computation."""

from __future__ import annotations

import pytest
import torch

from checks import data as checks
from lockstep.testing import rank_outcomes, run_ranks

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def uninterrupted_stream(tmp_path_factory):
    return run_ranks(checks.stream_until_killed, 2, str(tmp_path_factory.mktemp("full") / "ckpt"), False, 0)[0]


@pytest.mark.parametrize("stateful", [False, True], ids=["skip-by-count", "stream-state"])
def test_a_stream_resumes_after_a_kill_at_the_right_item(tmp_path, stateful, uninterrupted_stream):
    checkpoint = str(tmp_path / "ckpt")
    killed = rank_outcomes(checks.stream_until_killed, 2, checkpoint, stateful, 13, timeout=120)
    assert not any(outcome.ok for outcome in killed)
    resumed = run_ranks(checks.stream_until_killed, 2, checkpoint, stateful, 0)[0]
    assert resumed["resumed"]
    assert resumed["batches"] == uninterrupted_stream["batches"][13:]
    assert resumed["batches"][0][0] == 13 * 32
    assert torch.allclose(resumed["weights"], uninterrupted_stream["weights"], atol=1e-6, rtol=0)
    # a stream with its own state continues where it was; another is read from the start and skipped
    assert resumed["reads"] == (1003 - 13 * 32 if stateful else 1003)


def test_hugging_face_datasets_in_both_forms():
    pytest.importorskip("datasets")
    reference = checks.hf_batches(100)
    assert reference["stream"] == [list(range(8 * s, min(8 * s + 8, 100))) for s in range(13)]
    assert sorted(i for batch in reference["map"] for i in batch) == list(range(100))
    assert reference["resumed"] == reference["stream"]
    for result in run_ranks(checks.hf_batches, 2, 100):
        assert result["map"] == reference["map"]
        assert result["stream"] == reference["stream"]
        assert result["resumed"] == reference["stream"]
        assert "stream" in result["position"]  # resumed through the dataset's own state_dict

