"""Real ranks over Gloo on loopback, compared with single-process and plain-PyTorch references."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from checks import dist as checks
from lockstep import Runtime
from lockstep.testing import rank_outcomes, run_ranks

pytestmark = pytest.mark.timeout(180)


def frozen_peer(_: int) -> str:
    """Rank 1 freezes (SIGSTOP); rank 0's barrier times out and says rank 1 stopped beating."""
    import os
    import signal

    from lockstep import CollectiveError

    rt = Runtime(accelerator="cpu", timeout=6)  # applies to the group the harness made, too
    pids = rt.all_gather(os.getpid())
    for _batch in rt.loader(list(range(8)), batch_size=2):
        rt.mark("my_step")
        rt.barrier()
    if rt.rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen: no Python runs, no heartbeat
    time.sleep(2.0)  # rank 1's last heartbeat grows old
    try:
        rt.barrier()
    except CollectiveError as error:
        return str(error)
    finally:
        os.kill(pids[1], signal.SIGKILL)
    return "the barrier passed"


def skewed_clock_peer(_: int) -> str:
    """Rank 1's wall clock runs an hour behind and it busy-waits; rank 0's barrier times out."""
    from lockstep import CollectiveError

    rt = Runtime(accelerator="cpu", timeout=4)
    if rt.rank == 1:
        real = time.time
        time.time = lambda: real() - 3600.0  # type: ignore[assignment]
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:  # alive, beating, but not in the collective
            time.sleep(0.01)
        return "rank 1 done"
    try:
        rt.barrier()
    except CollectiveError as error:
        return str(error)
    return "the barrier passed"


def test_worker_draws_differ_by_rank_batch_and_epoch_repeat_and_depend_on_neither_the_workers_nor_a_resume():
    """A worker seeds its generators per batch from (seed, rank, epoch, step): the draws repeat run to run, are
    the same with 1 worker as with 2, and a pass resumed after batch 2 (new workers) draws what the
    uninterrupted pass drew from batch 2 on (which worker fetches a batch changes nothing)."""
    results = run_ranks(checks.worker_seeds, 2)
    for result in results:
        assert result["first"] == result["second"]  # repeat run to run
        epoch0, epoch1 = result["first"]
        assert {w for _, w in epoch0} == {0, 1}
        values = [v for v, _ in epoch0]
        assert len(set(values)) == len(values)  # each batch its own draws
        assert set(values).isdisjoint({v for v, _ in epoch1})
        assert [[v for v, _ in epoch] for epoch in result["one_worker"]] == [[v for v, _ in epoch]
                                                                             for epoch in result["first"]]
        assert result["resumed"] == [v for v, _ in epoch1][2 * 2:]  # 2 batches of this rank's 2 rows
    rank0 = {v for epoch in results[0]["first"] for v, _ in epoch}
    rank1 = {v for epoch in results[1]["first"] for v, _ in epoch}
    assert rank0.isdisjoint(rank1)


def test_a_rank_whose_clock_is_skewed_is_still_reported_alive():
    """Heartbeats are counters seen on the reader's clock: an hour of skew must not read as silence."""
    outcomes = rank_outcomes(skewed_clock_peer, 2, 0, timeout=60)
    assert outcomes[0].ok, outcomes[0].error
    message = outcomes[0].value
    assert "rank 1: never reached a lockstep collective; alive (a heartbeat within" in message, message


def test_a_frozen_rank_is_reported_as_silent_also_under_a_launch_made_group():
    outcomes = rank_outcomes(frozen_peer, 2, 0, timeout=60)
    assert outcomes[0].ok, outcomes[0].error
    message = outcomes[0].value
    here = Path(__file__).name  # the call sites are this file's lines
    assert f"rank 0: barrier #7 at {here}" in message
    assert f"rank 1: last at barrier #6 at {here}" in message
    assert "(in my_step, epoch 0, batch 3)" in message
    assert "no heartbeat for" in message and "died or is frozen" in message
    assert not outcomes[1].ok  # killed by rank 0 once it had its answer

