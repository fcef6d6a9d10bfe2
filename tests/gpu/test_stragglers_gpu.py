"""The straggler report's CUDA clock: device times from events, read once done, never a synchronize.

Skipped without CUDA. One GPU is enough: the clock is one rank's part (the judge is tested on the CPU).
"""

from __future__ import annotations

import pytest
import torch

from lockstep.runtime.faults.stragglers import StepClock

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


class Loader:
    wait_s = 0.0


def test_the_cuda_clock_times_forward_and_backward_on_the_device_without_a_synchronize(monkeypatch):
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Tanh(), torch.nn.Linear(2048, 8)).cuda()
    x = torch.randn(4096, 2048, device="cuda")
    clock, loader = StepClock(cuda=True), Loader()
    clock.watch_gradients([p for p in model.parameters()])
    torch.cuda.synchronize()

    def refused(*args: object, **kwargs: object) -> None:
        raise AssertionError("the clock synchronized the device")

    monkeypatch.setattr(torch.cuda, "synchronize", refused)
    monkeypatch.setattr(torch.cuda.Event, "synchronize", refused)
    for _ in range(12):
        clock.batch(loader)
        clock.enter("forward")
        loss = model(x).square().mean()
        clock.leave()
        clock.enter("backward")
        loss.backward()
        clock.leave()
    monkeypatch.undo()
    torch.cuda.synchronize()
    clock.batch(loader)  # the 11 earlier steps' events are done now: read
    steps = clock.mine()
    # the 12th step ends at an event recorded in that last call: it is read there only if the idle device has
    # already passed it (on an H200 it had), else at the next step
    assert [s["step"] for s in steps] in (list(range(1, 12)), list(range(1, 13))), steps
    for step in steps[1:]:
        assert 0 < step["forward_s"] < step["step_s"] and 0 < step["backward_s"] < step["step_s"]
        # one process: no wait for other ranks after the last gradient, only DDP-free bookkeeping
        assert 0 <= step["wait_s"] < 0.5 * step["backward_s"]
        assert step["forward_s"] + step["backward_s"] <= step["step_s"] * 1.01
