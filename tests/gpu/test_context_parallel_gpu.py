"""Context parallel on CUDA: the ring with the SDPA flash kernel over NCCL (bf16), against the one-process
model. Needs 2 GPUs for cp2 (skipped otherwise); one GPU runs only the unsplit one-process reference, and the
refusal of float32 attention, which the CUDA flash kernel does not take."""

from __future__ import annotations

import pytest
import torch

import lockstep
from checks import context as cc
from checks import mesh as mc
from lockstep.testing import RanksFailed, run_ranks

pytestmark = [pytest.mark.timeout(300),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _weights(parallel, precision: str, steps: int = 3) -> torch.Tensor:
    rt = lockstep.Runtime(accelerator="cuda", seed=0, strategy="fsdp", parallel=parallel, precision=precision)
    model = cc.tiny_model()
    model, optimizer = rt.setup(model, cc.optimizer_for(model, cc.LR))
    for step, batch in enumerate(rt.loader(cc.Rows(), batch_size=8, num_workers=0)):
        rt.backward(model(**mc.model_inputs(batch)).loss, num_items=cc.valid_tokens(batch))
        optimizer.step()
        optimizer.zero_grad()
        if step + 1 == steps:
            break
    return cc.hc.flat(model).cpu()  # every rank: FSDP's shards gathered


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="cp2 needs 2 GPUs")
def test_cp2_on_two_gpus_reaches_the_one_gpu_weights_in_bf16():
    reference = run_ranks(_weights, 1, None, "bf16-mixed")[0]
    for weights in run_ranks(_weights, 2, lockstep.Parallel(cp=2), "bf16-mixed"):
        assert torch.allclose(weights, reference, atol=2e-2, rtol=0)  # bf16: the ring merges in float32


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="cp2 needs 2 GPUs")
def test_float32_attention_is_refused_on_cuda_with_what_to_do():
    with pytest.raises(RanksFailed, match="takes bfloat16 or float16"):
        run_ranks(_weights, 2, lockstep.Parallel(cp=2), "32-true")
