"""One walker over nested data: every container kind behaves the same in every collective,
the device move and the batch-size count; the loss weight belongs to its batch only."""

from __future__ import annotations

import pytest
import torch

from checks import dist as checks
from lockstep.testing import run_ranks

pytestmark = pytest.mark.timeout(180)


KINDS = list(checks.containers(None, None))


def test_every_collective_handles_every_container_kind():
    results = run_ranks(checks.collectives_over_containers, 2)
    for rank_results in results:
        for kind in KINDS:
            name = type(checks.containers(None, None)[kind]).__name__
            got = rank_results[kind]
            a, b, kept = got["all_reduce"]  # sums of [r, r] and r + 1 over ranks 0 and 1
            assert kept == name and torch.equal(a, torch.ones(2)) and b == 3.0, (kind, got["all_reduce"])
            (a0, b0, n0), (a1, b1, n1) = got["all_gather"]
            assert n0 == n1 == name and b0 == 1.0 and b1 == 2.0, kind
            assert torch.equal(a0, torch.zeros(1, 2)) and torch.equal(a1, torch.ones(2, 2)), kind
            if kind == "list":  # gather takes a list as rows: the ranks' lists are concatenated
                assert [len(v) if isinstance(v, list) else tuple(v.shape) for v in got["gather"][:4]] == \
                    [(1, 2), 1, (2, 2), 2]
            else:  # rows in rank order: 1 row of rank 0, 2 rows of rank 1
                a, b, kept = got["gather"]
                assert kept == name and torch.equal(a, torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]])), kind
                assert b == [0.0, 1.0, 1.0], kind
            a, b, kept = got["broadcast"]
            assert kept == name and torch.equal(a, torch.ones(2, 2)) and b == 2.0, kind


@pytest.mark.parametrize("leave", ["end", "break"])
def test_a_backward_not_from_the_loader_is_never_reweighted(leave):
    # The last global batch splits 2+1 (weights 4/3 and 2/3); a later backward must not see them.
    assert run_ranks(checks.stale_loss_weight, 2, leave) == [1.5, 1.5]



def test_dicts_match_by_key_bools_and_numpy_scalars_reduce_and_other_keys_are_refused():
    """Rank 0 builds {a, b}, rank 1 {b, a}: the values meet by key, not by place. Before, rank 0 got
    {'a': 21, 'b': 12}; bools and numpy scalars came back unreduced; other keys on each rank summed
    'cat' with 'dog'."""
    for out in run_ranks(checks.collectives_by_key, 2):
        assert out["sum"] == {"a": 3, "b": 30}
        assert out["flags"] == [True, False, 1]  # any, all, how many
        assert out["numpy"] == [2.0, 5] and out["numpy_types"] == ["float32", "int64"]
        assert out["numpy_mean_and_count"] == [1.5, 2] and type(out["numpy_mean_and_count"][0]) is float
        assert out["defaultdict"] == {"x": 1.0}
        assert torch.equal(out["narrow_mean"], torch.tensor([40000.0, 1.0], dtype=torch.float16))  # was inf
        assert torch.equal(out["complex_mean"], torch.tensor([1 + 1j]))  # was 1.0, its imaginary part dropped
        assert torch.equal(out["gather"]["a"], torch.tensor([0.0, 1.0]))
        assert torch.equal(out["gather"]["b"], torch.tensor([10.0, 11.0]))
        assert "rt.all_reduce: the ranks passed data of different structures" in out["all_reduce_refused"]
        assert "rt.gather: the ranks' outputs have different structures" in out["gather_refused"]


def test_clipping_two_models_together_takes_the_norm_of_both():
    for norm, reference in run_ranks(checks.clip_over_two_models, 2):
        assert norm == pytest.approx(reference, rel=1e-6)


def test_a_frozen_teacher_sets_up_beside_its_student_and_the_student_trains_as_on_one_process():
    two = run_ranks(checks.distil_from_a_frozen_teacher, 2)
    one = run_ranks(checks.distil_from_a_frozen_teacher, 1)
    assert torch.equal(two[0], two[1]) and torch.allclose(two[0], one[0], atol=1e-7)


def test_outputs_collected_per_sample_are_rows_and_a_join_only_one_rank_fails_is_refused_on_every_rank():
    """Per-batch lists of texts are joined into rows, as per-batch tensors are. One output per sample
    (detections, generated tokens) are the rows themselves: before, a list of them was
    joined as per-batch chunks, which gave row i another sample's values with no error where the lengths summed
    to the sample count. A join that fails on rank 0 alone (per-batch chunks of other widths) raised there before
    any collective, and the peer's next collectives no longer lined up (a hang)."""
    varying = [[100 * i + k for k in range(i % 3)] for i in range(7)]
    for out in run_ranks(checks.gathered_rows_per_sample, 2):
        assert out["varying"] == varying
        assert out["vectors"] == [[i, -i] for i in range(7)]
        assert out["dicts"] == [list(range(7)), [list(range(i % 3)) for i in range(7)]]
        assert out["texts"] == [list(range(7)), [f"s{i}" for i in range(7)]]  # was refused: "holds 2 rows"
        assert "rank 0: its outputs cannot be joined (Sizes of tensors must match" in out["refused"]
        assert out["after"] == list(range(7))
        assert out["few"] == [[3, 1], [[0, 1, 2], [0, 1, 2, 3], [0, 1, 2, 3, 4]]]
        assert out["replica"] == [[0, 1, 2], [0, 1, 2, 3, 4]]  # each row once (the empty rank sent them again)
