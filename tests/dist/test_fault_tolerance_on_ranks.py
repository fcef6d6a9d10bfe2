"""Fault tolerance's failure path on 3 ranks over torchft's Gloo group: a participant whose all-reduce
failed ends the wait of the others at once (Gloo's own abort closes no connection: without lockstep's
alarm they would wait out the group's timeout, and torchft's abort would block until then)."""

from __future__ import annotations

import importlib.util

import pytest

from lockstep.testing import run_ranks

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="the ft extra")]

GROUP_TIMEOUT_S = 30.0


def _a_failed_participant_ends_the_others_wait() -> tuple[float, float]:
    import time
    from datetime import timedelta
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from torchft.process_group import ProcessGroupGloo

    from lockstep.runtime.fault_tolerance.alarm import Alarm as _Alarm

    rank = dist.get_rank()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if rank == 0 else None
    port = [store.port if store is not None else 0]
    dist.broadcast_object_list(port, src=0)
    pg = ProcessGroupGloo(timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    pg.configure(f"127.0.0.1:{port[0]}/torchft", f"replica_{rank}", rank, 3)
    alarm = _Alarm(group_rank=0, connect_timeout=10, cuda=False)
    alarm.arm(SimpleNamespace(quorum_id=1, store_address=f"127.0.0.1:{port[0]}"), step=5)
    tensor = torch.ones(8)
    if rank == 2:  # its all-reduce failed (a peer of its lost): it tells the others, then takes part late
        time.sleep(0.5)
        alarm.fail(SimpleNamespace(abort=lambda: None), None)
        time.sleep(3.0)
        pg.allreduce([tensor], dist.AllreduceOptions()).wait()  # the others' abandoned all-reduces end
        dist.barrier()
        return 0.0, 0.0
    started = time.monotonic()
    work = pg.allreduce([tensor], dist.AllreduceOptions())
    with pytest.raises(RuntimeError, match="another participant's all-reduce of this step failed"):
        alarm.wait(work)
    waited = time.monotonic() - started
    alarm.fail(pg, work)  # torchft's abort lets its group go: it must not wait for the pending all-reduce
    aborted = time.monotonic() - started - waited
    dist.barrier()
    return waited, aborted


def test_a_participant_whose_all_reduce_failed_ends_the_wait_of_the_others_at_once():
    results = run_ranks(_a_failed_participant_ends_the_others_wait, 3)
    for waited, aborted in results[:2]:
        assert 0.4 < waited < 5.0, results  # the alarm came at 0.5 s; the group's timeout is 30 s
        assert aborted < 1.0, results
