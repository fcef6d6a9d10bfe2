"""Context parallel's pieces by hand: the mesh's rank questions with a cp dimension, the head-tail cut of a
batch's sequences, and the ring's refusals (no process group needed: they come before any collective)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lockstep.errors import ConfigError, UsageError
from lockstep.runtime.parallel.context import ContextParallel, SequenceCut
from lockstep.runtime.parallel.mesh import Membership, MeshLayout
from lockstep.runtime.parallel.num_items import ItemNormalizer

pytestmark = pytest.mark.timeout(60)


def test_the_mesh_places_cp_between_the_data_parallel_and_tensor_parallel_ranks():
    layout = MeshLayout(replicate=1, shard=2, tp=2, pp=1, cp=2)  # rank = (shard * 2 + cp) * 2 + tp
    assert layout.world_size == 8 and layout.batch_peers == 4 and layout.gradient_peers == 4
    assert [layout.data_parallel_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [layout.context_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [r for r in range(8) if layout.keeps_rows(r)] == [0, 4]  # one copy of each data-parallel rank's rows
    assert [r for r in range(8) if layout.speaks_for_stage(r)] == [0]
    assert not layout.trivial


def test_each_rank_keeps_its_head_and_tail_chunks_of_every_sequence():
    rows = torch.arange(16).reshape(2, 8)
    per_row = torch.tensor([5, 6])  # one value per row: not a sequence, kept whole
    parts = [SequenceCut(2, rank)((rows, per_row)) for rank in range(2)]
    assert parts[0][0].tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]
    assert parts[1][0].tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert parts[0][1].tolist() == parts[1][1].tolist() == [5, 6]


def test_a_hugging_face_batch_gets_its_positions_and_labels_shifted_over_the_whole_row():
    ids = torch.tensor([[11, 12, 13, 14, 15, 16, 0, 0]])
    labels = torch.tensor([[11, 12, 13, 14, 15, 16, -100, -100]])
    part = SequenceCut(2, 1)({"input_ids": ids, "labels": labels})
    assert part["input_ids"].tolist() == [[13, 14, 15, 16]]
    assert part["position_ids"].tolist() == [[2, 3, 4, 5]]
    assert part["shift_labels"].tolist() == [[14, 15, 16, -100]]  # the next token's label, across chunk edges
    assert part["attention_mask"].tolist() == [[1, 1, 1, 1]]  # one sequence, not packed ones
    first = SequenceCut(2, 0)({"input_ids": ids, "labels": labels})
    assert first["shift_labels"].tolist() == [[12, 13, -100, -100]] and first["position_ids"].tolist() == [[0, 1, 6, 7]]


def test_what_the_cut_cannot_run_is_refused_with_what_to_do():
    cut = SequenceCut(2, 0)
    with pytest.raises(ConfigError, match=r"hold 10 tokens: pad the rows to a multiple of 4 \(e.g. 12\)"):
        cut({"input_ids": torch.zeros(1, 10, dtype=torch.long)})
    with pytest.raises(ConfigError, match="attention_mask hides tokens"):
        cut({"input_ids": torch.zeros(1, 8, dtype=torch.long), "attention_mask": torch.tensor([[1] * 6 + [0] * 2])})
    with pytest.raises(ConfigError, match="packed sequences"):
        packed = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]])
        cut({"input_ids": torch.zeros(1, 8, dtype=torch.long), "position_ids": packed})
    with pytest.raises(UsageError, match="no tensor of two dimensions"):
        cut((torch.zeros(4),))
    assert cut({"input_ids": torch.zeros(1, 8, dtype=torch.long), "attention_mask": torch.ones(1, 8)})  # all ones


def test_the_ring_refuses_attention_it_cannot_run_before_any_collective():
    context = ContextParallel(2, 0, lambda: pytest.fail("no group is asked for"))
    model = torch.nn.Linear(8, 8)
    batch = context.cut((torch.zeros(1, 8, 8),))  # the loader's batch: 8 positions per row, 4 on this rank
    q = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ConfigError, match="ran no torch.nn.functional.scaled_dot_product_attention"):
        with context.forward(model, batch, training=True):
            with pytest.raises(ConfigError, match="an attention mask"):
                F.scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(4, 4, dtype=torch.bool), is_causal=False)
            with pytest.raises(ConfigError, match="attention that is not causal"):
                F.scaled_dot_product_attention(q, q, q)
            with pytest.raises(ConfigError, match="dropout"):
                F.scaled_dot_product_attention(q, q, q, dropout_p=0.1, is_causal=True)
            whole = torch.zeros(1, 2, 8, 8)  # the whole sequence's attention in a forward on the cut batch
            with pytest.raises(UsageError, match="attention over 8 query and 8 key positions"):
                F.scaled_dot_product_attention(whole, whole, whole, is_causal=True)
    # a training forward on a batch the loader did not cut is refused; without gradients it runs unsplit
    with pytest.raises(UsageError, match="a training forward on a batch that the training loader did not cut"):
        context.forward(model, (torch.zeros(1, 8, 8),), training=True)
    assert context.forward(model, (torch.zeros(1, 8, 8),), training=False) is None


def test_models_whose_attention_or_positions_the_ring_would_get_wrong_are_refused_by_name():
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    shape = dict(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    cases = [
        (LlamaForCausalLM(LlamaConfig(**shape, attn_implementation="eager")), 8, "attn_implementation='eager'"),
        (LlamaForCausalLM(LlamaConfig(**shape, rope_scaling={"rope_type": "dynamic", "factor": 2.0})), 8,
         "rotary scaling 'dynamic'"),
        (MistralForCausalLM(MistralConfig(**shape, sliding_window=4)), 8, "window of 4 positions"),
    ]
    checkpointing = LlamaForCausalLM(LlamaConfig(**shape))
    checkpointing.gradient_checkpointing_enable()
    cases.append((checkpointing, 8, "gradient checkpointing"))
    for model, length, message in cases:
        context = ContextParallel(2, 0, lambda: None)
        batch = context.cut({"input_ids": torch.zeros(1, length, dtype=torch.long)})
        with pytest.raises(ConfigError, match=message):
            context.forward(model, batch, training=True)
    window_covers = MistralForCausalLM(MistralConfig(**shape, sliding_window=8))  # the window covers the row
    context = ContextParallel(2, 0, lambda: None)
    assert context.forward(window_covers, context.cut({"input_ids": torch.zeros(1, 8, dtype=torch.long)}), True)


def test_labels_that_are_not_one_per_token_and_ambiguous_sequences_are_refused():
    cut = SequenceCut(2, 0)
    with pytest.raises(ConfigError, match="labels are \\(2,\\)"):
        cut({"input_ids": torch.zeros(2, 8, dtype=torch.long), "labels": torch.tensor([0, 1])})
    with pytest.raises(ConfigError, match="disagree on it"):
        cut((torch.zeros(2, 5), torch.zeros(2, 8, dtype=torch.long)))  # features and tokens: which is the sequence?
    with pytest.raises(ConfigError, match="give input_ids"):
        cut({"inputs_embeds": torch.zeros(2, 8, 4), "labels": torch.zeros(2, 8, dtype=torch.long)})


def test_item_counts_cover_every_cp_rank_and_gradients_are_averaged_over_them():
    sums = []

    def sum_over_data_parallel(value):  # 2 data-parallel ranks × 2 cp ranks, each holding 3 items
        sums.append(float(value))
        return value * 2  # the Runtime's sum over the data-parallel ranks: one cp rank of each row

    normalizer = ItemNormalizer(Membership(0, 2), torch.device("cpu"), sum_over_data_parallel, cp=2)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # what divides the gradients
    normalizer.watch(optimizer)
    factor = normalizer.loss_factor(3)
    assert float(normalizer._sum_over_ranks(torch.tensor(3.0, dtype=torch.float64))) == 12.0
    assert normalizer._gradient_peers == 4 and float(factor) == 3 / float(normalizer.scale)


def test_one_short_step_does_not_lower_the_next_steps_item_scale():
    """c (the backward's divisor) follows the larger of the two previous steps' items per rank: after a pass's
    short last step (6 items against 33) the next full step's backward still runs on about the loss's own
    magnitude (c = 32, not 4: a float16 backward 8 times too large overflows and the step is skipped)."""
    normalizer = ItemNormalizer(Membership(0, 1), torch.device("cpu"), lambda value: value)
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    normalizer.watch(optimizer)
    scales = []
    for micro_batches in ([19, 14], [6], [19, 14], [19, 14], [2, 2], [2, 2], [2, 2]):
        for items in micro_batches:
            normalizer.loss_factor(items)
        normalizer.finish_step()
        scales.append(float(normalizer.scale))
    # items per step: 33, 6, 33, 33, 4, 4, 4: a lasting drop lowers c after two steps
    assert scales == [32.0, 32.0, 32.0, 32.0, 32.0, 4.0, 4.0]
