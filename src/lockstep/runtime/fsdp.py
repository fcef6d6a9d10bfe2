"""FSDP2: each rank holds a shard of every parameter, gradient and optimizer state.

Built on ``torch.distributed.fsdp.fully_shard``. Also here: building a model on the meta device
and materialising only this rank's shards, and re-pointing optimizers made before setup.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from lockstep.runtime.devices import Placement
from lockstep.runtime.precision import Precision
from lockstep.runtime.seed import mix_seed

_MMAP_THRESHOLD = 2**20  # glibc's M_MMAP_THRESHOLD, fixed: blocks from 1 MiB up are mapped and unmapped
_INIT_STREAM = 11  # the seed stream of meta-device initialisation on devices without DTensor RNG


@dataclass(frozen=True)
class FSDP:
    """Fully sharded data parallel (FSDP2): for models whose parameters, gradients and optimizer
    state do not fit on one device.

    Each repeated block becomes one shard group, then the root takes the rest. The blocks are the
    children of every ``nn.ModuleList`` (a transformer's layers), or the instances of
    ``shard_modules`` when given. ``reshard_after_forward=False`` keeps the root-less blocks
    gathered between forward and backward (more memory, one all-gather less); ``cpu_offload`` keeps
    the shards, their gradients and the optimizer step on the CPU.
    """

    shard_modules: tuple[type[nn.Module], ...] = ()
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    name: str = "fsdp"
    one_process_many_devices: bool = False

    def wrap(self, module: nn.Module, placement: Placement, precision: Precision) -> nn.Module:
        if not dist.is_initialized():  # pragma: no cover - make_strategy turns fsdp at world size 1 into single
            raise RuntimeError("FSDP needs a process group: launch several processes.")
        mesh = init_device_mesh(placement.device.type, (dist.get_world_size(),))
        options: dict[str, Any] = {
            "mesh": mesh, "reshard_after_forward": self.reshard_after_forward,
            "mp_policy": precision.fsdp_policy() or MixedPrecisionPolicy(),
            "offload_policy": CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy(),
        }
        if not self.cpu_offload and not is_empty(module):
            module = module.to(placement.device)
        if self.cpu_offload or placement.device.type == "cpu":
            give_back_freed_buffers()
        for block in self.blocks(module):
            fully_shard(block, **options)
        fully_shard(module, **options)
        return module

    def materialize_on(self, placement: Placement) -> torch.device:
        """Where the shards of a model built on the meta device are allocated."""
        return torch.device("cpu") if self.cpu_offload else placement.device

    def blocks(self, module: nn.Module) -> list[nn.Module]:
        """The submodules that become their own shard groups, outermost first, root excluded."""
        if self.shard_modules:
            return [m for m in module.modules() if m is not module and isinstance(m, self.shard_modules)]
        return [block for m in module.modules() if isinstance(m, nn.ModuleList) for block in m]

    def eval_module(self, wrapped: nn.Module) -> nn.Module:
        return wrapped  # the forward all-gathers parameters: every rank runs it (the eval loader pads)

    def release(self, wrapped: nn.Module) -> None:
        return None

    def no_sync(self, wrapped: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return _gradient_sync_off(wrapped)

    @property
    def collective_forward(self) -> bool:
        return True


@contextlib.contextmanager
def _gradient_sync_off(wrapped: nn.Module) -> Iterator[None]:
    """Gradients accumulate unsharded and unreduced; the next backward outside reduce-scatters them."""
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


def is_empty(module: nn.Module) -> bool:
    """True when the module was built on the meta device (``rt.init_module(empty=True)``)."""
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def materialize(module: nn.Module, device: torch.device, seed: int = 0) -> None:
    """Allocate a meta-device module (sharded or not) on ``device`` and initialise it with each
    submodule's ``reset_parameters``, so no process ever holds more than its shards.

    Where DTensor has no random generator of its own (the CPU), each rank draws its shards from a
    stream of its own, seeded from (seed, rank): shards differ, and the global RNG is left as it was.
    """
    without_init = [name or type(module).__name__ for name, m in module.named_modules()
                    if _owns_tensors(m) and not hasattr(m, "reset_parameters")]
    if without_init:
        raise ValueError(
            f"rt.init_module(empty=True) builds the model without memory, and {without_init[:3]} hold parameters "
            "or buffers but define no reset_parameters() to initialise them: add reset_parameters(), or build "
            "the model without empty=True."
        )
    module.to_empty(device=device)
    rank = dist.get_rank() if dist.is_initialized() else 0
    own_stream = device.type == "cpu" and rank > 0
    with torch.random.fork_rng(devices=[]), torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
        if own_stream:
            torch.manual_seed(mix_seed(seed, rank, _INIT_STREAM))
        for submodule in module.modules():
            if _owns_tensors(submodule):
                submodule.reset_parameters()  # type: ignore[operator]


def _owns_tensors(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))


def repoint_optimizers(
    before: dict[str, nn.Parameter], module: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
) -> None:
    """Make optimizers built from the model's parameters before setup hold the parameters it has now.

    Sharding and materialising replace parameter objects; the names stay. Group hyperparameters
    are kept. An optimizer that has already stepped (its state is keyed by the old parameters), or
    that holds tensors that are not the model's parameters, cannot be re-pointed.
    """
    now = dict(module.named_parameters())
    by_id = {id(param): now[name] for name, param in before.items() if name in now}
    if all(by_id.get(id(p)) is p for p in before.values()):
        return  # nothing was replaced (DDP, one device)
    for optimizer in optimizers:
        if optimizer.state:
            raise ValueError(
                f"{type(optimizer).__name__} has already taken steps, and setup replaced the model's parameters "
                "(FSDP shards them): build the optimizer after rt.setup, from the model it returns."
            )
        for group in optimizer.param_groups:
            stray = [p for p in group["params"] if id(p) not in by_id]
            if stray:
                raise ValueError(
                    f"{type(optimizer).__name__} holds {len(stray)} tensor(s) that are not parameters of the model "
                    "given to rt.setup, so they cannot follow the model into its shards: build the optimizer "
                    "after rt.setup, from the model it returns."
                )
            group["params"] = [by_id[id(p)] for p in group["params"]]
