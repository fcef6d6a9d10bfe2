"""Strategies as small objects: how the model is placed and how gradients are synchronised."""

from __future__ import annotations

import contextlib
import re
import warnings
from dataclasses import dataclass
from typing import Any, Protocol

from torch import nn
from torch.nn.parallel import DataParallel, DistributedDataParallel

from lockstep.errors import ConfigError, UsageError
from lockstep.runtime.parallel.devices import Placement
from lockstep.runtime.parallel.fsdp import FSDP
from lockstep.runtime.parallel.mesh import Mesh, MeshLayout, Parallel, refuses_degrees
from lockstep.runtime.parallel.meta_init import materialize
from lockstep.runtime.parallel.precision import Precision


class Strategy(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def one_process_many_devices(self) -> bool: ...
    @property
    def collective_forward(self) -> bool: ...  # True: every rank must run every forward (FSDP)

    def wrap(self, module: nn.Module, placement: Placement, precision: Precision, mesh: Mesh) -> nn.Module: ...
    def materialize(self, module: nn.Module, placement: Placement, seed: int, mesh: Mesh) -> None: ...
    def eval_module(self, wrapped: nn.Module) -> nn.Module: ...
    def release(self, wrapped: nn.Module) -> None: ...
    def no_sync(self, wrapped: nn.Module) -> contextlib.AbstractContextManager[Any]: ...


class _Replicated:
    """What the strategies that keep a whole model on each device share."""

    collective_forward = False

    def materialize(self, module: nn.Module, placement: Placement, seed: int, mesh: Mesh) -> None:
        materialize(module, placement.device, seed)


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


@refuses_degrees
@dataclass(frozen=True)
class DDP(_Replicated):
    """DistributedDataParallel: one process per device, gradients all-reduced in buckets.

    ``sync_batchnorm`` converts BatchNorm layers to SyncBatchNorm so statistics cover the
    global batch; the other options are DistributedDataParallel's own.

    With tensor, pipeline or context parallel (``lockstep.Parallel(tp=..., pp=..., cp=...)``) DDP means data
    parallel by replication on the mesh, built as FSDP2's ``fully_shard`` over a ``(replicate = data-parallel
    degree, shard = 1)`` mesh, which all-reduces without sharding (with ``cp``, the weights are sharded over
    each copy's cp ranks, which hold the same weights): ``DistributedDataParallel``'s own
    route to tensor parallel swaps the parameters for local tensors outside the forward (torch's
    ``_pre_dp_module_transform``) and its state_dict then holds no DTensors; this way checkpoints
    reshard like FSDP's (docs/parallelism.md). Its options, DistributedDataParallel's, are then
    refused by name.
    """

    find_unused_parameters: bool = False
    static_graph: bool = False
    gradient_as_bucket_view: bool = False
    sync_batchnorm: bool = False
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
        if not any(p.requires_grad for p in module.parameters()):  # a frozen model (a teacher): no gradient to
            return module  # average, so no DDP (which refuses such a model); each rank holds the same weights
        return _ExplainedDDP(
            module,
            device_ids=list(placement.device_ids) or None,
            find_unused_parameters=self.find_unused_parameters,
            static_graph=self.static_graph,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
        )

    def eval_module(self, wrapped: nn.Module) -> nn.Module:
        if not isinstance(wrapped, DistributedDataParallel):  # a frozen model, not wrapped
            return wrapped
        return wrapped.module  # type: ignore[no-any-return]  # DDP's forward may sync buffers

    def release(self, wrapped: nn.Module) -> None:
        # The reducer holds Gloo work objects; freed after the group, at interpreter teardown,
        # they can abort() the process (SIGABRT: "terminate called without an active exception").
        if hasattr(wrapped, "reducer"):
            del wrapped.reducer

    def no_sync(self, wrapped: nn.Module) -> contextlib.AbstractContextManager[Any]:
        return wrapped.no_sync() if isinstance(wrapped, DistributedDataParallel) else contextlib.nullcontext()


class _ExplainedDDP(DistributedDataParallel):
    """DistributedDataParallel whose failure at a parameter that got no gradient in the last backward
    (torch's 100-line ``Expected to have finished reduction``) is one line naming the parameters."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().forward(*args, **kwargs)
        except RuntimeError as error:
            if "Expected to have finished reduction in the prior iteration" not in str(error):
                raise
            raise UsageError(_unused_parameters(self.module, str(error), self.find_unused_parameters)) from None


def _unused_parameters(module: nn.Module, message: str, searched: bool) -> str:
    """The line for parameters that received no gradient: named from torch's indices when it gives them.
    ``searched``: DDP already looked for unused parameters (``find_unused_parameters=True``)."""
    trained = [name for name, parameter in module.named_parameters() if parameter.requires_grad]
    found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", message)
    indices = [int(i) for i in found.group(1).split()] if found else []
    names = [trained[i] for i in indices if i < len(trained)] or [
        name for name, parameter in module.named_parameters() if parameter.requires_grad and parameter.grad is None]
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    fix = ("make the loss depend on every output of the forward" if searched else
           "pass strategy=lockstep.DDP(find_unused_parameters=True) (slower: it searches the graph every step)")
    return (f"DDP: parameter(s) {shown or '(torch did not say which)'} received no gradient in the last backward "
            "(the forward did not use them, or the loss did not depend on them), so DDP's gradient reduction never "
            f"finished. Use them, set requires_grad=False on them, or {fix}.")


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


def _replicated_on_a_mesh(ddp: DDP) -> FSDP:
    """DDP on a mesh (tensor, pipeline or context parallel): FSDP2 over ``(replicate = data-parallel degree,
    shard = 1)`` (× cp, sharded), gradients all-reduced across the data-parallel ranks (see ``DDP``)."""
    unsupported = [name for name in ("find_unused_parameters", "static_graph", "gradient_as_bucket_view",
                                     "sync_batchnorm") if getattr(ddp, name)]
    if unsupported:
        raise ConfigError(f"DDP with tensor, pipeline or context parallel replicates through FSDP2 on the mesh, which "
                          f"takes none of {', '.join(unsupported)} (options of DistributedDataParallel): leave them "
                          "out.")
    return FSDP(reshard_after_forward=False, name="ddp")


def make_strategy(strategy: str | Strategy, world_size: int, parallel: Parallel | None = None,
                  ) -> tuple[Strategy, MeshLayout]:
    """The strategy and the mesh's degrees on ``world_size`` ranks.

    ``auto`` is DDP with several processes and a single device otherwise. ``ddp`` and ``fsdp`` at
    world size 1 are a single device: the same code path, with no group and no hooks (a model built
    on the meta device is then materialised whole). Except ``FSDP(cpu_offload=True)``: on one
    device, offload is how a model larger than its memory is trained, so it stays FSDP, over a group
    of one process. ``parallel`` on one process is the unsplit model, said in one line.
    """
    parallel = parallel if parallel is not None else Parallel()
    if not isinstance(parallel, Parallel):
        raise ConfigError(f"parallel={parallel!r}: give lockstep.Parallel(tp=..., pp=..., ...), or None.")
    chosen = _chosen(strategy, world_size)
    if parallel.trivial or world_size == 1:
        if not parallel.trivial:
            # the same script on one process as on the mesh: `lockstep verify`'s reference, a debug run
            print(f"lockstep: {parallel!r} on one process: the model runs unsplit, as the one-process reference "
                  "of the mesh.", flush=True)
        if isinstance(chosen, FSDP) and (world_size > 1 or chosen.cpu_offload):
            return chosen, MeshLayout.for_world(world_size)
        if isinstance(chosen, (DDP, FSDP)) and world_size == 1:
            chosen = SingleDevice()
        return chosen, MeshLayout(1, world_size, 1)
    if isinstance(chosen, DDP):
        chosen = _replicated_on_a_mesh(chosen)
        return chosen, parallel.layout(world_size, shards=False)
    if not isinstance(chosen, FSDP):
        raise ConfigError(f"{parallel!r} needs one process per device and a strategy that runs on a mesh: "
                          f"strategy 'ddp' or 'fsdp', not {getattr(chosen, 'name', chosen)!r}.")
    return chosen, parallel.layout(world_size, shards=chosen.name != "ddp")


def _chosen(strategy: str | Strategy, world_size: int) -> Strategy:
    """The strategy object a name (or a configured object) stands for, before the world size shapes it."""
    if not isinstance(strategy, str):
        return strategy
    name = strategy.lower()
    if name not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}: use one of {', '.join(STRATEGIES)}.")
    if name == "single" and world_size > 1:
        raise ConfigError(
            f"strategy 'single' runs one process, but the launcher started {world_size}: use "
            "strategy='ddp' (or 'auto')."
        )
    chosen: dict[str, Strategy] = {"dp": DP(), "fsdp": FSDP(), "single": SingleDevice()}
    return chosen.get(name, DDP())
