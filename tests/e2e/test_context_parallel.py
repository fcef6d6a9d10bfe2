"""Context parallel: each row's sequence cut over a ring of cp ranks trains the one-process model, on
Hugging Face Llama and Qwen2 models from tiny configs (padded rows of different lengths, token-averaged
losses), with FSDP, DDP, tensor parallel, accumulation and clipping; a killed cp2 × dp2 Trainer run resumes
on dp4 and on one process; what the ring cannot run is refused by name in seconds."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lockstep
from checks import context as cc
from checks import mesh as mc
from lockstep.testing import RanksFailed, run_ranks

pytestmark = pytest.mark.timeout(400)

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 1e-6


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_cp2_cp4_and_cp2_times_dp2_reach_the_weights_of_a_hand_written_one_process_loop(kind):
    reference = cc.reference_weights(kind)
    assert not torch.allclose(reference, cc.hc.flat(cc.tiny_model(kind)), atol=1e-2)  # 5 steps moved it
    for world, strategy in ((2, ("ddp", lockstep.Parallel(cp=2))), (4, ("fsdp", lockstep.Parallel(cp=4))),
                            (4, ("fsdp", lockstep.Parallel(cp=2)))):
        for result in run_ranks(cc.cp_weights, world, strategy, kind):
            assert torch.allclose(result["weights"], reference, atol=TOLERANCE, rtol=0), (kind, strategy)


def test_each_rank_trains_on_its_part_of_the_sequence_and_its_data_rank_rows():
    results = run_ranks(cc.cp_weights, 4, ("fsdp", lockstep.Parallel(cp=2)), "llama", 2)
    assert [r["length"] for r in results] == [cc.LENGTH // 2] * 4
    assert results[0]["seen"] == results[1]["seen"] and results[2]["seen"] == results[3]["seen"]  # cp peers
    for step in range(2):  # the global batch of 8 split over the 2 data-parallel ranks, in order
        assert results[0]["seen"][step] + results[2]["seen"][step] == list(range(8 * step, 8 * step + 8))


def test_cp2_times_tp2_and_cp2_times_dp2_with_accumulation_and_clipping_reach_the_same_weights():
    reference = cc.reference_weights("qwen2")
    for result in run_ranks(cc.cp_weights, 4, ("fsdp", lockstep.Parallel(cp=2, tp=2)), "qwen2"):
        assert torch.allclose(result["weights"], reference, atol=TOLERANCE, rtol=0)
    clipped = cc.reference_weights("llama", clip=0.5)
    for result in run_ranks(cc.cp_weights, 4, ("fsdp", lockstep.Parallel(cp=2)), "llama", 5, 8, cc.LR, 2, 0.5):
        assert torch.allclose(result["weights"], clipped, atol=TOLERANCE, rtol=0)


def test_bf16_mixed_under_cp_stays_as_close_to_float32_as_plain_data_parallel_does():
    """bf16-mixed: cp2's weights differ from the float32 reference no more than dp2's (measured: 9e-4, dp2 1.2e-3
    from the one-process bf16 run)."""
    reference = cc.reference_weights()
    plain = max((r["weights"] - reference).abs().max() for r in run_ranks(
        cc.cp_weights, 2, "fsdp", "llama", 5, 8, cc.LR, 1, None, "bf16-mixed"))
    for result in run_ranks(cc.cp_weights, 2, ("fsdp", lockstep.Parallel(cp=2)), "llama", 5, 8, cc.LR, 1, None,
                            "bf16-mixed"):
        assert (result["weights"] - reference).abs().max() <= 2 * plain + 1e-4


def test_an_attention_module_of_ones_own_with_positions_and_shifted_targets_in_the_batch():
    """The documented way for a model of one's own: SDPA with is_causal=True, positions and targets (shifted
    over the whole row) as tensors of the batch, cut with the tokens."""
    reference = cc.own_attention_weights()
    for weights in run_ranks(cc.own_attention_weights, 2, ("ddp", lockstep.Parallel(cp=2))):
        assert torch.allclose(weights, reference, atol=TOLERANCE, rtol=0)


def _run(tmp_path: Path, name: str, devices: int, kill_at: int, *parallel: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lockstep.cli.main", "run", "--devices", str(devices), "--accelerator",
                           "cpu", *parallel, "tests/scripts/cp_trainer.py", str(tmp_path / name),
                           str(tmp_path / f"{name}.pt"), str(kill_at)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)


def test_a_killed_cp2_dp2_trainer_run_resumes_on_dp4_cp4_and_one_process_to_the_uninterrupted_weights(tmp_path):
    cp = ("--parallel", "cp=2")
    for name, devices, parallel in (("whole", 4, cp), ("one", 1, ())):
        finished = _run(tmp_path, name, devices, -1, *parallel)
        assert finished.returncode == 0, finished.stderr[-3000:]
    whole, one = torch.load(tmp_path / "whole.pt"), torch.load(tmp_path / "one.pt")
    assert whole["parallel"] == "cp=2" and whole["steps"] == one["steps"] == 10
    assert torch.allclose(whole["weights"], one["weights"], atol=TOLERANCE, rtol=0)
    # predict on cp2 × dp2: every row once, in dataset order, the one process's logits (each cp rank runs it whole).
    # The weights differ by up to TOLERANCE (float sums in another order, other thread counts): the logits then by
    # up to 1.3e-5 on one 2-core machine; a row out of place would differ by the logits' own size (0.35 on average,
    # up to 1.3).
    assert whole["predictions"].shape == one["predictions"].shape == (13, cc.LENGTH, cc.VOCAB)
    assert torch.allclose(whole["predictions"], one["predictions"], atol=5e-5, rtol=0)
    killed = _run(tmp_path, "killed", 4, 5, *cp)
    assert killed.returncode != 0 and "signal SIGKILL" in killed.stderr
    for resumed_on, parallel in ((4, ()), (1, ()), (4, ("--parallel", "cp=4"))):  # dp4, one process, cp4
        name = f"killed{resumed_on}{''.join(parallel)}"
        shutil.copytree(tmp_path / "killed", tmp_path / name)  # each resumes the killed run's checkpoints
        resumed = _run(tmp_path, name, resumed_on, -1, *parallel)
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "resumed from" in resumed.stdout and "after step 4." in resumed.stdout
        result = torch.load(tmp_path / f"{name}.pt")
        assert result["steps"] == 10 and result["parallel"] == (parallel[1] if parallel else None)
        assert torch.allclose(result["weights"], whole["weights"], atol=TOLERANCE, rtol=0), (resumed_on, parallel)


class _Masked(torch.utils.data.Dataset):
    """Rows with a padding mask (zeros at the end)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = cc.Rows(8)[index]
        return {"input_ids": row["input_ids"], "attention_mask": (row["labels"] != cc.IGNORE).long()}


class _Odd(torch.utils.data.Dataset):
    """Rows of 10 tokens: not cut into 2 × cp = 4 equal chunks."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.arange(1, 11), "labels": torch.arange(1, 11)}


def _first_batch(dataset_name: str) -> None:
    rt = lockstep.Runtime(accelerator="cpu", seed=0, strategy="ddp", parallel=lockstep.Parallel(cp=2))
    model = rt.setup(cc.tiny_model(attention="eager" if dataset_name == "eager" else "sdpa"))
    data = {"masked": _Masked, "odd": _Odd}.get(dataset_name, cc.Rows)()
    for batch in rt.loader(data, batch_size=4, num_workers=0):
        model(**mc.model_inputs(batch))


@pytest.mark.parametrize("dataset_name, message", [
    ("masked", "attention_mask hides tokens"),
    ("odd", r"hold 10 tokens: pad the rows to a multiple of 4 \(e.g. 12\)"),
    ("eager", "uses attn_implementation='eager': load it with attn_implementation='sdpa'")])
def test_what_the_ring_cannot_run_is_refused_by_name_on_every_rank(dataset_name, message):
    with pytest.raises(RanksFailed) as failed:
        run_ranks(_first_batch, 2, dataset_name, timeout=120)
    assert re.search(message, str(failed.value))


def test_a_cp_degree_that_does_not_divide_the_world_is_refused_before_any_step(tmp_path):
    refused = _run(tmp_path, "odd", 3, -1, "--parallel", "cp=2")
    assert refused.returncode != 0
    assert "divisible by tp × pp × cp = 2" in refused.stdout + refused.stderr
