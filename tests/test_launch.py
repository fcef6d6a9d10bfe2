"""lockstep.launch: rank 0's value back, a worker's exception surfaced fast, no process left."""

from __future__ import annotations

import os
import time

import pytest
import torch

import dist_checks as checks
import lockstep

pytestmark = pytest.mark.timeout(60)



def _sum_of_ranks(scale: float) -> torch.Tensor:
    rt = lockstep.Runtime(accelerator="cpu")
    return rt.all_reduce(torch.tensor([float(rt.rank)]) * scale, op="sum") + rt.rank * 100


def test_launch_returns_rank_zeros_value():
    value = lockstep.launch(_sum_of_ranks, nprocs=3, args=(2.0,))
    assert torch.equal(value, torch.tensor([6.0]))  # rank 0's, not rank 1's (106) or 2's (206)


def _fail_on_rank_one(pid_dir: str) -> None:
    rt = lockstep.Runtime(accelerator="cpu")
    with open(os.path.join(pid_dir, f"{rt.rank}.pid"), "w") as handle:
        handle.write(str(os.getpid()))
    if rt.rank == 1:
        time.sleep(0.5)
        raise ValueError("bad input on rank one")
    time.sleep(600)  # the others would wait forever: launch must stop them


def test_worker_exception_names_the_rank_fast_and_leaves_no_process(tmp_path):
    start = time.monotonic()
    with pytest.raises(lockstep.WorkerError, match=r"rank 1 of 3 failed: ValueError: bad input on rank one") as info:
        lockstep.launch(_fail_on_rank_one, nprocs=3, args=(str(tmp_path),))
    assert time.monotonic() - start < 10
    assert info.value.rank == 1
    assert isinstance(info.value.__cause__, ValueError)
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 3
    assert not any(checks.pid_alive(pid) for pid in pids)


def test_launch_rejects_zero_processes():
    with pytest.raises(ValueError, match="at least one process"):
        lockstep.launch(_sum_of_ranks, nprocs=0)
