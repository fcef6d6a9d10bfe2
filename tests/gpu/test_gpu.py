"""GPU tier: CUDA placement, NCCL, mixed precision, pinned copies, determinism and resume on the GPU.

Skipped on machines without CUDA. With one GPU everything here runs except the two-GPU NCCL test.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import lockstep
from checks import dist as checks
from checks import trainer as trainer_checks
from lockstep import DistEnv, Runtime

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_tensors_model_and_batches_land_on_the_gpu():
    rt = Runtime(accelerator="cuda", devices=1, env=DistEnv())
    assert rt.device == torch.device("cuda", 0)
    model = rt.setup(checks.make_model())
    assert next(model.parameters()).device == rt.device
    x, _ = next(iter(rt.loader(checks.make_data(32), batch_size=8, num_workers=0)))
    assert x.device == rt.device


def test_devices_list_picks_that_gpu():
    rt = Runtime(accelerator="cuda", devices=[0], env=DistEnv())
    assert rt.device == torch.device("cuda", 0)


def _device_in_a_child(visible: str) -> subprocess.CompletedProcess[str]:
    code = "import lockstep; print(lockstep.Runtime(accelerator='cuda', env=lockstep.DistEnv()).device)"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": visible}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_cuda_visible_devices_is_honoured():
    shown = _device_in_a_child("0")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == "cuda:0"
    hidden = _device_in_a_child("")
    assert hidden.returncode != 0
    assert "CUDA" in hidden.stderr.strip().splitlines()[-1]  # a clear error, not a crash inside torch


def _one_step_loss(precision: str) -> tuple[torch.Tensor, torch.dtype, torch.dtype]:
    """The loss, the dtype the first layer computed in, and the weights' dtype after one step."""
    rt = Runtime(accelerator="cuda", devices=1, precision=precision, env=DistEnv())
    model = checks.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    computed: list[torch.dtype] = []
    first = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
    first.register_forward_hook(lambda module, args, out: computed.append(out.dtype))
    model, optimizer = rt.setup(model, optimizer)
    x, y = (t.to(rt.device) for t in checks.make_data(64).tensors)
    logits = model(x)
    # mixed precision hands outputs back as float32; a true precision keeps its own dtype
    assert logits.dtype == (torch.bfloat16 if precision == "bf16-true" else torch.float32)
    loss = F.cross_entropy(logits, y)
    rt.backward(loss)
    optimizer.step()
    return loss.detach().cpu(), computed[0], next(model.parameters()).dtype


def test_bf16_mixed_computes_in_bf16_and_keeps_fp32_weights():
    reference, ref_dtype, _ = _one_step_loss("32-true")
    loss, activations, weights = _one_step_loss("bf16-mixed")
    assert ref_dtype == torch.float32 and activations == torch.bfloat16 and weights == torch.float32
    assert abs(float(loss) - float(reference)) < 2e-2


def test_bf16_true_keeps_bf16_weights():
    loss, activations, weights = _one_step_loss("bf16-true")
    assert activations == torch.bfloat16 and weights == torch.bfloat16
    assert torch.isfinite(loss)


def test_16_mixed_on_cuda_skips_the_inf_step_and_lowers_the_scale():
    rt = Runtime(accelerator="cuda", devices=1, precision="16-mixed", env=DistEnv())
    model = checks.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = rt.setup(model, optimizer)
    x, y = (t.to(rt.device) for t in checks.make_data(8).tensors)
    before = checks.flat_weights(model).clone()
    scale = rt.precision.scaler.get_scale()
    rt.backward(F.cross_entropy(model(x), y))
    next(model.parameters()).grad[0, 0] = float("inf")
    optimizer.step()
    assert rt.step_was_skipped and torch.equal(before, checks.flat_weights(model))
    assert rt.precision.scaler.get_scale() < scale


def test_loader_pins_host_memory_and_copies_without_blocking(monkeypatch):
    import lockstep.runtime.data.loader as data

    seen: list[bool] = []
    real = data.to_device

    def recording(batch, device, non_blocking=False):
        seen.append(non_blocking)
        return real(batch, device, non_blocking)

    monkeypatch.setattr(data, "to_device", recording)
    rt = Runtime(accelerator="cuda", devices=1, env=DistEnv())
    loader = rt.loader(checks.make_data(64), batch_size=16, num_workers=2)
    assert loader.loader.pin_memory
    raw_x, _ = next(iter(loader.loader))
    assert raw_x.is_pinned()
    batches = list(loader)
    assert len(batches) == 4 and all(x.is_cuda for x, _ in batches)
    assert seen == [True] * 4


def _fit_on_gpu(tmp_path=None, epochs: int = 2, resume: str | None = None) -> torch.Tensor:
    module = trainer_checks.Classifier(dropout=0.2)
    options = dict(accelerator="cuda", devices=1, max_epochs=epochs, deterministic=True)
    if tmp_path is not None:
        options.update(checkpoint_dir=str(tmp_path), resume=resume)
    trainer_checks.quiet_trainer(**options).fit(module, checks.make_data(103), batch_size=16)
    return checks.flat_weights(module).cpu()


def test_deterministic_runs_are_bitwise_equal_on_the_gpu():
    assert torch.equal(_fit_on_gpu(), _fit_on_gpu())


def test_fit_checkpoint_resume_is_bitwise_on_the_gpu(tmp_path):
    uninterrupted = _fit_on_gpu(epochs=2)
    _fit_on_gpu(tmp_path, epochs=1)
    resumed = _fit_on_gpu(tmp_path, epochs=2, resume="auto")
    assert torch.equal(uninterrupted, resumed)


def test_a_gpu_checkpoint_loads_in_a_cpu_process(tmp_path):
    rt = Runtime(accelerator="cuda", devices=1, env=DistEnv())
    model = rt.setup(checks.make_model(seed=3))
    rt.save(tmp_path / "ckpt", {"model": model, "step": 7})
    cpu = Runtime(accelerator="cpu", env=DistEnv())
    plain = cpu.setup(checks.make_model(seed=4))
    state = cpu.load(tmp_path / "ckpt", {"model": plain, "step": 0})
    assert state["step"] == 7
    assert torch.equal(checks.flat_weights(plain), checks.flat_weights(model).cpu())


def test_dp_on_one_gpu_warns_and_trains():
    with pytest.warns(UserWarning, match="DataParallel"):
        rt = Runtime(accelerator="cuda", devices=1, strategy="dp", env=DistEnv())
        model = checks.make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = rt.setup(model, optimizer)
    before = checks.flat_weights(model).clone()
    x, y = (t.to(rt.device) for t in checks.make_data(16).tensors)
    rt.backward(F.cross_entropy(model(x), y))
    optimizer.step()
    assert not torch.equal(before, checks.flat_weights(model))


def _built_empty_and_trained(strategy: str) -> tuple[torch.Tensor, torch.device]:
    rt = Runtime(accelerator="cuda", devices=1, strategy=strategy, seed=0, env=DistEnv())
    with rt.init_module(empty=True):
        model = checks.make_model()
    model = rt.setup(model)
    device = next(model.parameters()).device
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for x, y in rt.loader(checks.make_data(64), batch_size=16, num_workers=0):
        rt.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    return checks.flat_weights(model).cpu(), device


def test_fsdp_with_one_rank_materialises_on_the_gpu_and_trains_as_one_device():
    fsdp, device = _built_empty_and_trained("fsdp")
    single, _ = _built_empty_and_trained("single")
    assert device == torch.device("cuda", 0) and torch.isfinite(fsdp).all()
    assert torch.equal(fsdp, single)


def test_nccl_with_one_rank_runs_its_collectives():
    """A one-process job needs no group, so lockstep makes none; this builds one through lockstep's
    own process-group code (store, device binding) to check that NCCL and its collectives run."""
    from lockstep.runtime.comm.network import free_port
    from lockstep.runtime.comm.process_group import init_process_group

    env = DistEnv(master_addr="127.0.0.1", master_port=free_port(), launcher="env")
    device = torch.device("cuda", 0)
    assert init_process_group(env, "nccl", 60.0, None, device)
    try:
        assert dist.get_backend() == "nccl"
        value = torch.arange(3.0, device=device)
        dist.all_reduce(value)
        gathered = [torch.empty(3, device=device)]
        dist.all_gather(gathered, value)
        dist.broadcast(value, src=0)
        dist.barrier()
        torch.cuda.synchronize()
        assert value.tolist() == [0.0, 1.0, 2.0] and gathered[0].tolist() == [0.0, 1.0, 2.0]
    finally:
        dist.destroy_process_group()


def _nccl_sum() -> float:
    rt = Runtime(accelerator="cuda")
    assert rt.device == torch.device("cuda", rt.local_rank)
    return float(rt.all_reduce(torch.ones(1, device=rt.device) * (rt.rank + 1), op="sum"))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_all_reduce_on_two_gpus():
    assert lockstep.launch(_nccl_sum, nprocs=2) == 3.0


def test_compile_on_the_gpu_matches_eager_without_graph_breaks():
    from torch._dynamo.utils import counters

    from checks import compile as compile_checks

    rt = Runtime(accelerator="cuda", devices=1, env=DistEnv(), seed=0)
    eager, _ = compile_checks.train(rt, compile_checks.Net(), compile=None)
    counters.clear()
    compiled, model = compile_checks.train(rt, compile_checks.Net(), compile=True)
    assert rt.compiled == ["blocks.0", "blocks.1", "blocks.2"]
    assert dict(counters["graph_break"]) == {} and counters["stats"]["unique_graphs"] >= 1
    assert (compiled - eager).abs().max() <= 1e-3
    assert sorted(model.state_dict()) == sorted(compile_checks.Net().state_dict())


def test_num_items_under_16_mixed_matches_the_global_token_mean():
    from checks import hf as hf_checks

    skipped = []

    def run(num_items: bool) -> torch.Tensor:
        rt = Runtime(accelerator="cuda", devices=1, env=DistEnv(), seed=0, precision="16-mixed")
        model = hf_checks.tiny_gpt2()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        model, optimizer = rt.setup(model, optimizer)
        loader = rt.loader(hf_checks.sequences(), batch_size=4, collate_fn=hf_checks.pad, num_workers=0)
        for i, batch in enumerate(loader):  # accumulation 2: 8 sequences per step, 5 steps
            with rt.no_sync(model, enabled=i % 2 == 0):
                loss = model(**batch).loss
                rt.backward(loss, num_items=hf_checks.valid_tokens(batch)) if num_items else rt.backward(loss / 2)
            if i % 2 == 1:
                optimizer.step()
                optimizer.zero_grad()
                skipped.append(rt.step_was_skipped)
        return hf_checks.flat(model).float().cpu()

    reference = hf_checks.reference_weights()
    with_items = float((run(True) - reference).abs().max())
    assert not any(skipped), skipped  # the scaled backward stays near the loss's size: no fp16 overflow
    without = float((run(False) - reference).abs().max())
    assert with_items < without, (with_items, without)


OFFLOAD = """
import torch, torch.nn.functional as F, lockstep
from torch import nn
rt = lockstep.Runtime(accelerator="cuda", devices=1, strategy=lockstep.FSDP(cpu_offload=True), precision="bf16-mixed")
with rt.init_module(empty=True):
    model = nn.Sequential(*[nn.Linear(4096, 4096) for _ in range(16)])  # 268 M parameters, 1 GiB in float32
model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=1e-3))
local = [p.to_local() for p in model.parameters()]
assert all(t.device.type == "cpu" for t in local), "shards are not in host memory"
torch.cuda.reset_peak_memory_stats()
x = torch.randn(8, 4096, device=rt.device)
rt.backward(model(x).float().square().mean())
optimizer.step()
peak = torch.cuda.max_memory_allocated()
print("peak", peak)
assert peak < 0.5 * sum(t.numel() * 4 for t in local), peak  # one block at a time on the GPU, not the model
rt.close()
"""


def test_cpu_offload_on_one_gpu_keeps_the_shards_in_host_memory():
    done = subprocess.run([sys.executable, "-c", OFFLOAD], capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, done.stderr[-3000:]


def test_float8_is_refused_below_compute_capability_8_9(monkeypatch):
    pytest.importorskip("torchao.float8")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="'float8' needs compute capability 8.9 or newer .* has 8.0: use 'bf16-mixed'"):
        Runtime(accelerator="cuda", devices=1, precision="float8", env=DistEnv())


def _float8_stack() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256),
                               torch.nn.GELU(), torch.nn.Linear(256, 16))


def test_float8_runs_its_matmuls_in_float8_and_equals_a_hand_written_torchao_loop():
    pytest.importorskip("torchao.float8")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 matrix products need compute capability 8.9+")
    from torchao.float8 import convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear

    generator = torch.Generator().manual_seed(1)
    batches = [(torch.randn(64, 256, generator=generator), torch.randint(0, 16, (64,), generator=generator))
               for _ in range(4)]
    rt = Runtime(accelerator="cuda", devices=1, precision="float8", env=DistEnv(), seed=0)
    model = _float8_stack()
    model, optimizer = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert sum(isinstance(m, Float8Linear) for m in model.modules()) == 3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for x, y in batches:
            rt.backward(F.cross_entropy(model(x.cuda()), y.cuda()))
            optimizer.step()
            optimizer.zero_grad()
    kernels = " ".join(e.key.lower() for e in prof.key_averages())
    assert "e4m3" in kernels or "fp8" in kernels or "f8" in kernels, kernels[:2000]  # float8 GEMMs ran

    plain = convert_to_float8_training(_float8_stack().cuda(), module_filter_fn=lambda m, name: True)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    for x, y in batches:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = plain(x.cuda())
        F.cross_entropy(logits.float(), y.cuda()).backward()
        plain_optimizer.step()
        plain_optimizer.zero_grad()
    ours, theirs = checks.flat_weights(model), checks.flat_weights(plain)
    assert float((ours - theirs).abs().max()) <= 1e-6


def test_activation_checkpointing_on_the_gpu_keeps_the_weights():
    from checks import mesh as mc

    def weights(mode):
        return mc.mesh_weights("single", 1, None, mode, 3, accelerator="cuda", devices=1)["weights"]

    plain = weights(None)
    for mode in ("full", "selective"):
        assert torch.allclose(weights(mode), plain, atol=1e-6, rtol=0), mode
