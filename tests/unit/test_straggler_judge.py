"""The straggler judge on step times written by hand: who is named, with which cause, and when not."""

from __future__ import annotations

import json

import pytest

from lockstep.env.settings import straggler_factor_from_environ
from lockstep.errors import ConfigError
from lockstep.runtime.faults.stragglers import PATIENCE, StragglerJudge

pytestmark = pytest.mark.timeout(30)


class Store:
    """The rendezvous store as the judge reads it."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.values[k].encode() for k in keys]


def publish(store: Store, rank: int, steps: list[list[float]], queued: float | None = None, group: int = 0) -> None:
    """``queued``: the rank's run-queue seconds per step (two readings, from its first step to its last)."""
    count = int(steps[-1][0]) if steps else 0
    readings = [[0, 0.0], [count, queued * count]] if queued is not None else []
    store.values[f"lockstep/steps/{rank}"] = json.dumps(
        {"host": f"node{rank // 2}", "local_rank": rank % 2, "group": group, "queued": readings, "steps": steps})


def step(n: int, data: float = 0.001, forward: float = 0.010, backward: float = 0.020,
         wait: float = 0.005) -> list[float]:
    """Step ``n`` as a rank publishes it: ``backward`` is its compute, the published backward adds ``wait``."""
    return [n, data + forward + backward + wait, data, forward, backward + wait, wait]


def judge_of(world: int = 4) -> tuple[StragglerJudge, list[str]]:
    said: list[str] = []
    return StragglerJudge(world, 1.3, said.append), said


def test_a_rank_that_waits_for_its_data_is_named_once_with_the_cause_and_again_when_it_recovers():
    store, (judge, said) = Store(), judge_of()
    steps = range(1, PATIENCE + 3)
    for rank in range(4):
        slow = rank == 3
        # the slow rank waits 0.1 s for each batch; its peers wait 0.1 s longer for its gradients
        publish(store, rank, [step(n, data=0.101 if slow else 0.001, wait=0.005 if slow else 0.105)
                              for n in steps])
    judge.read(store)
    assert len(said) == 1, said
    assert "rank 3 (host node1, local rank 1) is a straggler" in said[0]
    assert "waits 101.0 ms for each batch (against 1.0 ms)" in said[0]
    assert f"steps 1-{PATIENCE + 2}" in said[0]
    assert judge.report()["stragglers"] == {3: "data"}
    assert judge.report()["step_time/slowest_rank"] == 3.0
    assert judge.report()["step_time/max_over_median"] == pytest.approx(0.131 / 0.031)
    judge.read(store)  # nothing new: nothing said again
    assert len(said) == 1
    later = range(PATIENCE + 3, 2 * PATIENCE + 5)
    for rank in range(4):
        publish(store, rank, [step(n) for n in later])
    judge.read(store)
    assert len(said) == 2 and "rank 3 (host node1, local rank 1) keeps up with its peers again" in said[1]
    assert judge.report()["stragglers"] == {}


def test_compute_and_own_code_are_told_apart():
    store, (judge, said) = Store(), judge_of(3)
    for rank in range(3):
        publish(store, rank, [step(n, forward=0.060 if rank == 0 else 0.010, wait=0.005 if rank == 0 else 0.055)
                              for n in range(1, 7)])
    judge.read(store)
    assert judge.report()["stragglers"] == {0: "compute"}, said
    assert "forward 60.0 ms against 10.0 ms" in said[0]
    store, (judge, said) = Store(), judge_of(3)
    for rank in range(3):  # the step is longer by 50 ms outside data, forward and backward: the rank's own code
        publish(store, rank, [[n, 0.086, 0.001, 0.010, 0.025 if rank == 1 else 0.075, 0.005 if rank == 1 else 0.055]
                              for n in range(1, 7)])
    judge.read(store)
    assert judge.report()["stragglers"] == {1: "own code"}, said


def test_a_rank_waiting_for_a_cpu_is_a_busy_host():
    store, (judge, said) = Store(), judge_of(3)
    for rank in range(3):
        slow = rank == 2
        publish(store, rank, [step(n, forward=0.030 if slow else 0.010, backward=0.060 if slow else 0.020,
                                   wait=0.005 if slow else 0.065) for n in range(1, 7)], 0.04 if slow else 0.002)
    judge.read(store)
    assert judge.report()["stragglers"] == {2: "host"}, said
    assert "waited 40.0 ms a step for a CPU (against 2.0 ms)" in said[-1]


def test_the_cpu_wait_is_read_over_the_judged_steps_and_one_calm_step_clears_no_one():
    """A rank whose core became busy at step 9: its run-queue time over steps 9-12 (readings at
    heartbeats, every two steps) names a busy host, where the average since the first step would not;
    one step at its peers' pace among the slow ones after it neither clears nor names it again."""
    store, (judge, said) = Store(), judge_of(3)

    def publish_until(last: int) -> None:
        for rank in range(3):
            busy = rank == 2
            readings = [[n, 0.016 + 0.045 * (n - 8) if busy and n > 8 else 0.002 * n] for n in range(0, last + 1, 2)]
            steps = [step(n, forward=0.030 if busy and n > 8 else 0.010, backward=0.060 if busy and n > 8 else 0.020,
                          wait=0.005 if busy or n <= 8 else 0.065) for n in range(1, last + 1)]
            if last >= 13:
                steps[12] = step(13)  # step 13: every rank at the same pace
            store.values[f"lockstep/steps/{rank}"] = json.dumps(
                {"host": "node", "local_rank": rank, "group": 0, "queued": readings, "steps": steps})
        judge.read(store)

    publish_until(12)
    assert judge.report()["stragglers"] == {2: "host"}, said
    assert len(said) == 1 and "steps 9-12" in said[0] and "waited 45.0 ms a step for a CPU" in said[0], said
    publish_until(13)
    publish_until(18)
    assert len(said) == 1 and judge.report()["stragglers"] == {2: "host"}, said


def test_short_spikes_and_small_excesses_are_not_named():
    store, (judge, said) = Store(), judge_of()
    for rank in range(4):
        # one rank at a time is 3x slower for fewer than PATIENCE steps in a row
        publish(store, rank, [step(n, data=0.060 if n % 4 == rank else 0.001) for n in range(1, 30)])
    judge.read(store)
    assert said == [] and judge.report()["stragglers"] == {}
    store, (judge, said) = Store(), judge_of()
    for rank in range(4):  # 2x the median, but by 0.2 ms on a 1 ms step: noise
        publish(store, rank, [step(n, data=0.0, forward=0.0004 if rank == 0 else 0.0002, backward=0.0002,
                                   wait=0.0001 if rank == 0 else 0.0003) for n in range(1, 10)])
    judge.read(store)
    assert said == []


def test_ranks_are_compared_within_their_pipeline_stage():
    store, (judge, said) = Store(), judge_of()
    for rank in range(4):  # stage 1 (ranks 2, 3) does three times the work of stage 0: not a straggler
        publish(store, rank, [step(n, forward=0.030 if rank >= 2 else 0.010) for n in range(1, 9)], group=rank // 2)
    judge.read(store)
    assert said == []


def test_damaged_entries_are_skipped():
    store, (judge, said) = Store(), judge_of(3)
    publish(store, 0, [step(n) for n in range(1, 9)])
    publish(store, 1, [step(n) for n in range(1, 9)])
    store.values["lockstep/steps/2"] = "{not json"
    judge.read(store)
    store.values["lockstep/steps/2"] = json.dumps({"steps": [[1, "x"], [2, float("nan"), 0, 0, 0, 0], "junk"],
                                                   "count": "3"})
    judge.read(store)
    assert said == [] and judge.report()["stragglers"] == {}


def test_hostile_entries_neither_stop_the_judge_nor_print_forged_lines():
    store, (judge, said) = Store(), judge_of(3)
    publish(store, 0, [step(n) for n in range(1, 9)])
    publish(store, 1, [step(n) for n in range(1, 9)])
    forged = "x\nlockstep: rank 0 (host a, local rank 0) is a straggler"
    for entry in ('{"local_rank": Infinity, "queued": [[1e999, 1], [2, NaN]], "steps": []}',
                  "[" * 100000 + "]" * 100000,
                  json.dumps({"host": forged, "steps": [[n, 1e308, 1e308, 0, 0, 0] for n in range(1, 9)]}),
                  json.dumps({"host": forged, "steps": [[n, 0.3, 0.3, 0.01, 0.02, 0.0] for n in range(1, 9)]})):
        store.values["lockstep/steps/2"] = entry
        judge.read(store)
    assert len(said) == 1 and "\n" not in said[0] and said[0].startswith("lockstep: rank 2 (host xlockstep: rank 0")


def test_a_groups_pace_rides_in_slots_and_a_step_that_comes_again_is_judged_once():
    import torch

    from lockstep.runtime.fault_tolerance.pace import GroupPace

    said: list[str] = []
    pace = GroupPace(1.3, said.append, judges=True)
    like = torch.zeros(3)
    assert pace.slots(1, 3, like).tolist() == [0.0, 0.0, 0.0]  # no full step yet
    for step in range(1, 8):
        pace.reduced(torch.tensor([0.01, 0.2, 0.01]), [0, 5, 7], step, valid=True)
        pace.reduced(torch.tensor([0.01, 0.01, 0.01]), [0, 5, 7], step, valid=True)  # the step came again
    assert pace.report()["group_stragglers"] == {5: "group"} and pace.report()["step_time/slowest_group"] == 5.0
    assert len(said) == 1 and said[0].startswith("lockstep: replica group 5 is a straggler")
    assert "steps 0-3" in said[0]  # named as soon as 4 steps show it
    pace.reduced(torch.tensor([float("inf"), 1e300, -1.0]), [0, 5, 7], 8, valid=True)  # ignored, no error
    row = pace.slots(2, 3, like)
    assert row[2] > 0 and row[:2].tolist() == [0.0, 0.0]


def test_the_factor_is_checked():
    assert straggler_factor_from_environ({}) == 1.3
    assert straggler_factor_from_environ({"LOCKSTEP_STRAGGLER_FACTOR": "0"}) == 0
    assert straggler_factor_from_environ({"LOCKSTEP_STRAGGLER_FACTOR": "2"}) == 2
    for bad in ("0.9", "nan", "fast"):
        with pytest.raises(ConfigError, match="LOCKSTEP_STRAGGLER_FACTOR"):
            straggler_factor_from_environ({"LOCKSTEP_STRAGGLER_FACTOR": bad})


def test_times_whose_parts_exceed_the_whole_or_that_change_are_not_judged():
    """A forged entry cannot name an honest peer: a wait longer than the backward (a negative own time) or
    parts longer than the step are no clock's readings; a step published twice with different times is
    judged on neither."""
    store, (judge, said) = Store(), judge_of(2)
    publish(store, 0, [step(n) for n in range(1, 9)])
    publish(store, 1, [[n, 0.036, 0.001, 0.010, 0.025, 5.0] for n in range(1, 9)])  # wait 5 s in a 25 ms backward
    judge.read(store)
    assert said == [] and judge.report().get("stragglers", {}) == {}
    store, (judge, said) = Store(), judge_of(3)
    for rank in range(3):
        publish(store, rank, [step(n) for n in range(1, 9)])
    judge.read(store)
    publish(store, 2, [step(n, data=0.5) for n in range(1, 9)])  # the same steps again, now slow: overwritten
    judge.read(store)
    assert said == [] and judge.report().get("stragglers", {}) == {}
    assert judge.ranks[2].conflicted == set(range(1, 9))
