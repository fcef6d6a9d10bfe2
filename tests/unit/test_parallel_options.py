"""Tensor-parallel plans refused before anything moves, activation checkpointing in place, clipping
over several meshes' worth of tensors, and float8 refused where it cannot run."""

from __future__ import annotations

import contextlib
import copy
import io
import sys
import warnings

import pytest
import torch
from torch import nn

import lockstep
from lockstep.runtime.parallel.activation_checkpointing import checkpoint_activations
from lockstep.runtime.parallel.grad_norm import clip_grad_norm
from lockstep.runtime.parallel.precision import make_precision
from lockstep.runtime.parallel.tensor_parallel import explain_failure, plan_of, resolve_plan

pytestmark = pytest.mark.timeout(120)


class Block(nn.Module):
    calls = 0

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        Block.calls += 1
        return x + self.down(torch.tanh(self.up(x)))


class Net(nn.Module):
    def __init__(self, depth: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block() for _ in range(depth)])
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def grads_and_calls(policy) -> tuple[torch.Tensor, int]:
    model = Net()
    names = checkpoint_activations(model, policy)
    Block.calls = 0
    model(torch.randn(4, 16, generator=torch.Generator().manual_seed(1))).square().sum().backward()
    assert policy is None or names
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]), Block.calls


@pytest.mark.parametrize("policy", ["full", "selective", lambda name, m: name == "blocks.1"])
def test_checkpointed_blocks_recompute_in_the_backward_and_give_the_same_gradients(policy):
    plain, plain_calls = grads_and_calls(None)
    grads, calls = grads_and_calls(policy)
    assert plain_calls == 3
    assert calls == (4 if callable(policy) else 6)  # each checkpointed block's forward runs again
    assert torch.allclose(grads, plain, atol=1e-6, rtol=0)


def test_checkpointing_keeps_names_is_idempotent_and_survives_a_deepcopy():
    model = Net()
    before = list(model.state_dict())
    assert checkpoint_activations(model, "full") == ["blocks.0", "blocks.1", "blocks.2"]
    checkpoint_activations(model, "full")
    assert list(model.state_dict()) == before
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.blocks[0].down.weight.zero_()
        twin.blocks[0].down.bias.zero_()
    x = torch.randn(2, 16)
    assert not torch.allclose(twin(x), model(x))  # the copy runs its own weights


def test_checkpointing_without_repeated_blocks_or_with_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="found no repeated blocks in Linear"):
        checkpoint_activations(nn.Linear(2, 2), "full")
    with pytest.raises(ValueError, match="activation_checkpointing='most'"):
        checkpoint_activations(Net(), "most")


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.out = nn.Linear(16, 12), nn.Linear(12, 16)
        self.norm = nn.LayerNorm(16)


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Attention(), Attention()])


def test_a_plan_resolves_patterns_and_refuses_what_does_not_fit():
    plan = {"layers.*.q": "colwise", "layers.*.out": "rowwise"}
    assert sorted(resolve_plan(Decoder(), plan, 2)) == ["layers.0.out", "layers.0.q", "layers.1.out", "layers.1.q"]
    with pytest.raises(ValueError, match=r"'layers.0.q' \(Linear\) has out_features=12, which colwise cannot split "
                                         r"into tp=5"):
        resolve_plan(Decoder(), plan, 5)
    with pytest.raises(ValueError, match="'blocks.\\*.q' matches no module of Decoder"):
        resolve_plan(Decoder(), {"blocks.*.q": "colwise"}, 2)
    with pytest.raises(ValueError, match="'layers.0.norm' is a LayerNorm; colwise splits only"):
        resolve_plan(Decoder(), {"layers.*.norm": "colwise"}, 2)
    with pytest.raises(ValueError, match="matched by both"):
        resolve_plan(Decoder(), {"layers.*.q": "colwise", "layers.0.q": "rowwise"}, 2)
    with pytest.raises(ValueError, match="style 'diagonal'"):
        resolve_plan(Decoder(), {"layers.*.q": "diagonal"}, 2)


def test_a_hugging_face_model_brings_its_plan_wherever_it_sits():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    holder = nn.Module()
    holder.llama = LlamaForCausalLM(config)
    plan = plan_of(holder, None)
    assert plan["llama.lm_head"] == "colwise_gather_output"
    assert plan["llama.model.layers.*.self_attn.q_proj"] == "colwise"
    assert len(resolve_plan(holder, plan, 2)) == 9
    with pytest.raises(ValueError, match="Net ships none"):
        plan_of(Net(), None)


def test_clipping_over_tensors_of_no_mesh_equals_torch():
    ours, theirs = Net(), Net()
    for model in (ours, theirs):
        model(torch.ones(3, 16)).sum().backward()
    norm = clip_grad_norm(ours.parameters(), 0.1)
    expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.1)
    assert torch.equal(norm, expected)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(ours.parameters(), theirs.parameters(), strict=True))


def test_float8_is_refused_at_setup_where_torch_has_no_float8_matmul_or_torchao_is_missing(monkeypatch):
    pytest.importorskip("torchao.float8")

    def no_kernel(*args, **kwargs):
        raise RuntimeError("no kernel for Float8_e4m3fn")

    monkeypatch.setattr(torch.nn.functional, "scaled_mm", no_kernel)
    with pytest.raises(ValueError, match="'float8' needs float8 matrix products, which torch .* does not run on cpu"):
        lockstep.Runtime(accelerator="cpu", precision="fp8")
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "torchao", None)  # what an environment without torchao imports
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ValueError, match="runs through torchao, which is not installed: pip install torchao"):
        make_precision("float8", torch.device("cpu"))


def _tiny_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 3))


def _train_with_lockstep(precision: str, x: torch.Tensor, y: torch.Tensor) -> nn.Module:
    rt = lockstep.Runtime(accelerator="cpu", precision=precision)
    model = _tiny_mlp()
    model, optimizer = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for xb, yb in zip(x, y, strict=True):
        rt.backward(nn.functional.cross_entropy(model(xb), yb))
        optimizer.step()
        optimizer.zero_grad()
    return lockstep.unwrap(model)


def test_float8_trains_on_the_cpu_as_a_hand_written_torchao_loop_does():
    """One process: lockstep's ``float8`` against convert_to_float8_training + bf16 autocast by hand."""
    float8 = pytest.importorskip("torchao.float8")
    torch.manual_seed(1)
    x, y = torch.randn(6, 8, 16), torch.randint(0, 3, (6, 8))
    ours = _train_with_lockstep("float8", x, y)
    assert [type(m).__name__ for m in ours] == ["Float8Linear", "ReLU", "Float8Linear", "ReLU", "Linear"]  # 3: not /16

    plain = float8.convert_to_float8_training(
        _tiny_mlp(), module_filter_fn=lambda m, name: m.in_features % 16 == 0 and m.out_features % 16 == 0)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for xb, yb in zip(x, y, strict=True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = plain(xb)
        nn.functional.cross_entropy(out.float(), yb).backward()
        plain_optimizer.step()
        plain_optimizer.zero_grad()
    for a, b in zip(ours.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)
    bf16 = _train_with_lockstep("bf16-mixed", x, y)  # the conversion changed the arithmetic
    assert not all(torch.equal(a, b) for a, b in zip(ours.parameters(), bf16.parameters(), strict=True))


def test_a_llama_is_cut_into_stages_by_layer_with_the_embedding_first_and_the_head_last():
    """The blocks split evenly; a left-over block goes to a middle stage before the first or the last (those
    also hold the embedding and the head); modules without parameters (rotary embeddings) stay everywhere."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from lockstep.runtime.parallel.pipeline.stages import Skipped, keep_stages, split_model, stage_views

    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=5,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False)
    stages = split_model(LlamaForCausalLM(config), 3)
    assert stages == [["model.embed_tokens", "model.layers.0", "model.layers.1"], ["model.layers.2", "model.layers.3"],
                      ["model.layers.4", "model.norm", "lm_head"]]
    assert split_model(LlamaForCausalLM(config), 2) == [
        ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.layers.2"],
        ["model.layers.3", "model.layers.4", "model.norm", "lm_head"]]
    model = LlamaForCausalLM(config)
    four = split_model(model, 4)
    keep_stages(model, four, [0, 3])  # a V layout's rank 0: the first and the last stage
    assert isinstance(model.model.layers[2], Skipped) and not isinstance(model.lm_head, Skipped)
    first, last = stage_views(model, four, [0, 3])
    assert isinstance(first.lm_head, Skipped) and first.model.embed_tokens is model.model.embed_tokens
    assert isinstance(last.model.embed_tokens, Skipped) and last.lm_head is model.lm_head
    names = {name for name, _ in model.named_parameters()}
    assert names == {n for n, _ in first.named_parameters()} | {n for n, _ in last.named_parameters()}
    tied = LlamaForCausalLM(LlamaConfig(**{**config.to_dict(), "tie_word_embeddings": True}))
    with pytest.raises(lockstep.ConfigError, match="one tied parameter"):
        keep_stages(tied, split_model(tied, 2), [0])


def test_stage_layouts_are_looped_or_v_shaped_as_torch_schedules_expect():
    from lockstep.runtime.parallel.pipeline.stages import check_settings, stages_of_rank

    assert [stages_of_rank(r, 4, "1F1B") for r in range(4)] == [[0], [1], [2], [3]]
    assert [stages_of_rank(r, 4, "Interleaved1F1B") for r in range(4)] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert [stages_of_rank(r, 4, "DualPipeV") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert check_settings(2, "zbvzerobubble", None, None, "FSDP") == ("ZBVZeroBubble", 4)
    with pytest.raises(lockstep.ConfigError, match="pp_stages gives 3"):
        check_settings(2, "GPipe", 2, (("a",), ("b",), ("c",)), "FSDP")
    with pytest.raises(lockstep.ConfigError, match="pp_microbatches=0"):
        check_settings(2, "GPipe", 0, None, "FSDP")


def test_forward_backward_on_one_process_is_the_forward_the_loss_and_rt_backward():
    """Without pipeline stages, rt.forward_backward is loss_fn(model(inputs), batch) and rt.backward: the same
    gradients as a hand-written step, num_items included."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16))
    reference = copy.deepcopy(net)
    batch = {"input_ids": torch.randint(0, 16, (4, 5)), "labels": torch.randint(0, 16, (4, 5))}

    def loss_fn(logits, rows):
        return nn.functional.cross_entropy(logits.reshape(-1, 16), rows["labels"].reshape(-1))

    rt = lockstep.Runtime(accelerator="cpu")
    model, optimizer = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.5))
    loss = rt.forward_backward(model, batch, loss_fn, num_items=lambda rows: rows["labels"].numel())
    optimizer.step()
    expected = loss_fn(reference(batch["input_ids"]), batch)
    expected.backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    assert torch.equal(loss, expected.detach()) and not loss.requires_grad
    for mine, theirs in zip(net.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(mine, theirs, atol=1e-7)
    with pytest.raises(lockstep.ConfigError, match="unknown pipeline schedule"):
        lockstep.Parallel(pp=2, pp_schedule="zigzag")


def test_parallel_holds_the_degrees_and_each_strategy_means_one_layout_on_it():
    """``lockstep.Parallel`` is the one place for the mesh's degrees: each (strategy, Parallel, world size)
    gives one strategy object and one layout, by hand: (replicate, shard, tp, pp)."""
    from lockstep.runtime.parallel.strategy import DDP, FSDP, SingleDevice, make_strategy

    def made(strategy, world, parallel=None):
        chosen, layout = make_strategy(strategy, world, parallel)
        return type(chosen).__name__, chosen.name, (layout.replicate, layout.shard, layout.tp, layout.pp)

    assert made("ddp", 2) == ("DDP", "ddp", (1, 2, 1, 1))
    assert made("auto", 4) == ("DDP", "ddp", (1, 4, 1, 1))
    assert made("fsdp", 4) == ("FSDP", "fsdp", (1, 4, 1, 1))
    assert made("ddp", 1) == made("fsdp", 1) == ("SingleDevice", "single", (1, 1, 1, 1))
    assert made(FSDP(cpu_offload=True), 1)[0] == "FSDP"  # offload on one device stays FSDP
    assert made("fsdp", 8, lockstep.Parallel(tp=2)) == ("FSDP", "fsdp", (1, 4, 2, 1))
    assert made("fsdp", 16, lockstep.Parallel(replicate=2, tp=4)) == ("FSDP", "fsdp", (2, 2, 4, 1))
    assert made("fsdp", 8, lockstep.Parallel(pp=2, tp=2)) == ("FSDP", "fsdp", (1, 2, 2, 2))
    # DDP on a mesh: replication over every data-parallel rank, built as FSDP2 over (replicate, shard = 1)
    assert made("ddp", 8, lockstep.Parallel(tp=2)) == ("FSDP", "ddp", (4, 1, 2, 1))
    assert made("auto", 8, lockstep.Parallel(pp=2)) == ("FSDP", "ddp", (4, 1, 1, 2))
    assert made(DDP(), 8, lockstep.Parallel(tp=2, replicate=4)) == ("FSDP", "ddp", (4, 1, 2, 1))
    # context parallel: a degree of its own, outside the data-parallel ones (which are the rest)
    assert made("fsdp", 8, lockstep.Parallel(cp=2))[2] == (1, 4, 1, 1)
    assert make_strategy("fsdp", 8, lockstep.Parallel(cp=2, tp=2))[1].cp == 2
    assert made("ddp", 8, lockstep.Parallel(cp=4)) == ("FSDP", "ddp", (2, 1, 1, 1))
    with contextlib.redirect_stdout(io.StringIO()) as said:  # one process: the unsplit reference, said once
        assert made("fsdp", 1, lockstep.Parallel(tp=2)) == ("SingleDevice", "single", (1, 1, 1, 1))
    assert "Parallel(tp=2) on one process: the model runs unsplit" in said.getvalue()
    with contextlib.redirect_stdout(io.StringIO()) as said:
        assert made("ddp", 1, lockstep.Parallel(cp=2)) == ("SingleDevice", "single", (1, 1, 1, 1))
    assert "Parallel(cp=2) on one process: the model runs unsplit" in said.getvalue()
    assert isinstance(make_strategy("ddp", 1)[0], SingleDevice)
    for refused, message in (
            (lambda: make_strategy("ddp", 8, lockstep.Parallel(tp=2, replicate=2)), "every data-parallel rank"),
            (lambda: make_strategy(DDP(static_graph=True), 4, lockstep.Parallel(tp=2)), "none of static_graph"),
            (lambda: make_strategy("dp", 4, lockstep.Parallel(tp=2)), "strategy 'ddp' or 'fsdp', not 'dp'"),
            (lambda: make_strategy("fsdp", 6, lockstep.Parallel(tp=4)), "divisible by tp × pp × cp = 4"),
            (lambda: make_strategy("ddp", 6, lockstep.Parallel(cp=4)), "divisible by tp × pp × cp = 4"),
            (lambda: make_strategy("fsdp", 4, {"tp": 2}), "give lockstep.Parallel"),
            (lambda: lockstep.Parallel(tp=0), "a degree is a whole number"),
            (lambda: lockstep.Parallel(cp=2, pp=2), "context parallel with pipeline parallel is not supported"),
            (lambda: lockstep.FSDP(tp=2, pp=2), r"Runtime\(parallel=lockstep.Parallel\(tp=2, pp=2\)\)"),
            (lambda: lockstep.DDP(tp_plan={}), "DDP keeps only its own options")):
        with pytest.raises(lockstep.ConfigError, match=message):
            refused()


def test_the_launcher_s_parallel_text_becomes_the_runtime_s_parallel_and_bad_text_is_refused(monkeypatch):
    """`lockstep run --parallel tp=2,pp=2,pp_schedule=GPipe` (LOCKSTEP_PARALLEL) fills in a Runtime that gives no
    parallel=; one written in code wins; malformed text is refused by name (lockstep run: before any process)."""
    from lockstep.cli.main import main
    from lockstep.runtime.config import RuntimeConfig
    from lockstep.runtime.parallel.mesh import parallel_from_text

    assert parallel_from_text("tp=2, pp=2,pp_schedule=GPipe,pp_microbatches=4") == lockstep.Parallel(
        tp=2, pp=2, pp_schedule="GPipe", pp_microbatches=4)
    for bad, says in (("tp=two", "tp='two' is not a whole number"), ("tp_plan=x", "give NAME=VALUE pairs"),
                      ("tp", "give NAME=VALUE pairs")):
        with pytest.raises(lockstep.ConfigError, match=says):
            parallel_from_text(bad)
    monkeypatch.setenv("LOCKSTEP_PARALLEL", "tp=2")
    assert RuntimeConfig().resolved().parallel == lockstep.Parallel(tp=2)
    assert RuntimeConfig(parallel=lockstep.Parallel(pp=2)).resolved().parallel == lockstep.Parallel(pp=2)
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        assert main(["run", "--parallel", "tp=x", "--accelerator", "cpu", "t.py"]) == 2
    assert "--parallel 'tp=x': tp='x' is not a whole number" in stderr.getvalue()


def test_degrees_that_do_not_divide_the_launched_world_are_refused_before_any_worker_starts(tmp_path):
    """`lockstep run --devices 3 --parallel cp=2`: refused by the launcher (exit code 2, the fix named), where
    each worker would have refused it after its start; under --fault-tolerant, each replica group's world.
    One process is a reference run (the model unsplit): never refused."""
    from lockstep.cli.main import main
    from lockstep.cli.run import _Checks

    script = tmp_path / "t.py"
    script.write_text(f"open({str(tmp_path / 'started')!r}, 'w').close()\n")
    for options, says in ((["--devices", "3", "--parallel", "cp=2"], "tp × pp × cp = 2, but the job has 3"),
                          (["--devices", "3", "--parallel", "tp=2,pp=2"], "tp × pp × cp = 4, but the job has 3"),
                          (["--devices", "4", "--fault-tolerant", "--replicas", "2", "--parallel", "cp=4"],
                           "tp × pp × cp = 4, but the job has 2")):
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr):
            assert main(["run", "--accelerator", "cpu", *options, str(script)]) == 2
        assert says in stderr.getvalue() and "launch a multiple of" in stderr.getvalue()
    assert not (tmp_path / "started").exists()
    _Checks.layout("tp=2,cp=2", 1)  # one process: no error
    _Checks.layout("tp=2,cp=2", 8)


def test_a_launcher_choice_the_code_replaces_is_said(monkeypatch):
    from lockstep.runtime.config import RuntimeConfig

    monkeypatch.setenv("LOCKSTEP_PARALLEL", "tp=2")
    monkeypatch.setenv("LOCKSTEP_PRECISION", "bf16-mixed")
    with pytest.warns(UserWarning, match=r"parallel=Parallel\(pp=2\) given in the code replaces the launcher's "
                                         r"--parallel tp=2"):
        resolved = RuntimeConfig(parallel=lockstep.Parallel(pp=2)).resolved()
    assert resolved.parallel == lockstep.Parallel(pp=2) and resolved.precision == "bf16-mixed"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same choice in both places: nothing to say
        RuntimeConfig(parallel=lockstep.Parallel(tp=2), precision="bf16-mixed").resolved()


@pytest.mark.parametrize("variable, launcher, code", [
    ("LOCKSTEP_ACCELERATOR", "cuda", {"accelerator": "gpu"}),
    ("LOCKSTEP_PRECISION", "16-mixed", {"precision": 16}),
    ("LOCKSTEP_STRATEGY", "ddp", {"strategy": "DDP"}),
    ("LOCKSTEP_PARALLEL", "tp=2", {"parallel": lockstep.Parallel(tp=2, tp_plan={"a": "colwise"})}),  # the plan: code's
])
def test_the_same_choice_spelled_otherwise_is_no_replacement(monkeypatch, variable, launcher, code):
    from lockstep.runtime.config import RuntimeConfig

    monkeypatch.setenv(variable, launcher)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RuntimeConfig(**code).resolved()


def test_a_forward_error_of_a_split_model_is_explained_only_when_it_is_a_matrix_products_widths():
    """The plan is blamed for a width mismatch after split modules (the e2e tests run the real thing on 2
    processes); an out-of-memory error or the model's own error goes through as it was raised."""
    model = nn.Sequential(Block(), nn.Linear(16, 4))
    assert explain_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x4)"), model) is None
    model[0].up.__dict__["_lockstep_tp_split"] = ("0.up", "colwise", 2)  # what apply_plan marks a split module with
    explained = explain_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x4)"), model)
    assert explained is not None and "after the split modules '0.up' (colwise)" in str(explained)
    assert "each colwise module needs a rowwise one after it" in str(explained)
    assert explain_failure(RuntimeError("the model's own check failed"), model) is None
    assert explain_failure(RuntimeError("The size of tensor a (4) must match the size of tensor b (3)"), model) is None
    assert explain_failure(torch.OutOfMemoryError("out of memory: tried to allocate 2 GiB, size"), model) is None
