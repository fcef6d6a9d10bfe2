"""Several ranks on one GPU (``devices=[0, 0]``): over Gloo with CUDA tensors, the runtime API's DDP reaches
the one-process weights on 2 and 4 processes. NCCL refuses two ranks on one GPU, and FSDP and the mesh
crash torch's Gloo on CUDA tensors (ranks killed by SIGSEGV, torch 2.11): lockstep refuses both by name.

Skipped on machines without CUDA."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys

import pytest
import torch

import lockstep
from checks import mesh as mc
from checks.dist import layout
from lockstep.testing import run_ranks

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

STEPS = 3
TOLERANCE = 1e-5


def _weights(strategy, world: int, checkpointing=None) -> list[torch.Tensor]:
    """Every rank's weights after ``STEPS`` steps of the tiny Llama, ``world`` processes on GPU 0."""
    train = functools.partial(mc.mesh_weights, accelerator="cuda", devices=[0] * world)
    return [result["weights"] for result in run_ranks(train, world, strategy, 1, None, checkpointing, STEPS)]


@pytest.fixture(scope="module")
def one_process() -> torch.Tensor:
    return _weights("single", 1)[0]  # in a child: this process keeps CUDA uninitialised for the forkserver


@pytest.mark.parametrize("world", [2, 4])
def test_ddp_ranks_sharing_one_gpu_reach_the_one_process_weights(one_process, world):
    untouched = mc.hc.flat(mc.tiny_llama())
    for weights in _weights("ddp", world):
        assert float((weights - untouched).abs().max()) > 1e-4  # it trained
        assert torch.allclose(weights, one_process, atol=TOLERANCE, rtol=0), float((weights - one_process).abs().max())


def _refused(**options) -> str:
    try:
        lockstep.Runtime(accelerator="cuda", devices=[0, 0], **options)
    except ValueError as error:
        return str(error)
    return "not refused"


def test_nccl_on_a_shared_gpu_is_refused_with_a_clear_error():
    for message in run_ranks(functools.partial(_refused, backend="nccl"), 2):
        assert "NCCL needs one GPU per rank. Use backend='gloo'" in message


@pytest.mark.parametrize("strategy", ["fsdp", lockstep.Parallel(tp=2), ("ddp", lockstep.Parallel(tp=2))],
                         ids=["fsdp", "fsdp-tp2", "ddp-tp2"])
def test_fsdp_and_the_mesh_over_gloo_on_cuda_are_refused_before_they_crash(strategy):
    for message in run_ranks(functools.partial(_refused, **layout(strategy)), 2):
        assert "over Gloo on CUDA tensors: torch's Gloo crashes" in message


NCCL_TWO_RANKS_ONE_GPU = """
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
def rank(r):
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=r, world_size=2)
    t = torch.ones(1, device="cuda")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    print("rank", r, "all_reduce gave", t.item(), flush=True)
    dist.destroy_process_group()
if __name__ == "__main__":
    mp.spawn(rank, nprocs=2)
"""


def test_what_nccl_itself_does_with_two_ranks_on_one_gpu(tmp_path):
    """Not lockstep: plain torch, to record what NCCL answers (the reason lockstep refuses it)."""
    from lockstep.runtime.comm.network import free_port

    script = tmp_path / "nccl_two_ranks.py"
    script.write_text(NCCL_TWO_RANKS_ONE_GPU)
    child = subprocess.Popen([sys.executable, str(script), str(free_port())], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = child.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # its two ranks with it
        child.communicate()
        print("plain NCCL, two ranks on GPU 0: no answer in 60 s (hung)")
        return
    said = [line for line in err.splitlines() if "Duplicate GPU" in line or "ncclInvalidUsage" in line
            or "Error" in line][-3:]
    print(f"plain NCCL, two ranks on GPU 0: exit {child.returncode}; {out.strip()} {' | '.join(said)}")
    assert child.returncode != 0 or "all_reduce gave 2.0" not in out, "NCCL ran two ranks on one GPU"
