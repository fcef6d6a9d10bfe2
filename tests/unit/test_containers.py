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


@pytest.mark.parametrize("tensor", [
    torch.arange(7.0), torch.arange(9.0).reshape(3, 3).t(), torch.tensor([True, False, True]),
    torch.arange(9.0).to(torch.float8_e4m3fn), torch.arange(5.0).to(torch.complex64),
    torch.arange(5, dtype=torch.int32).to(torch.uint16), torch.arange(10.0)[1:6], torch.tensor(3.0),
    torch.arange(5.0).to(torch.bfloat16), torch.arange(3, dtype=torch.int8), torch.arange(10.0)[::2]],
    ids=["float32", "transposed", "bool", "float8", "complex", "uint16", "offset-view", "scalar", "bf16", "int8",
         "strided-1d"])
def test_a_fingerprint_is_equal_for_equal_bytes_and_differs_where_one_element_does(tensor):
    """What rt.setup compares to tell whether the ranks built the same weights: any dtype (float8, complex,
    unsigned too), any layout, any size."""
    from lockstep.runtime.comm.collectives import fingerprint

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return bool(fingerprint(a) == fingerprint(b))

    assert same(tensor, tensor.clone()) and same(tensor, tensor.contiguous())
    changed = tensor.clone().reshape(-1)
    changed.view(torch.uint8)[0] ^= 1  # one bit of the first element
    assert not same(tensor, changed)
    assert same(torch.zeros(0), torch.zeros(0))
