"""One walker over nested data: every container kind behaves the same in every collective,
the device move and the batch-size count; the loss weight belongs to its batch only."""

from __future__ import annotations

import pytest
import torch

from checks import dist as checks
from lockstep import DistEnv, Runtime
from lockstep.runtime import batch_size_of
from lockstep.runtime.tree import flatten, to_device, unflatten

pytestmark = pytest.mark.timeout(180)


KINDS = list(checks.containers(None, None))


@pytest.mark.parametrize("kind", KINDS)
def test_flatten_unflatten_round_trip_keeps_the_container_type(kind):
    value = checks.containers(torch.arange(6.0).reshape(3, 2), 2.5)[kind]
    leaves, spec = flatten(value)
    assert [type(leaf) for leaf in leaves] == [torch.Tensor, float] and leaves[1] == 2.5
    rebuilt = unflatten(leaves, spec)
    assert type(rebuilt) is type(value)
    a, b, _ = checks.parts(rebuilt)
    assert torch.equal(a, torch.arange(6.0).reshape(3, 2)) and b == 2.5


@pytest.mark.parametrize("kind", KINDS)
def test_device_move_reaches_every_container_kind(kind):
    moved = to_device(checks.containers(torch.ones(3, 2), 1.0)[kind], torch.device("meta"))
    a, b, name = checks.parts(moved)
    assert a.device.type == "meta" and b == 1.0 and name == type(checks.containers(None, None)[kind]).__name__


@pytest.mark.parametrize("kind", KINDS)
def test_batch_size_counts_every_container_kind(kind):
    assert batch_size_of(checks.containers(torch.ones(5, 2), 1.0)[kind]) == 5
    assert batch_size_of({"ids": ["no", "tensor"]}) == 0


def test_no_sync_refuses_a_model_that_did_not_come_from_setup():
    rt = Runtime(accelerator="cpu", env=DistEnv())
    with pytest.raises(TypeError, match="rt.setup"):
        rt.no_sync(torch.nn.Linear(2, 2))
    with rt.no_sync(rt.setup(torch.nn.Linear(2, 2))):
        pass

