"""Pipeline parallel on CPU processes: a Llama (``transformers``, from a config) cut into stages reaches the
one-process weights of a hand-written loop under every torch schedule, with data parallel, accumulation,
clipping and token-averaged losses; its checkpoints resume on other layouts; bad layouts are refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lockstep
from checks import pipeline as pc
from lockstep.runtime.checkpoint.consolidate import model_weights
from lockstep.testing import RanksFailed, run_ranks

pytestmark = pytest.mark.timeout(300)

TOLERANCE = 1e-5
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def _close(results, reference) -> None:
    for result in results:
        assert torch.allclose(result["weights"], reference, atol=TOLERANCE, rtol=0), \
            float((result["weights"] - reference).abs().max())


def test_every_schedule_on_two_pipeline_ranks_reaches_the_one_process_weights():
    """pp = 2: the one-stage schedules on 2 stages, the interleaved and V-shaped ones on 4 (2 per rank);
    clipping over both stages and a token-averaged loss on rows of 2 to 20 tokens."""
    reference = pc.reference(steps=3, clip=0.5)
    untrained = pc.flat_named(dict(pc.llama().named_parameters()))
    for schedule in SCHEDULES:
        results = run_ranks(pc.pipeline_weights, 2, lockstep.Parallel(pp=2, pp_schedule=schedule), 3, 1, 0.5)
        _close(results, reference)
        assert results[0]["losses"] == results[1]["losses"]  # the step's loss reaches the first stage too
        assert not torch.allclose(results[0]["weights"], untrained.detach(), atol=1e-3)


@pytest.mark.parametrize("kind", ["gpt2", "qwen2", "dict"])
def test_gpt2_qwen2_and_a_module_dict_of_layers_split_into_stages_without_stage_code(kind):
    """GPT-2 adds position embeddings to what its transformer receives: its later stages take the hidden
    state as inputs_embeds, and the skipped position embedding adds zeros. Qwen2 is cut as Llama is.
    Untied embeddings. A model whose layers are an nn.ModuleDict (as torchtitan's) is cut by its keys."""
    reference = pc.reference(steps=3, clip=0.5, kind=kind)
    for schedule in ("1F1B", "DualPipeV"):
        _close(run_ranks(pc.pipeline_weights, 2, lockstep.Parallel(pp=2, pp_schedule=schedule), 3, 1, 0.5, 0.5, 40,
                         True, 8, kind), reference)


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_on_stages_equals_a_hand_written_autocast_loop(precision):
    """Stages outside FSDP run under autocast (16-mixed: the GradScaler's scaled loss through the schedule):
    one step equals a hand-written one-process autocast loop on the same micro-batches, where the mixed
    precision alone moves the weights 1e-5 to 1e-4 from float32. Under FSDP's policy (pp2 x dp2), one step
    equals FSDP without pp on the same rows per rank."""
    args = (1, 1, 0.5, 0.5, 40, True, 8, "llama", precision)
    float32 = pc.reference(steps=1, clip=0.5)
    for strategy, microbatches in ((lockstep.Parallel(pp=2), 2),
                                   (lockstep.Parallel(pp=2, pp_schedule="ZBVZeroBubble"), 4),
                                   (lockstep.Parallel(pp=2, pp_schedule="Interleaved1F1B", pp_microbatches=2), 2)):
        reference, _ = pc.mixed_reference(precision, steps=1, microbatches=microbatches)
        assert float((reference - float32).abs().max()) > 1e-5
        weights = run_ranks(pc.pipeline_weights, 2, strategy, *args)[0]["weights"]
        assert float((weights - reference).abs().max()) < 1e-7, (strategy, float((weights - reference).abs().max()))
    if precision == "bf16-mixed":
        fsdp = run_ranks(pc.pipeline_weights, 2, "fsdp", *args)[0]["weights"]
        gpipe = lockstep.Parallel(pp=2, pp_schedule="GPipe", pp_microbatches=1)
        staged = run_ranks(pc.pipeline_weights, 4, gpipe, *args)
        assert float((staged[0]["weights"] - fsdp).abs().max()) < 1e-7


def test_float8_on_stages_equals_one_process_on_the_same_micro_batches():
    """float8 (torchao's float8 linears under bf16 autocast) on pp2: one step equals one process accumulating
    the same two micro-batches (one process's float8 is compared with a hand-written torchao loop in
    tests/unit/test_parallel_options.py)."""
    one = run_ranks(pc.pipeline_weights, 1, "single", 1, 2, 0.5, 0.5, 40, True, 8, "llama", "float8")[0]["weights"]
    staged = run_ranks(pc.pipeline_weights, 2, lockstep.Parallel(pp=2), 1, 1, 0.5, 0.5, 40, True, 8, "llama", "float8")
    assert float((one - pc.reference(steps=1, clip=0.5)).abs().max()) > 1e-4
    assert float((staged[0]["weights"] - one).abs().max()) < 1e-7


@pytest.mark.parametrize("strategy, world", [(lockstep.Parallel(pp=2), 2), (lockstep.Parallel(pp=2), 4),
                                             (("ddp", lockstep.Parallel(pp=2, pp_schedule="ZBVZeroBubble")), 4)])
def test_an_inf_gradient_on_one_stage_skips_the_step_on_every_rank(strategy, world):
    """16-mixed: rank 0 (the first stage) alone holds an inf gradient at step 2; every rank skips that step."""
    results = [r["skipped"] for r in run_ranks(pc.skipped_on_every_stage, world, strategy)]
    assert all(result == results[0] for result in results), results
    assert results[0][2] == (True, True), results[0]
    assert all(skipped == unchanged for skipped, unchanged in results[0]), results[0]  # skipped: weights kept


@pytest.mark.parametrize("strategy, items", [(lockstep.Parallel(pp=2, pp_schedule="1F1B"), True),
                                             (("ddp", lockstep.Parallel(pp=2, pp_schedule="Interleaved1F1B")), True),
                                             (lockstep.Parallel(pp=2, pp_schedule="GPipe", pp_microbatches=4), False)])
def test_pipeline_times_data_parallel_with_accumulation_and_a_short_last_step(strategy, items):
    """pp2 × dp2 on 4 processes: 39 rows in global batches of 16 accumulated over 2 micro-steps (the last
    step's 7 rows split 4 + 3 over the data-parallel ranks, the 3 padded to 4 in the pipeline), clipped;
    token-averaged (num_items) or a plain per-row mean."""
    reference = pc.reference(steps=3, clip=0.5, rows=39, batch_size=16, items=items)
    results = run_ranks(pc.pipeline_weights, 4, strategy, 3, 2, 0.5, 0.5, 39, items, 16)
    _close(results, reference)
    assert [r["data"] for r in results] == [(0, 2), (1, 2), (0, 2), (1, 2)]  # pp outermost: ranks 0, 2 are a pipeline


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["ddp", "fsdp", "tp"])
def test_every_schedule_on_pipeline_times_data_or_tensor_parallel_reaches_the_one_process_weights(layout):
    """Every schedule on 4 processes: pp2 x dp2 (DDP, FSDP: a stage's parameters stay gathered through the
    step, which the zero-bubble schedules' weight pass needs) and pp2 x tp2, with accumulation, clipping,
    num_items, a short last step."""
    reference = pc.reference(steps=3, clip=0.5, rows=39, batch_size=16)
    for schedule in SCHEDULES:
        strategy = {"ddp": ("ddp", lockstep.Parallel(pp=2, pp_schedule=schedule)),
                    "fsdp": lockstep.Parallel(pp=2, pp_schedule=schedule),
                    "tp": lockstep.Parallel(pp=2, tp=2, pp_schedule=schedule)}[layout]
        _close(run_ranks(pc.pipeline_weights, 4, strategy, 3, 2, 0.5, 0.5, 39, True, 16), reference)


def test_the_trainer_on_pipeline_stages_reaches_the_one_process_weights():
    reference = pc.reference(steps=3, clip=0.5, rows=39, batch_size=16)
    for strategy, world in ((lockstep.Parallel(pp=2), 2), (lockstep.Parallel(pp=2), 4),
                            (lockstep.Parallel(pp=2, tp=2), 4)):
        _close(run_ranks(pc.trainer_weights, world, strategy), reference)
    _close(run_ranks(pc.trainer_weights, 1, "single"), reference)  # training_step on one process: the same


def test_a_pipeline_checkpoint_resumes_on_data_parallel_and_on_one_process(tmp_path):
    """Saved by pp2 × dp2 mid-epoch (each stage's parameters under the whole model's names), resumed on
    FSDP over 4 processes and on one process: the uninterrupted weights."""
    folder = str(tmp_path / "step-3")
    run = run_ranks(pc.save_and_finish, 4, lockstep.Parallel(pp=2), folder)[0]
    whole = run["weights"]
    for strategy, world in (("fsdp", 4), ("single", 1), (lockstep.Parallel(pp=2, pp_schedule="Interleaved1F1B"), 2)):
        resumed = run_ranks(pc.resume_and_finish, world, strategy, folder)[0]["weights"]
        assert torch.allclose(resumed, whole, atol=TOLERANCE, rtol=0), (strategy, float((resumed - whole).abs().max()))
    assert torch.equal(pc.flat_named(model_weights(Path(folder))), run["saved"])  # both stages' shards joined
    out = tmp_path / "hf"
    done = subprocess.run([sys.executable, "-m", "lockstep.cli.main", "checkpoint", "export", folder, str(out), "--hf"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    from transformers import LlamaForCausalLM

    exported = LlamaForCausalLM.from_pretrained(out)
    assert torch.equal(pc.flat_named(dict(exported.named_parameters())).detach(), run["saved"])


@pytest.mark.parametrize("strategy, world", [(lockstep.Parallel(pp=2), 4),
                                             (lockstep.Parallel(pp=2, pp_schedule="DualPipeV"), 2)])
def test_evaluation_on_pipeline_stages_gathers_each_row_once_in_dataset_order(strategy, world):
    """model(inputs) under torch.no_grad runs every stage in turn; every rank gets the output, rt.gather keeps
    one copy per data-parallel rank: 13 rows (zero-row padding batches on pp2 x dp2), one process's logits."""
    reference = pc.reference_logits()
    for result in run_ranks(pc.gathered_logits, world, strategy):
        assert result["indices"].tolist() == list(range(13))
        assert torch.allclose(result["logits"], reference, atol=1e-5, rtol=0)


def test_pipeline_times_tensor_parallel_reaches_the_one_process_weights_and_resumes_a_pp_dp_checkpoint(tmp_path):
    """pp2 x tp2 on 4 processes (the model's own tensor-parallel plan inside each stage): the one-process
    weights; a pp2 x dp2 checkpoint resumes on it to the uninterrupted weights."""
    reference = pc.reference(steps=3, clip=0.5, rows=39, batch_size=16)
    _close(run_ranks(pc.pipeline_weights, 4, lockstep.Parallel(pp=2, tp=2), 3, 2, 0.5, 0.5, 39, True, 16), reference)
    folder = str(tmp_path / "step-3")
    whole = run_ranks(pc.save_and_finish, 4, lockstep.Parallel(pp=2), folder)[0]["weights"]
    resumed = run_ranks(pc.resume_and_finish, 4, lockstep.Parallel(pp=2, tp=2), folder)[0]["weights"]
    assert torch.allclose(resumed, whole, atol=TOLERANCE, rtol=0), float((resumed - whole).abs().max())


def test_stages_without_data_parallel_run_outside_fsdp_in_any_precision():
    """FSDP over one rank only adds all-gathers; a mixed precision there is autocast's, as on one process."""
    for precision in ("32-true", "bf16-mixed"):
        assert run_ranks(pc.stage_under_fsdp, 2, lockstep.Parallel(pp=2), precision) == [False, False]
    assert run_ranks(pc.stage_under_fsdp, 4, lockstep.Parallel(pp=2), "bf16-mixed") == [True] * 4


@pytest.mark.parametrize("strategy, world", [(lockstep.Parallel(pp=2), 4),
                                             (lockstep.Parallel(pp=2, pp_schedule="DualPipeV"), 2)])
def test_the_trainer_validates_and_predicts_on_pipeline_stages(strategy, world):
    """validate and predict as on one process: the steps run as written, self(inputs) runs every stage; the
    token-mean loss over 13 rows (zero-row padding batches on pp2 x dp2) as computed by hand, every row's
    prediction once, in dataset order, the one-process logits."""
    loss, logits = pc.reference_validation(), pc.reference_logits()
    for result in run_ranks(pc.trainer_evaluation, world, strategy):
        assert abs(result["val_loss"] - loss) < 1e-6
        assert result["index"].tolist() == list(range(13))
        assert torch.allclose(result["first"], logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("world, strategy, layers, message", [
    (2, lockstep.Parallel(pp=2, pp_schedule="Interleaved1F1B"), 2, "4 stages, but LlamaForCausalLM has 2 block\\(s\\)"),
    (2, lockstep.Parallel(pp=3), 4, r"Parallel\(pp=3\) needs a world size divisible by tp × pp × cp = 3"),
    (2, lockstep.Parallel(pp=2, pp_microbatches=3), 4, "3 pipeline micro-batches do not divide this rank's batch of 8"),
    (2, lockstep.Parallel(pp=2, pp_stages=(("model.embed_tokens",), ("lm_head",))), 4,
     r"leaves \d+ parameter\(s\) in no stage"),
    (2, lockstep.Parallel(pp=2), 0, "found no repeated blocks"),
])
def test_bad_layouts_are_refused_before_any_stage_sends(world, strategy, layers, message):
    with pytest.raises(RanksFailed, match=message):
        run_ranks(pc.refused, world, strategy, layers, timeout=120)


@pytest.mark.parametrize(("between", "schedule", "evaluate", "message"), [
    ("tanh", "1F1B", False, "stage 0 hands on not what its last module layers.1 returned"),
    ("residual", "Interleaved1F1B", False, "hands on not what its last module layers.0 returned"),
    ("scale", "GPipe", True, "stage 1's first module layers.2 receives not what stage 0 handed on"),
])
def test_a_forward_that_is_not_a_chain_through_its_blocks_is_refused_on_every_rank(between, schedule, evaluate,
                                                                                    message):
    """Code between the blocks (an activation, a residual, a scale before the first) would run on every stage:
    the first training step (or evaluation) refuses it by name on both ranks, before the schedule sends."""
    with pytest.raises(RanksFailed, match=message) as failed:
        run_ranks(pc.refused, 2, lockstep.Parallel(pp=2, pp_schedule=schedule), between, evaluate, timeout=120)
    assert str(failed.value).count("a chain through its blocks") >= 2, str(failed.value)


def _trainer_job(folder, out, strategy: str, devices: int, kill_at: int = -1) -> subprocess.CompletedProcess:
    command = ([sys.executable, "tests/scripts/pipeline_trainer.py"] if devices == 1 else
               [sys.executable, "-m", "lockstep.cli.main", "run", "--devices", str(devices), "--accelerator", "cpu",
                "tests/scripts/pipeline_trainer.py"])
    return subprocess.run([*command, str(folder), str(out), strategy, str(kill_at)], cwd=Path(__file__).parents[2],
                          capture_output=True, text=True, timeout=240)


@pytest.mark.timeout(600)
def test_a_pipeline_trainer_run_killed_mid_epoch_resumes_on_data_parallel_and_on_one_process(tmp_path):
    """pp2 × dp2, rank 1 SIGKILLed at step 3 (checkpoints every 2 steps): the job ends; resumed from its
    step-2 checkpoint by FSDP on 4 processes, by pp2 × tp2 and by one process, each reaches the uninterrupted
    weights."""
    uninterrupted = _trainer_job(tmp_path / "plain", tmp_path / "plain.pt", "single", 1)
    assert uninterrupted.returncode == 0, uninterrupted.stderr[-3000:]
    reference = torch.load(tmp_path / "plain.pt")
    killed = _trainer_job(tmp_path / "pp", tmp_path / "killed.pt", "pp2", 4, kill_at=3)
    assert killed.returncode != 0 and not (tmp_path / "killed.pt").exists()
    for strategy, devices in (("fsdp", 4), ("pp2tp2", 4), ("single", 1)):
        folder = tmp_path / f"resumed-{strategy}"
        subprocess.run(["cp", "-r", str(tmp_path / "pp"), str(folder)], check=True)
        done = _trainer_job(folder, tmp_path / f"{strategy}.pt", strategy, devices)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "resumed from" in done.stdout + done.stderr and "step=00000002" in done.stdout + done.stderr
        resumed = torch.load(tmp_path / f"{strategy}.pt")
        assert resumed["steps"] == reference["steps"] == 8
        assert torch.allclose(resumed["weights"], reference["weights"], atol=TOLERANCE, rtol=0), \
            float((resumed["weights"] - reference["weights"]).abs().max())


def test_lockstep_verify_checks_a_pipeline_run_and_names_where_it_diverges():
    """On one process the script runs unsplit; on 2, pp2 with interleaved stages: 3 steps agree. A loss
    scaled by the rank that computes it (the last stage's) is named at step 1 with a parameter; a forward that
    is not a chain through its blocks is named as the cause."""
    def verify(mode: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "lockstep.cli.main", "verify", "tests/scripts/pipeline_verify.py",
                               "--devices", "2", "--accelerator", "cpu", "--steps", "3", mode],
                              cwd=Path(__file__).parents[2], capture_output=True, text=True, timeout=240)

    done = verify("ok")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "the run on 2 processes computes what one process computes: 3 steps agree" in done.stdout
    planted = verify("bug")
    assert planted.returncode == 1 and "DIVERGES at step 1" in planted.stderr, planted.stdout + planted.stderr
    not_a_chain = verify("tanh")  # one process trains it; on stages it is refused, and verify says why
    assert not_a_chain.returncode == 2, not_a_chain.stdout + not_a_chain.stderr
    assert "could not be checked" in not_a_chain.stderr and "a chain through its blocks" in not_a_chain.stderr


def test_a_float64_weighted_mean_under_one_is_reported_and_trained_as_on_one_process():
    """num_items a weighted mean's weight sum (below 1 per step) on a float64 model: the pipeline's reported
    loss is the step's weighted mean, and its weights are the one-process run's to float64 precision (a
    factor rounded to float32, or a share of a total clamped to 1, would show)."""
    one = run_ranks(pc.weighted_float64_steps, 1, "single")[0]
    staged = run_ranks(pc.weighted_float64_steps, 2, lockstep.Parallel(pp=2, pp_microbatches=4))
    for result in staged:
        assert result["losses"] == pytest.approx(one["losses"], rel=1e-12, abs=0)
        assert float((result["weights"] - one["weights"]).abs().max()) < 1e-12
    assert result["weights"].dtype == torch.float64
