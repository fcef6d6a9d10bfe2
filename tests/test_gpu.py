"""GPU tier: CUDA placement, NCCL and mixed precision. Skipped on machines without CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dist_checks as checks
import lockstep
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


def test_16_mixed_on_cuda_skips_the_inf_step():
    rt = Runtime(accelerator="cuda", devices=1, precision="16-mixed", env=DistEnv())
    model = checks.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = rt.setup(model, optimizer)
    x, y = (t.to(rt.device) for t in checks.make_data(8).tensors)
    before = checks.flat_weights(model).clone()
    rt.backward(F.cross_entropy(model(x), y))
    next(model.parameters()).grad[0, 0] = float("inf")
    optimizer.step()
    assert rt.step_was_skipped and torch.equal(before, checks.flat_weights(model))


def _nccl_sum() -> float:
    rt = Runtime(accelerator="cuda")
    assert rt.device == torch.device("cuda", rt.local_rank)
    return float(rt.all_reduce(torch.ones(1, device=rt.device) * (rt.rank + 1), op="sum"))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_nccl_all_reduce_on_two_gpus():
    assert lockstep.launch(_nccl_sum, nprocs=2) == 3.0
