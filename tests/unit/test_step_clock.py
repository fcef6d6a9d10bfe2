"""The straggler report's step clock: which steps it times, what it records, when its gradient hook runs."""

from __future__ import annotations

import types

import pytest
import torch

from lockstep.runtime.faults import stragglers
from lockstep.runtime.faults.stragglers import StepClock

pytestmark = pytest.mark.timeout(60)


class Loader:
    wait_s = 0.0


def _run(monkeypatch: pytest.MonkeyPatch, step_s: float, steps: int, hooked: list[int] | None = None) -> StepClock:
    """``steps`` training steps of ``step_s`` each (on a fake clock: forward a quarter of it, backward half,
    the data wait a tenth), a real model's forward and backward between the clock's calls."""
    now = [100.0]
    monkeypatch.setattr(stragglers, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    torch.manual_seed(0)
    model, x = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2)), torch.randn(5, 4)
    clock, loader = StepClock(cuda=False), Loader()
    clock.watch_gradients(list(model.parameters()))
    if hooked is not None:
        def counted(self: StepClock, tensor: object) -> None:
            hooked.append(clock.count + 1)
            self._gradient = now[0]
        monkeypatch.setattr(StepClock, "_ready", counted)
    for _ in range(steps):
        clock.batch(loader)
        now[0] += step_s / 10  # waiting for the next batch
        loader.wait_s += step_s / 10
        clock.enter("forward")
        loss = model(x).square().sum()
        now[0] += step_s / 4
        clock.leave()
        clock.enter("backward")
        loss.backward()
        now[0] += step_s / 2
        clock.leave()
        now[0] += step_s - step_s / 10 - step_s / 4 - step_s / 2  # the optimizer step
    clock.batch(loader)  # the last step ends
    return clock


def test_short_steps_are_timed_one_in_a_power_of_two_with_their_real_times(monkeypatch):
    hooked: list[int] = []
    clock = _run(monkeypatch, 0.001, 80, hooked)
    steps = clock.mine()
    # step 1 finds 1 ms steps: from then on one step in 16 (16 ms apart, at least 10 ms)
    assert [s["step"] for s in steps] == [1, 16, 32, 48, 64, 80]
    for step in steps:
        assert step["step_s"] == pytest.approx(0.001) and step["data_s"] == pytest.approx(0.0001)
        assert step["forward_s"] == pytest.approx(0.00025) and step["backward_s"] == pytest.approx(0.0005)
        # the fake clock stands still during loss.backward(): the last gradient is read at the span's start
        assert step["wait_s"] == pytest.approx(0.0005)
    # the gradient hook runs in the timed backwards after the first (which found the last gradient) only
    assert hooked == [16, 32, 48, 64, 80]


def test_steps_of_10_ms_or_more_are_all_timed_and_ranks_of_different_paces_share_their_timed_steps(monkeypatch):
    assert [s["step"] for s in _run(monkeypatch, 0.02, 12).mine()] == list(range(1, 13))
    fast = {s["step"] for s in _run(monkeypatch, 0.001, 64).mine()}  # one in 16
    slower = {s["step"] for s in _run(monkeypatch, 0.003, 64).mine()}  # one in 4
    assert {16, 32, 48, 64} <= fast & slower
    assert [stragglers._every(s) for s in (0.0001, 0.001, 0.003, 0.006, 0.01, 1.0)] == [16, 16, 4, 2, 1, 1]
