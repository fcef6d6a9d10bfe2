"""The staged model: what ``rt.setup`` makes of a model under pipeline parallel (``StagedModel``, the
Runtime's model kind when ``Parallel(pp > 1)``), and the module it returns (``PipelinedModule``): this
rank's stages, a step through torch's schedule with each micro-batch's share of the loss, the whole
model's state joined from the stages, each stage's buffers from its first rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lockstep.errors import UsageError
from lockstep.runtime.comm import collectives
from lockstep.runtime.parallel.models import ModelKind, Tools, WholeModel
from lockstep.runtime.parallel.pipeline.chain import ChainCheck
from lockstep.runtime.parallel.pipeline.schedule import Pipeline, rows
from lockstep.runtime.parallel.pipeline.stages import (
    check_stages,
    keep_stages,
    split_model,
    stage_views,
    stages_of_rank,
    stages_per_rank,
)
from lockstep.runtime.parallel.precision import Precision
from lockstep.runtime.parallel.tensor_parallel import layout_root
from lockstep.runtime.parallel.wrappers import WrappedModule


class StagedModel:
    """This rank's pipeline stages: cut from the model by layer (or ``Parallel(pp_stages=...)``), each
    sharded or replicated over the data-parallel ranks of its stage, and run by the schedule."""

    elsewhere = True
    warms_up = True  # torch's schedule runs each stage once on empty tensors to learn the shapes it sends

    def __init__(self, tools: Tools) -> None:
        self.tools = tools
        self.schedule, self.microbatches = tools.parallel.pipeline_settings()
        layout = tools.mesh.layout
        self.num_stages = layout.pp * stages_per_rank(self.schedule)
        self.mine = stages_of_rank(layout.pipeline_rank(tools.rank), layout.pp, self.schedule)
        # Without data parallel the stages stay outside FSDP (which over one rank tripled a CPU step,
        # pipeline_bubble.py), a mixed precision then running under autocast.
        self.outside_fsdp = layout.data_parallel_size == 1
        self._stages: list[list[str]] = []

    def cut(self, model: nn.Module) -> None:
        given = self.tools.parallel.pp_stages
        if given is None:
            self._stages = split_model(model, self.num_stages)
        else:  # names as the user writes them (layout_root), then as the model holds them
            root, prefix = layout_root(model)
            self._stages = [[f"{prefix}.{name}" if prefix else name for name in names]
                            for names in check_stages(root, given)]
        keep_stages(model, self._stages, self.mine)

    def views(self, module: nn.Module) -> list[nn.Module]:
        return stage_views(module, self._stages, self.mine)

    def wrap(self, module: nn.Module, views: list[nn.Module]) -> tuple[WrappedModule, nn.Module]:
        tools = self.tools
        if not self.outside_fsdp:  # each stage sharded (or replicated) over its data-parallel ranks
            for view in views:
                tools.strategy.wrap(view, tools.placement, tools.precision, tools.mesh)
        pipeline = Pipeline(views, self.mine, self.num_stages, self.schedule, self.microbatches,
                            tools.placement.device, tools.mesh.pp_group(), tools.all_gather, tools.precision,
                            self.outside_fsdp, ChainCheck(self._stages, self.mine))
        return PipelinedModule(pipeline, module, tools.precision, tools.stand_in, tools.watchdog,
                               tools.mesh.layout.data_parallel_size), module

    def forward_backward(self, model: nn.Module, batch: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
                         num_items: Callable[[Any], int | torch.Tensor] | None,
                         inputs: Callable[[Any], torch.Tensor]) -> torch.Tensor:
        """The step's micro-batches through the schedule; each micro-batch's loss is multiplied by its factor
        (its share of the rows, or of the step's items) and the step's loss is returned on every rank."""
        if not isinstance(model, PipelinedModule):
            raise UsageError("under pipeline parallel rt.forward_backward needs the model that rt.setup returned "
                             f"(a PipelinedModule), not a {type(model).__name__}.")
        tools, pipeline = self.tools, model.pipeline
        tools.batches.take(batch)  # the batch this step trains on (a loop may have looked ahead)
        first = tools.precision.convert_input(inputs(batch))
        count = pipeline.check(first)
        size = pipeline.rows // pipeline.microbatches
        spans = [(m * size, min((m + 1) * size, count)) for m in range(pipeline.microbatches)]
        shares: list[torch.Tensor | float]
        factors: list[torch.Tensor | float]
        total: torch.Tensor | float
        if num_items is None:
            tools.items.plain_backward()
            shares = [max(stop - start, 0) / max(count, 1) for start, stop in spans]
            factors = [share * tools.batches.loss_weight for share in shares]
            total = tools.batches.loss_weight
        else:
            counts = [torch.as_tensor(num_items(rows(batch, start, stop, count)) if stop > start else 0,
                                      device=tools.placement.device, dtype=torch.float64) for start, stop in spans]
            # float64, each cast to its loss's dtype where it is applied (a float64 model's is not rounded)
            factors = [tools.items.loss_factor(items, dtype=torch.float64) for items in counts]  # every stage
            total = torch.stack(counts).sum()  # a weighted mean's weight sum may be below 1: divided as it is
            shares = [torch.where(total > 0, items / total.where(total > 0, 1.0), 0.0) for items in counts]
        with tools.watchdog.step("pipeline step"):  # the stages' sends and receives, FSDP's collectives
            loss = pipeline.run(batch, first, loss_fn, factors, shares, count)
        if tools.recorder is not None:  # the step's loss, standing for this rank's samples or items
            tools.recorder.backward(loss, total)
        return loss

    def no_sync(self, model: WrappedModule) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()  # the schedule reduces the gradients at its last micro-batch

    def whole_state(self, state_of: Callable[[bool], dict[str, torch.Tensor]],
                    rank0_only: bool) -> dict[str, torch.Tensor]:
        """The whole model's state from each stage's, sent by one rank of each stage."""
        tools = self.tools
        stage = state_of(False)
        mine = stage if tools.mesh.layout.speaks_for_stage(tools.rank) else {}
        parts = collectives.gather_objects(mine, rank0_only)
        whole: dict[str, torch.Tensor] = {}
        for part in parts:
            whole.update(part)
        return whole

    def sync_buffers(self, buffers: list[torch.Tensor], src: int) -> None:
        """Each stage's own buffers: from its first rank, to the ranks that hold it."""
        tools = self.tools
        with tools.watchdog.watch("sync_buffers"):
            collectives.broadcast_in_place(buffers, tools.mesh.layout.first_of_stage(tools.rank),
                                           tools.mesh.stage_group())


class PipelinedModule(WrappedModule):
    """What ``rt.setup`` returns under pipeline parallel: this rank's stages of the model (``state_dict``
    and checkpoints by the whole model's names). Training steps run through ``rt.forward_backward``;
    called with gradients off (evaluation, ``predict``), it runs its input through every stage, one
    after another, and every rank of the pipeline gets the last stage's output."""

    def __init__(self, pipeline: Pipeline, module: nn.Module, precision: Precision,
                 stand_in: Callable[[], dict[int, torch.Tensor]] | None = None, watchdog: Any = None,
                 replicas: int = 1) -> None:
        super().__init__(module, module, module, precision, stand_in, watchdog, replicas)
        self.__dict__["pipeline"] = pipeline

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            raise UsageError("a model split into pipeline stages holds only some of its layers on each rank: run a "
                             "training step with rt.forward_backward(model, batch, loss_fn), not model(...) (which "
                             "runs under torch.no_grad(), for evaluation).")
        return super().forward(*args, **kwargs)

    def _forward(self, args: Any, kwargs: Any) -> Any:
        if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
            raise UsageError("a model on pipeline stages is called with one tensor, its first stage's input (e.g. "
                             "model(batch['input_ids'])); the later stages receive what the one before returns.")
        return self.__dict__["pipeline"].forward(args[0])

    def train(self, mode: bool = True) -> PipelinedModule:
        """The mode of the model and of this rank's stages (copies of its structure when it holds several)."""
        super().train(mode)
        for view in self.__dict__["pipeline"].views:
            view.train(mode)
        return self

    def norm_across_stages(self, norm: torch.Tensor, norm_type: float) -> torch.Tensor:
        """The gradient norm of the whole model from this rank's (``rt.clip_grad_norm_``)."""
        return self.__dict__["pipeline"].norm_across(norm, norm_type)


def model_kind_for(tools: Tools) -> ModelKind:
    """What ``setup`` makes of a model, chosen once when the Runtime starts: this rank's pipeline stages
    (``pp`` > 1), else the whole model."""
    return StagedModel(tools) if tools.mesh.pp > 1 else WholeModel(tools)
