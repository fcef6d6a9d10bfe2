"""The schedule: one of torch's pipeline schedules (``torch.distributed.pipelining``) running a step's
micro-batches through this rank's stages, each micro-batch's loss and weight, and a forward through every
stage for evaluation.

Every rank of a pipeline reads the same rows (its data-parallel rank's share of the global batch): a batch
of token ids is small next to the activations that cross the stages, and with the same rows on every
stage the item counts (``num_items``), the loss weights and the loader's position are the same on every
rank, so nothing about the data is special to a stage. The first stage feeds the inputs to the model; the
last computes the loss of each micro-batch from its rows.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lockstep.errors import ConfigError, UsageError
from lockstep.runtime.parallel.pipeline.chain import ChainCheck
from lockstep.runtime.parallel.pipeline.stages import SINGLE, stages_of_rank
from lockstep.runtime.parallel.precision import Precision
from lockstep.runtime.parallel.wrappers import model_output
from lockstep.runtime.tree import map_tensors

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool)


def _as_embeddings(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A later stage of a Hugging Face model: what it receives is the hidden state, given as
    ``inputs_embeds`` (the model then computes positions from its shape and skips the token embedding)."""
    if len(args) == 1 and not kwargs and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
        return (), {"inputs_embeds": args[0]}
    return None


def _under_autocast(view: nn.Module, precision: Precision) -> None:
    """A stage outside FSDP under a mixed precision: its forward under autocast, as one process runs the whole
    model's, and its output handed on in float32 (the dtype torch's stage infers for it on the meta device,
    where autocast casts nothing)."""
    forward = view.forward

    def forward_under_autocast(*args: Any, **kwargs: Any) -> Any:
        with precision.autocast():
            output = forward(*args, **kwargs)
        return precision.convert_output(output)

    view.forward = forward_under_autocast  # type: ignore[method-assign]


def _sent(output: Any) -> Any:
    """A stage's output as it is sent on: not a view (a Skipped head hands on a slice of its input, and the
    zero-bubble schedules detach a stage's outputs in place)."""
    return output.clone() if isinstance(output, torch.Tensor) and output._is_view() else output


def rows(batch: Any, start: int, stop: int, count: int) -> Any:
    """Rows ``start:stop`` of every tensor in ``batch`` with ``count`` rows (other values as they are)."""
    return map_tensors(lambda t: t[start:stop] if t.dim() and t.shape[0] == count else t, batch)


@dataclass
class Step:
    """What one pipeline step's loss function needs: the batch, where each micro-batch's rows end, what each
    micro-batch's loss is multiplied by before its backward (``factors``) and its share of the step's
    reported loss (``shares``)."""

    batch: Any
    count: int
    size: int  # rows per micro-batch
    factors: list[torch.Tensor | float]
    shares: list[torch.Tensor | float]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    inferring: bool = False  # a new schedule's first call: torch's shape inference, on no real rows
    total: torch.Tensor | None = None


class Pipeline:
    """This rank's stages and the schedule that runs them. torch's stages size their send and receive
    buffers at the first step, and the data-parallel ranks of a stage share its collectives (FSDP's), so
    every step of every rank runs micro-batches of one shape: the first step's, agreed by all ranks."""

    def __init__(self, views: list[nn.Module], mine: list[int], num_stages: int, schedule: str, microbatches: int,
                 device: torch.device, group: Any, all_gather: Callable[[Any], list[Any]], precision: Precision,
                 outside_fsdp: bool, chain: ChainCheck | None = None) -> None:
        self.views, self.mine, self.num_stages = views, mine, num_stages
        self._chain = chain  # checked at the first forward through the stages, then dropped
        self._scale, self._zero = precision.scale, torch.zeros((), device=device)
        self._loss_input = precision.convert_output  # the loss sees float32 logits, as without pp
        self.schedule_name, self.microbatches, self.device, self.group = schedule, microbatches, device, group
        self._all_gather = all_gather
        self.shape: tuple[int, ...] | None = None  # the inputs of every step: the first step's, on every rank
        self._schedule: Any = None
        self._step: Step | None = None
        self._first_step = True  # the schedule's first step also infers the shapes of the gradients
        size = dist.get_world_size(group)
        self.holder = {stage: r for r in range(size) for stage in stages_of_rank(r, size, schedule)}  # stage → rank
        for view, index in zip(views, mine, strict=True):
            # first of the forward hooks: FSDP's, which follow, then see no view (they warn of one)
            view.register_forward_hook(lambda _module, _args, output: _sent(model_output(output)), prepend=True)
            if index and "inputs_embeds" in inspect.signature(view.forward).parameters:
                view.register_forward_pre_hook(_as_embeddings, with_kwargs=True)
            if outside_fsdp and precision.fsdp_policy() is not None:  # no FSDP policy makes the mixed precision
                _under_autocast(view, precision)

    @property
    def holds_last(self) -> bool:
        return self.num_stages - 1 in self.mine

    @property
    def rows(self) -> int:
        assert self.shape is not None
        return self.shape[0]

    def _build(self) -> Any:
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import get_schedule_class

        stages = [PipelineStage(view, index, self.num_stages, self.device, group=self.group)
                  for view, index in zip(self.views, self.mine, strict=True)]
        try:
            return get_schedule_class(self.schedule_name)(
                stages[0] if self.schedule_name in SINGLE else stages, self.microbatches, loss_fn=self._loss,
                scale_grads=False)
        except (ValueError, AssertionError) as error:  # checked before any send
            raise ConfigError(f"pipeline schedule {self.schedule_name} with {self.microbatches} micro-batches on "
                              f"{self.num_stages} stages: {error}") from None

    def check(self, inputs: torch.Tensor) -> int:
        """The rows of this step, refused before any send when the micro-batches cannot split them or the
        shape is not the first step's (at the first step: the same on every rank)."""
        shape = tuple(inputs.shape)
        if self.shape is None:
            shapes = self._all_gather(list(shape))
            if any(tuple(other) != shape for other in shapes):
                raise ConfigError(
                    f"pipeline parallel runs every step on inputs of one shape, but the ranks' first batches are "
                    f"{sorted({tuple(s) for s in shapes})}: pad every row to one length in the collate function "
                    "(e.g. a tokenizer's padding='max_length'), and give a batch size the data-parallel ranks "
                    "split evenly.")
            if not shape or shape[0] < self.microbatches or shape[0] % self.microbatches:
                raise ConfigError(
                    f"{self.microbatches} pipeline micro-batches do not divide this rank's batch of "
                    f"{shape[0] if shape else 0} rows: make the per-rank batch (batch_size / data-parallel size) a "
                    "multiple of pp_microbatches.")
            self.shape = shape
            self._schedule = self._build()
        elif shape[1:] != self.shape[1:] or shape[0] > self.shape[0]:
            raise ConfigError(
                f"a pipeline step on inputs of shape {shape} after a first step on {self.shape}: every step runs "
                "the first step's shape (a shorter last batch is padded): pad every row to one length in the "
                "collate function.")
        return shape[0]

    def run(self, batch: Any, inputs: torch.Tensor, loss_fn: Callable[[Any, Any], torch.Tensor],
            factors: list[torch.Tensor | float], shares: list[torch.Tensor | float],
            count: int) -> torch.Tensor:
        """One step's forward and backward over every micro-batch; the step's loss (the micro-batches' losses
        times their shares, summed) on every rank of the pipeline."""
        if count < self.rows:  # a short last batch: padded with copies of its last row, which no loss sees
            pad = inputs[-1:].expand(self.rows - count, *inputs.shape[1:])
            inputs = torch.cat([inputs, pad]) if count else inputs.new_zeros(self.rows, *inputs.shape[1:])
        size = self.rows // self.microbatches
        if self._chain is not None:  # the first step: its first micro-batch through every stage, watched
            with torch.no_grad():
                self.forward(inputs[:size])
        self._step = Step(batch, count, size, factors, shares, loss_fn, inferring=self._first_step)
        self._first_step = False
        # each row's micro-batch, on the host: the schedule cuts it as it cuts the inputs, and the loss
        # function reads which micro-batch it has without waiting for the device
        target = torch.arange(self.rows) // size
        self._scale(self._zero)  # 16-mixed: the GradScaler's scale exists on every stage, which unscales
        try:
            if 0 in self.mine:
                self._schedule.step(inputs, target=target if self.holds_last else None)
            else:
                self._schedule.step(target=target if self.holds_last else None)
            return self._on_every_stage(self._step.total)
        finally:
            self._step = None

    def _on_every_stage(self, loss: torch.Tensor | None) -> torch.Tensor:
        """The step's loss, from the rank of the last stage to every rank of the pipeline: sent in float64, then
        in the stages' parameters' dtype, float32 at least (every rank knows it, as the one-process loss's)."""
        value = (loss.detach().double() if loss is not None else
                 torch.zeros((), dtype=torch.float64, device=self.device)).reshape(())
        self._move(value, self.holder[self.num_stages - 1], None)
        weights = next((p.dtype for view in self.views for p in view.parameters() if p.is_floating_point()),
                       torch.float32)
        return value.to(torch.promote_types(weights, torch.float32))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """The model's output on ``inputs`` (gradients off), every stage in turn, on every rank of the pipeline;
        the first such forward also checks that the model's forward is a chain through the stages."""
        chain, self._chain = self._chain, None
        if chain is None:
            return self._through_stages(inputs)
        with chain.watching(self.views):
            output = self._through_stages(inputs)
        chain.settle(self._all_gather)
        return output

    def _through_stages(self, inputs: torch.Tensor) -> torch.Tensor:
        me, holder = dist.get_rank(self.group), self.holder
        views = dict(zip(self.mine, self.views, strict=True))
        value: torch.Tensor | None = inputs
        for stage in range(self.num_stages):
            if holder[stage] != me:
                continue
            if stage and holder[stage - 1] != me:
                value = self._exchange(None, holder[stage - 1], me)
            value = views[stage](value)
            if not isinstance(value, torch.Tensor):
                raise UsageError(f"pipeline stage {stage} returned a {type(value).__name__}: a stage hands on one "
                                 "tensor (a Hugging Face model's logits are taken from its output).")
            if stage + 1 < self.num_stages and holder[stage + 1] != me:
                self._exchange(value, me, holder[stage + 1])
        last = holder[self.num_stages - 1]
        return self._exchange(value if me == last else None, last, None)

    def _exchange(self, value: torch.Tensor | None, source: int, target: int | None) -> torch.Tensor:
        """``value`` from pipeline rank ``source`` to ``target`` (None: to every rank), shape and dtype first."""
        me = dist.get_rank(self.group)
        header = torch.zeros(10, dtype=torch.int64, device=self.device)
        if me == source:
            assert value is not None
            if value.dim() > 8 or value.dtype not in _DTYPES:
                raise UsageError(f"a pipeline stage's output of shape {tuple(value.shape)} and dtype {value.dtype} "
                                 "cannot be passed on: at most 8 dimensions, a float, integer or bool dtype.")
            header[0], header[1] = value.dim(), _DTYPES.index(value.dtype)
            header[2:2 + value.dim()] = torch.tensor(value.shape, dtype=torch.int64)
        self._move(header, source, target)
        if me != source:
            dims = int(header[0])
            value = torch.empty([int(d) for d in header[2:2 + dims]], dtype=_DTYPES[int(header[1])], device=self.device)
        assert value is not None
        value = value.contiguous()
        self._move(value, source, target)
        return value

    def _move(self, tensor: torch.Tensor, source: int, target: int | None) -> None:
        """``tensor`` (filled in place on the receivers) from pipeline rank ``source`` to ``target`` or to all."""
        source_rank = dist.get_global_rank(self.group, source)
        if target is None:
            dist.broadcast(tensor, src=source_rank, group=self.group)
        elif dist.get_rank(self.group) == source:
            dist.send(tensor, dist.get_global_rank(self.group, target), group=self.group)
        else:
            dist.recv(tensor, source_rank, group=self.group)

    def norm_across(self, norm: torch.Tensor, norm_type: float) -> torch.Tensor:
        if norm_type == float("inf"):
            dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=self.group)
            return norm
        power = norm.double() ** norm_type
        dist.all_reduce(power, group=self.group)
        return (power ** (1.0 / norm_type)).to(norm.dtype)

    def _loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The loss of the micro-batch whose rows' micro-batch numbers are ``target``."""
        step = self._step
        assert step is not None
        if step.inferring:  # the shapes of the gradients, from a forward on no real rows
            step.inferring = False
            return output.sum() * 0.0
        index = int(target[0])
        start, stop = index * step.size, min((index + 1) * step.size, step.count)
        if stop <= start:  # padding only: a loss of zero that still reaches every parameter of the stage
            return output.sum() * 0.0
        loss = step.loss_fn(self._loss_input(output[: stop - start]), rows(step.batch, start, stop, step.count))
        dtype = torch.promote_types(loss.dtype, torch.float32)  # float32 for a low-precision loss, as rt.backward
        weighted = loss * _as(step.factors[index], dtype)
        share = loss.detach() * _as(step.shares[index], dtype)
        step.total = share if step.total is None else step.total + share
        return self._scale(weighted)


def _as(value: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor | float:
    """A micro-batch's factor or share in its loss's dtype (a float stays one)."""
    return value.to(dtype) if isinstance(value, torch.Tensor) else value
