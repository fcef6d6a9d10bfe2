"""The prepared model: what ``rt.setup`` makes of a user's model, in one order, and the kind of model it
makes, chosen once by the Runtime: the whole model on every rank (``WholeModel``), or this rank's
pipeline stages (``pipeline.staged.StagedModel``).

``prepare`` is the order of the parallelisms, written once for both kinds: cut into stages, convert
(precision), activation checkpointing, compile, tensor parallel, the data-parallel wrap, materialise.
The cut comes before the conversion so that the stand-ins of the other stages' modules take the dtype the
conversion gives (and those modules are never converted). A kind answers what differs: what the cut
keeps, which modules are the stages, how they are wrapped, and how a step, the whole state and the
buffers cross its ranks. The Runtime asks no ``if pp``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from lockstep.errors import ConfigError, UsageError
from lockstep.runtime.comm import collectives
from lockstep.runtime.faults.watchdog import Watchdog
from lockstep.runtime.parallel.activation_checkpointing import Policy, checkpoint_activations
from lockstep.runtime.parallel.devices import Placement
from lockstep.runtime.parallel.mesh import Mesh, Parallel
from lockstep.runtime.parallel.meta_init import is_empty, repoint_optimizers
from lockstep.runtime.parallel.num_items import ItemNormalizer
from lockstep.runtime.parallel.precision import Precision
from lockstep.runtime.parallel.strategy import Strategy
from lockstep.runtime.parallel.tensor_parallel import apply_plan, plan_of
from lockstep.runtime.parallel.wrappers import WrappedModule, model_inputs, model_output

Backward = Callable[[torch.Tensor, "int | torch.Tensor | None"], None]


class Batches(Protocol):
    """The training batch the loop trains on: its loss weight; a forward tells which one it trains on."""

    loss_weight: float
    evaluated: Any  # the evaluation batch handed out
    bypassed: bool  # the latest training forward ran outside the data-parallel wrapper

    def take(self, inputs: Any) -> None: ...
    def evaluates(self, inputs: Any) -> bool: ...


@dataclass
class Tools:
    """What preparing and stepping a model needs from its Runtime, given once."""

    strategy: Strategy
    precision: Precision
    placement: Placement
    mesh: Mesh
    parallel: Parallel
    seed: int
    rank: int
    watchdog: Watchdog
    items: ItemNormalizer
    stand_in: Callable[[], dict[int, torch.Tensor]] | None  # a sharded forward's real rows for a padding batch
    batches: Batches  # the training batch the loop trains on (the Runtime's CurrentBatch)
    all_gather: Callable[[Any], list[Any]]
    backward: Backward  # rt.backward
    recorder: Any = None  # lockstep verify's StepRecorder, when verifying


class ModelKind(Protocol):
    """What differs between a whole model and pipeline stages; ``prepare`` runs the order around it."""

    elsewhere: bool  # some of the optimizers' parameters live on other ranks (other stages)
    warms_up: bool  # its first step runs each module once on empty tensors first (torch's shape inference)
    tools: Tools

    def cut(self, model: nn.Module) -> None: ...
    def views(self, module: nn.Module) -> list[nn.Module]: ...
    def wrap(self, module: nn.Module, views: list[nn.Module]) -> tuple[WrappedModule, nn.Module]: ...
    def forward_backward(self, model: nn.Module, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
                         num_items: Callable[[Any], int | torch.Tensor] | None,
                         inputs: Callable[[Any], torch.Tensor]) -> torch.Tensor: ...
    def no_sync(self, model: WrappedModule) -> contextlib.AbstractContextManager[Any]: ...
    def whole_state(self, state_of: Callable[[bool], dict[str, torch.Tensor]],
                    rank0_only: bool) -> dict[str, torch.Tensor]: ...
    def sync_buffers(self, buffers: list[torch.Tensor], src: int) -> None: ...


def prepare(model: nn.Module, optimizers: tuple[torch.optim.Optimizer, ...], kind: ModelKind,
            compile_module: Callable[[nn.Module], Any], policy: Policy | None) -> tuple[WrappedModule, nn.Module]:
    """``model`` made ready on this rank, in the one order of the parallelisms; the optimizers re-pointed to
    the parameters it now holds. Returns the wrapped model and what ``close`` releases."""
    tools = kind.tools
    strategy, mesh = tools.strategy, tools.mesh
    before = dict(model.named_parameters())
    _start_as_rank_0(model, tools.placement.device)  # 0. rank 0's values on all (unseeded, each rank built its own)
    kind.cut(model)  # 1. pipeline stages: the other stages' modules dropped
    module = tools.precision.convert_module(model)  # 2. precision
    if is_empty(module) and not strategy.collective_forward:  # nothing shards it: allocated whole, now
        strategy.materialize(module, tools.placement, tools.seed, mesh)
    if policy is not None and mesh.cut is not None:
        raise ConfigError("context parallel with activation checkpointing: the recompute in the backward runs "
                          "outside the ring's attention; leave activation_checkpointing unset with cp > 1.")
    checkpoint_activations(module, policy)  # 3. activation checkpointing
    compile_module(module)  # 4. compile, before any wrapper sees the blocks
    views = kind.views(module)
    if mesh.tp > 1:  # 5. tensor parallel: each weight of the plan split over the tp peers (before any wrap)
        plan = plan_of(module, tools.parallel.tp_plan, "Parallel")
        for view in views:
            apply_plan(view, mesh.tp_mesh(), plan, stage=kind.elsewhere)
    wrapped, released = kind.wrap(module, views)  # 6. data parallel
    if is_empty(module):  # 7. sharded first: each rank allocates and initialises its shards only
        for view in views:
            strategy.materialize(view, tools.placement, tools.seed, mesh)
    repoint_optimizers(before, module, optimizers, elsewhere=kind.elsewhere)
    return wrapped, released


def _start_as_rank_0(model: nn.Module, device: torch.device) -> None:
    """Rank 0's parameters and buffers on every rank, where they differ (compared bit for bit, sent only then):
    DDP would broadcast them, but ``fully_shard`` cuts each rank's shard from its own values, and pipeline
    stages keep each their own rank's modules, so a model built unseeded (or seeded per rank, or loaded on
    rank 0 only) would become one that no rank built."""
    import torch.distributed as dist

    if dist.is_initialized():
        tensors = [tensor for tensor in (*model.parameters(), *model.buffers())  # a subclass, a sparse one: its own
                   if type(tensor.detach()) is torch.Tensor and tensor.layout == torch.strided]
        collectives.agree_with_first(tensors, dist.group.WORLD, device, "the model given to rt.setup",
                                     readable=not is_empty(model))


class WholeModel:
    """The whole model on every rank, wrapped by the strategy (DDP, FSDP over the data-parallel ranks)."""

    elsewhere = False
    warms_up = False

    def __init__(self, tools: Tools) -> None:
        self.tools = tools

    def cut(self, model: nn.Module) -> None:
        return None

    def views(self, module: nn.Module) -> list[nn.Module]:
        return [module]

    def wrap(self, module: nn.Module, views: list[nn.Module]) -> tuple[WrappedModule, nn.Module]:
        tools = self.tools
        forward_module = tools.strategy.wrap(module, tools.placement, tools.precision, tools.mesh)
        eval_module = tools.strategy.eval_module(forward_module)
        watch = tools.watchdog if tools.strategy.collective_forward else None  # a forward that is a collective
        clock = tools.watchdog.clock
        if clock is not None and not tools.strategy.collective_forward:  # the straggler report: its wait in DDP
            clock.watch_gradients([p for p in module.parameters() if p.requires_grad])
        replicas = tools.mesh.layout.gradient_peers  # each moves running statistics with its own tokens
        return (WrappedModule(forward_module, eval_module, module, tools.precision, tools.stand_in, watch, replicas,
                              clock, tools.mesh.ring, tools.batches), forward_module)

    def forward_backward(self, model: nn.Module, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
                         num_items: Callable[[Any], int | torch.Tensor] | None,
                         inputs: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        loss = loss_fn(model_output(model(inputs(batch))), batch)
        self.tools.backward(loss, num_items(batch) if num_items is not None else None)
        return loss.detach()

    def no_sync(self, model: WrappedModule) -> contextlib.AbstractContextManager[Any]:
        return self.tools.strategy.no_sync(model.forward_module)

    def whole_state(self, state_of: Callable[[bool], dict[str, torch.Tensor]],
                    rank0_only: bool) -> dict[str, torch.Tensor]:
        return state_of(rank0_only)

    def sync_buffers(self, buffers: list[torch.Tensor], src: int) -> None:
        if buffers:
            with self.tools.watchdog.watch("sync_buffers"):
                collectives.broadcast_in_place(buffers, src)


def default_inputs(given: Callable[[Any], torch.Tensor] | None) -> Callable[[Any], torch.Tensor]:
    """What ``rt.forward_backward`` calls the model with: ``given``, else the batch's usual input."""
    if given is not None and not callable(given):
        raise UsageError(f"inputs={given!r}: give a function of the batch, e.g. lambda batch: batch['input_ids'].")
    return given if given is not None else model_inputs
