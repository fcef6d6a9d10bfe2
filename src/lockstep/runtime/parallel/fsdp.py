"""FSDP2: each rank holds a shard of every parameter, gradient and optimizer state.

Built on ``torch.distributed.fsdp.fully_shard``, which is imported when a model is sharded, not
before: a job that never shards never loads FSDP or DTensor.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lockstep.errors import StateError
from lockstep.runtime.parallel.devices import Placement
from lockstep.runtime.parallel.mesh import Mesh, refuses_degrees
from lockstep.runtime.parallel.meta_init import is_empty, materialize
from lockstep.runtime.parallel.precision import Precision
from lockstep.runtime.parallel.tensor_parallel import sync_replicas

_MMAP_THRESHOLD = 2**20  # glibc's M_MMAP_THRESHOLD, fixed: blocks from 1 MiB up are mapped and unmapped


@refuses_degrees
@dataclass(frozen=True)
class FSDP:
    """Fully sharded data parallel (FSDP2): for models whose parameters, gradients and optimizer
    state do not fit on one device.

    Each repeated block becomes one shard group, then the root takes the rest. The blocks are the
    children of every ``nn.ModuleList`` or ``nn.ModuleDict`` (a transformer's layers), or the instances of
    ``shard_modules`` when given. ``reshard_after_forward=False`` keeps the root-less blocks
    gathered between forward and backward (more memory, one all-gather less); ``cpu_offload`` keeps
    the shards, their gradients and the optimizer step on the CPU.

    On a device mesh (``lockstep.Parallel``) FSDP shards over the data-parallel ranks: over
    ``replicate`` groups that each hold a whole sharded copy (HSDP), with tensor-parallel weights already
    split. Under pipeline parallel a stage keeps its parameters gathered from its first micro-batch's
    forward until the schedule reduces the step's gradients, whatever ``reshard_after_forward`` says:
    one all-gather per stage per step, not one per micro-batch, and the zero-bubble schedules need it
    (their input-gradient pass collects the parameters the forward used; resharded, it finds none and
    the weight gradients are lost).
    """

    shard_modules: tuple[type[nn.Module], ...] = ()
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    name: str = "fsdp"
    one_process_many_devices: bool = False

    def wrap(self, module: nn.Module, placement: Placement, precision: Precision, mesh: Mesh) -> nn.Module:
        """Shard ``module`` over the mesh's data-parallel dimensions (tensor parallel, if any, is
        already applied: a step of ``Runtime.setup``)."""
        if not dist.is_initialized():  # pragma: no cover - the Runtime makes a group of one for a lone FSDP
            raise StateError("FSDP needs a process group: launch several processes.")
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        options: dict[str, Any] = {
            "mesh": mesh.data_mesh(), "reshard_after_forward": self.reshard_after_forward and mesh.pp == 1,
            "mp_policy": precision.fsdp_policy() or MixedPrecisionPolicy(),
            # pinned host memory needs an accelerator: on a CPU-only job the shards stay unpinned
            "offload_policy": (CPUOffloadPolicy(pin_memory=placement.device.type != "cpu") if self.cpu_offload
                               else OffloadPolicy()),
        }
        if not self.cpu_offload and not is_empty(module):
            module = module.to(placement.device)
        if self.cpu_offload or placement.device.type == "cpu":
            give_back_freed_buffers()
        _make_contiguous(module)
        for block in self.blocks(module):
            fully_shard(block, **options)
        fully_shard(module, **options)
        return module

    def materialize(self, module: nn.Module, placement: Placement, seed: int, mesh: Mesh) -> None:
        """Allocate and initialise a model built on the meta device: each rank its shards only."""
        materialize(module, torch.device("cpu") if self.cpu_offload else placement.device, seed)
        if mesh.tp > 1:
            sync_replicas(module, mesh.tp_mesh())

    def blocks(self, module: nn.Module) -> list[nn.Module]:
        """The submodules that become their own shard groups, outermost first, root excluded."""
        if self.shard_modules:
            found = [m for m in module.modules() if m is not module and isinstance(m, self.shard_modules)]
        else:
            found = [block for m in module.modules() if isinstance(m, (nn.ModuleList, nn.ModuleDict))
                     for block in m.children()]
            found = found or _sequential_layers(module)
        return [block for block in found if any(True for _ in block.parameters())]  # a pipeline's Skipped: none

    def eval_module(self, wrapped: nn.Module) -> nn.Module:
        return wrapped  # the forward all-gathers parameters: every rank runs it (the eval loader pads)

    def release(self, wrapped: nn.Module) -> None:
        return None

    def no_sync(self, wrapped: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return _gradient_sync_off(wrapped)

    @property
    def collective_forward(self) -> bool:
        return True


def _sequential_layers(module: nn.Module) -> list[nn.Module]:
    """A model without a list or dict of layers (``nn.Sequential(Linear, ReLU, Linear, ...)``): the children
    of its outermost ``nn.Sequential`` containers, so that one layer at a time is gathered, not the model."""
    found: list[tuple[str, nn.Module]] = []
    for name, container in module.named_modules():
        inside = any(name == outer or name.startswith(f"{outer}.") for outer, _ in found)
        if isinstance(container, nn.Sequential) and not inside:
            found += [(f"{name}.{key}" if name else key, child) for key, child in container.named_children()]
    return [child for _, child in found]


@contextlib.contextmanager
def _gradient_sync_off(wrapped: nn.Module) -> Iterator[None]:
    """Gradients accumulate unsharded and unreduced; the next backward outside reduce-scatters them."""
    from torch.distributed.fsdp import FSDPModule

    assert isinstance(wrapped, FSDPModule)
    wrapped.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        wrapped.set_requires_gradient_sync(True)


def give_back_freed_buffers() -> bool:
    """Make host memory that FSDP frees leave the resident set; True when this changed anything.

    glibc's malloc raises its mmap threshold (up to 32 MiB) each time a mapped block is freed;
    blocks under the threshold then come from the heap, where freed memory stays resident. FSDP
    frees each block's all-gathered parameters after every forward and backward, so with shards in
    host memory a rank's resident set grew to about three times the whole model (200 M parameters,
    4 ranks, ``benchmarks/fsdp_memory.py``). Fixing the threshold at 1 MiB, as
    ``MALLOC_MMAP_THRESHOLD_=1048576`` would, keeps it under the model's size. A threshold the user
    set in the environment is left alone, as is a C library without ``mallopt``.
    """
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(-3, _MMAP_THRESHOLD))  # -3: M_MMAP_THRESHOLD


def _make_contiguous(module: nn.Module) -> None:
    """Parameters laid out in memory as their shape reads (FSDP shards a parameter by its storage and refuses
    a transposed one): the same values and the same Parameter objects, so an optimizer built before holds them."""
    with torch.no_grad():
        for param in module.parameters():
            if type(param.data) is torch.Tensor and not param.is_contiguous():
                param.data = param.data.contiguous()
