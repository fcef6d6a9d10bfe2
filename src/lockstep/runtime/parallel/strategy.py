"""Strategies as small objects: how the model is placed and how gradients are synchronised."""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from lockstep.errors import ConfigError
from lockstep.runtime.parallel.devices import Placement
from lockstep.runtime.parallel.fsdp import FSDP
from lockstep.runtime.parallel.mesh import Mesh, MeshLayout
from lockstep.runtime.parallel.meta_init import materialize
from lockstep.runtime.parallel.precision import Precision
from lockstep.runtime.parallel.tensor_parallel import Plan


class Strategy(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def one_process_many_devices(self) -> bool: ...
    @property
    def collective_forward(self) -> bool: ...  # True: every rank must run every forward (FSDP)

    @property
    def tp_plan(self) -> Plan | None: ...  # how tensor parallel splits the model (when the layout has tp > 1)

    def layout(self, world_size: int) -> MeshLayout: ...  # the degrees (data parallel, tp) on this world size
    def wrap(self, module: nn.Module, placement: Placement, precision: Precision, mesh: Mesh) -> nn.Module: ...
    def materialize(self, module: nn.Module, placement: Placement, seed: int, mesh: Mesh) -> None: ...
    def eval_module(self, wrapped: nn.Module) -> nn.Module: ...
    def release(self, wrapped: nn.Module) -> None: ...
    def no_sync(self, wrapped: nn.Module) -> contextlib.AbstractContextManager[Any]: ...


class _Replicated:
    """What the strategies that keep a whole model on each device share."""

    collective_forward = False
    tp_plan: Plan | None = None

    def materialize(self, module: nn.Module, placement: Placement, seed: int, mesh: Mesh) -> None:
        materialize(module, placement.device, seed)

    def layout(self, world_size: int) -> MeshLayout:
        return MeshLayout(1, world_size, 1)  # every rank sees batches of its own


@dataclass(frozen=True)
class SingleDevice(_Replicated):
    """One process, one device; also what ``ddp`` becomes at world size 1 (no group exists)."""

    name: str = "single"
    one_process_many_devices: bool = False

    def wrap(self, module: nn.Module, placement: Placement, precision: Precision, mesh: Mesh) -> nn.Module:
        return module.to(placement.device)

    def eval_module(self, wrapped: nn.Module) -> nn.Module:
        return wrapped

    def release(self, wrapped: nn.Module) -> None:
        return None

    def no_sync(self, wrapped: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()


@dataclass(frozen=True)
class DDP(_Replicated):
    """DistributedDataParallel: one process per device, gradients all-reduced in buckets.

    ``sync_batchnorm`` converts BatchNorm layers to SyncBatchNorm so statistics cover the
    global batch; the other options are DistributedDataParallel's own.

    ``tp=k``: tensor parallel inside groups of ``k`` consecutive ranks (``tp_plan`` as for FSDP),
    every group holding the whole (tensor-parallel) model and gradients all-reduced across the
    groups: data parallel ``world_size / k``. Built as FSDP2's ``fully_shard`` over a
    ``(replicate = world_size / k, shard = 1)`` mesh, which all-reduces without sharding, because
    ``DistributedDataParallel``'s own route to tensor parallel swaps the parameters for local tensors
    outside the forward (torch's ``_pre_dp_module_transform``) and its state_dict then holds no
    DTensors; this way checkpoints reshard like FSDP's (docs/parallelism.md).
    """

    find_unused_parameters: bool = False
    static_graph: bool = False
    gradient_as_bucket_view: bool = False
    sync_batchnorm: bool = False
    tp: int = 1
    tp_plan: Plan | None = None
    pp: int = 1
    pp_schedule: str = "1F1B"
    pp_microbatches: int | None = None
    pp_stages: tuple[tuple[str, ...], ...] | None = None
    name: str = "ddp"
    one_process_many_devices: bool = False

    def wrap(self, module: nn.Module, placement: Placement, precision: Precision, mesh: Mesh) -> nn.Module:
        if self.sync_batchnorm:
            if placement.accelerator != "cuda":
                raise ConfigError(
                    "sync_batchnorm=True needs CUDA devices (torch's SyncBatchNorm runs on GPUs only); "
                    "on the CPU leave it off."
                )
            module = nn.SyncBatchNorm.convert_sync_batchnorm(module)
        module = module.to(placement.device)
        return DistributedDataParallel(
            module,
            device_ids=list(placement.device_ids) or None,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
        )

    def eval_module(self, wrapped: nn.Module) -> nn.Module:
        assert isinstance(wrapped, DistributedDataParallel)
        return wrapped.module  # type: ignore[no-any-return]  # DDP's forward may sync buffers

    def release(self, wrapped: nn.Module) -> None:
        # The reducer holds Gloo work objects; freed after the group, at interpreter teardown,
        # they can abort() the process (SIGABRT: "terminate called without an active exception").
        if hasattr(wrapped, "reducer"):
            del wrapped.reducer

    def no_sync(self, wrapped: nn.Module) -> contextlib.AbstractContextManager[Any]:
        assert isinstance(wrapped, DistributedDataParallel)
        return wrapped.no_sync()


@dataclass(frozen=True)
class DP(_Replicated):
    """DataParallel: one process splits each batch over its GPUs. Kept for parity; DDP is faster."""

    name: str = "dp"
    one_process_many_devices: bool = True

    def wrap(self, module: nn.Module, placement: Placement, precision: Precision, mesh: Mesh) -> nn.Module:
        if placement.accelerator != "cuda":
            raise ConfigError("strategy 'dp' needs CUDA GPUs; on the CPU use 'ddp' or 'single'.")
        warnings.warn(
            "strategy 'dp' (DataParallel) runs one Python process for all GPUs and copies the "
            "model to each of them every step; 'ddp' is faster, even on one machine.",
            stacklevel=3,
        )
        return DataParallel(module.to(placement.device), device_ids=list(placement.device_ids))

    def eval_module(self, wrapped: nn.Module) -> nn.Module:
        return wrapped

    def release(self, wrapped: nn.Module) -> None:
        return None

    def no_sync(self, wrapped: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()  # gradients are already reduced on device 0


STRATEGIES = ("auto", "single", "ddp", "fsdp", "dp")


def _replicated_on_a_mesh(ddp: DDP, world_size: int) -> FSDP:
    """``DDP(tp=k, pp=p)``: FSDP2 over a ``(pp = p, replicate = world / (k × p), shard = 1, tp = k)`` mesh:
    gradients all-reduced across the data-parallel groups, nothing sharded (see ``DDP``)."""
    unsupported = [name for name in ("find_unused_parameters", "static_graph", "gradient_as_bucket_view",
                                     "sync_batchnorm") if getattr(ddp, name)]
    degrees = f"tp={ddp.tp!r}, pp={ddp.pp!r}"
    if unsupported:
        raise ConfigError(f"DDP({degrees}) takes none of {', '.join(unsupported)} (options of "
                          "DistributedDataParallel, which a mesh does not use): leave them out.")
    fixed = ddp.tp * ddp.pp if all(isinstance(d, int) and d >= 1 for d in (ddp.tp, ddp.pp)) else 0
    if not fixed or world_size % fixed:
        raise ConfigError(f"DDP({degrees}) needs whole degrees whose product divides the world size, but the job "
                          f"has {world_size} process(es): launch a multiple of tp × pp, or change the degrees.")
    return FSDP(replicate=world_size // fixed, tp=ddp.tp, tp_plan=ddp.tp_plan, pp=ddp.pp, pp_schedule=ddp.pp_schedule,
                pp_microbatches=ddp.pp_microbatches, pp_stages=ddp.pp_stages, reshard_after_forward=False,
                name="ddp")


def make_strategy(strategy: str | Strategy, world_size: int) -> Strategy:
    """``auto`` is DDP with several processes and a single device otherwise.

    ``ddp`` and ``fsdp`` at world size 1 are a single device: the same code path, with no group
    and no hooks (a model built on the meta device is then materialised whole). Except
    ``FSDP(cpu_offload=True)``: on one device, offload is how a model larger than its memory is
    trained, so it stays FSDP, over a group of one process.
    """
    if not isinstance(strategy, str):
        meshed = [k for k in ("tp", "replicate", "pp") if getattr(strategy, k, 1) > 1]
        if world_size == 1 and meshed:
            # the same script on one process as on the mesh: `lockstep verify`'s reference, a debug run
            degrees = ", ".join(f"{k}={getattr(strategy, k)}" for k in meshed)
            print(f"lockstep: {type(strategy).__name__}({degrees}) on one process: the model runs unsplit, as the "
                  "one-process reference of the mesh.", flush=True)
            strategy = dataclasses.replace(strategy, **dict.fromkeys(meshed, 1))  # type: ignore[type-var]
        if isinstance(strategy, DDP) and (strategy.tp != 1 or strategy.pp != 1):
            strategy = _replicated_on_a_mesh(strategy, world_size)
        if isinstance(strategy, FSDP):
            strategy.layout(world_size)  # degrees that do not fit the world size are refused here
            if strategy.cpu_offload:
                return strategy
        if isinstance(strategy, (DDP, FSDP)) and world_size == 1:
            return SingleDevice()
        return strategy
    name = strategy.lower()
    if name not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}: use one of {', '.join(STRATEGIES)}.")
    if name == "dp":
        return DP()
    if name == "fsdp":
        return FSDP() if world_size > 1 else SingleDevice()
    if name == "single":
        if world_size > 1:
            raise ConfigError(
                f"strategy 'single' runs one process, but the launcher started {world_size}: use "
                "strategy='ddp' (or 'auto')."
            )
        return SingleDevice()
    return DDP() if world_size > 1 else SingleDevice()
