"""Pipeline parallel: the model cut into stages by layer, each pipeline rank holding its stages, and one of
torch's schedules running a step's micro-batches through them (``torch.distributed.pipelining``).

A stage is the whole model with the modules of the other stages replaced by ``Skipped`` (which hands its
first input on): the parameters a stage holds keep the names they have in the whole model, so its
checkpoints load on any other split, on any data-parallel degree and on one process. The cut is
automatic for a chain of repeated blocks (the embedding goes to the first stage; the norm and the head to
the last), or given as module names per stage.

Every rank of a pipeline reads the same rows (its data-parallel rank's share of the global batch): a batch
of token ids is small next to the activations that cross the stages, and with the same rows on every
stage the item counts (``num_items``), the loss weights and the loader's position are the same on every
rank, so nothing about the data is special to a stage. The first stage feeds the inputs to the model; the
last computes the loss of each micro-batch from its rows.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lockstep.errors import ConfigError, UsageError
from lockstep.runtime.parallel.precision import Precision
from lockstep.runtime.parallel.wrappers import WrappedModule
from lockstep.runtime.tree import map_tensors

# torch's schedules by name: those that run one stage per rank, and the interleaved ones (several per rank;
# the V-shaped ones hold stage r and 2·pp − 1 − r, the looped ones r, r + pp, ...).
SINGLE = ("GPipe", "1F1B")
LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
SCHEDULES = SINGLE + LOOPED + V_SHAPED


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool)


def schedule_name(name: str) -> str:
    """The schedule's own spelling of ``name`` (any case), refused when torch has no such schedule."""
    found = {known.lower(): known for known in SCHEDULES}.get(str(name).lower())
    if found is None:
        raise ConfigError(f"unknown pipeline schedule {name!r}: use one of {', '.join(SCHEDULES)}.")
    return found


def stages_per_rank(schedule: str) -> int:
    return 1 if schedule in SINGLE else 2


def stages_of_rank(pp_rank: int, pp: int, schedule: str) -> list[int]:
    """The stages pipeline rank ``pp_rank`` holds, in order."""
    if schedule in SINGLE:
        return [pp_rank]
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank(schedule))]


class Skipped(nn.Module):
    """Stands in for a module that another stage holds: hands its first input on unchanged, so the model's
    own forward runs from the stage's first module to its last. In place of an embedding that a later stage's
    forward still calls with token or position ids (GPT-2 adds position embeddings to what it receives),
    it gives zeros of the embedding's width: nothing added twice."""

    def __init__(self, width: int | None = None) -> None:
        super().__init__()
        self.width = width  # an embedding's: ids in, zeros of this width out
        if width is not None:  # its dtype follows the model's (bf16-true converts it too); never saved
            self.register_buffer("dtype_of_zeros", torch.empty(0), persistent=False)

    @classmethod
    def standing_for(cls, module: nn.Module) -> Skipped:
        return cls(module.embedding_dim if isinstance(module, nn.Embedding) else None)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        first = args[0] if args else next(iter(kwargs.values()))
        if self.width is not None and isinstance(first, torch.Tensor) and not first.is_floating_point():
            probe: torch.Tensor = self.get_buffer("dtype_of_zeros")
            return torch.zeros(*first.shape, self.width, device=first.device, dtype=probe.dtype)
        return first


def _has_parameters(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _blocks(model: nn.Module) -> tuple[str, list[str]]:
    """The model's repeated blocks: its ``nn.ModuleList`` (or ``nn.ModuleDict``) with the most entries, and
    their names in it."""
    lists = [(name, [key for key, _ in m.named_children()]) for name, m in model.named_modules()
             if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and len(m)]
    if not lists:
        raise ConfigError(f"pipeline parallel found no repeated blocks in {type(model).__name__} (no nn.ModuleList "
                          "or nn.ModuleDict of layers) to cut into stages: give the modules of each stage by name "
                          "(pp_stages=...).")
    return max(lists, key=lambda item: len(item[1]))


def split_model(model: nn.Module, num_stages: int) -> list[list[str]]:
    """The module names each stage holds: the blocks split evenly, what comes before them (the embedding)
    on the first stage and what comes after (the norm, the head) on the last; a stage in the middle takes
    a left-over block before the first or the last does, as those also hold the embedding and the head."""
    name, blocks = _blocks(model)
    if len(blocks) < num_stages:
        raise ConfigError(f"pipeline parallel with {num_stages} stages, but {type(model).__name__} has {len(blocks)} "
                          f"blocks ({name}): use at most {len(blocks)} stages (a smaller pp, or a schedule with one "
                          "stage per rank).")
    before: list[str] = []
    after: list[str] = []
    _outside_blocks(model, "", name, before, after)
    order = [*range(1, num_stages - 1), 0, num_stages - 1] if num_stages > 2 else list(range(num_stages))
    sizes = [len(blocks) // num_stages] * num_stages
    for stage in order[: len(blocks) % num_stages]:
        sizes[stage] += 1
    stages: list[list[str]] = []
    start = 0
    for size in sizes:
        stages.append([f"{name}.{key}" for key in blocks[start:start + size]])
        start += size
    stages[0][:0] = before
    stages[-1].extend(after)
    return stages


def _outside_blocks(module: nn.Module, prefix: str, blocks: str, before: list[str], after: list[str]) -> None:
    """The modules with parameters outside the blocks, in the order they were registered."""
    if module._parameters and any(p is not None for p in module._parameters.values()):
        names = ", ".join(f"{prefix}{n}" for n, p in module._parameters.items() if p is not None)
        raise ConfigError(f"pipeline parallel cannot place the parameter(s) {names}, held by "
                          f"{type(module).__name__} itself next to the blocks: move them into a submodule (an "
                          "nn.Embedding, an nn.Linear), or give the modules of each stage by name (pp_stages=...).")
    for child_name, child in module.named_children():
        full = prefix + child_name
        if full == blocks:
            after.append("")  # the blocks: what comes from here on is after them
        elif blocks.startswith(full + "."):
            _outside_blocks(child, full + ".", blocks, before, after)
        elif _has_parameters(child):
            (after if after else before).append(full)
        elif not after:  # without parameters, before the blocks (GPT-2's embedding dropout): the first stage's
            before.append(full)
    if not prefix:
        after[:] = [name for name in after if name]


def check_stages(model: nn.Module, stages: Sequence[Sequence[str]]) -> list[list[str]]:
    """Stages given by module names: each name a module of ``model``, every parameter in exactly one stage."""
    modules = dict(model.named_modules())
    owner: dict[str, int] = {}
    for index, names in enumerate(stages):
        for name in names:
            if name not in modules or not name:
                raise ConfigError(f"pp_stages names {name!r}, which is no submodule of {type(model).__name__}.")
            for param, _ in modules[name].named_parameters(prefix=name, remove_duplicate=False):
                if param in owner and owner[param] != index:
                    raise ConfigError(f"pp_stages puts {param} in stage {owner[param]} and stage {index}: give "
                                      "each module to one stage.")
                owner[param] = index
    missing = [name for name, _ in model.named_parameters(remove_duplicate=False) if name not in owner]
    if missing:
        raise ConfigError(f"pp_stages leaves {len(missing)} parameter(s) in no stage, e.g. {missing[0]}: name "
                          "every module with parameters in one stage.")
    return [list(names) for names in stages]


def _check_no_ties(model: nn.Module, stages: list[list[str]]) -> None:
    """A parameter shared by two stages (tied input and output embeddings) would be two copies that drift."""
    seen: dict[int, tuple[int, str]] = {}
    modules = dict(model.named_modules())
    for index, names in enumerate(stages):
        for name in names:
            for param_name, param in modules[name].named_parameters(prefix=name, remove_duplicate=False):
                first = seen.setdefault(id(param), (index, param_name))
                if first[0] != index:
                    raise ConfigError(
                        f"{first[1]} (stage {first[0]}) and {param_name} (stage {index}) are one tied parameter: "
                        "pipeline stages cannot share a weight. Untie them (tie_word_embeddings=False for a "
                        "Hugging Face model) or keep both modules in one stage.")


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    if isinstance(parent, (nn.ModuleList, nn.Sequential)) and child.isdigit():
        parent[int(child)] = new
    else:
        setattr(parent, child, new)


def keep_stages(model: nn.Module, stages: list[list[str]], mine: list[int]) -> None:
    """Make ``model`` the union of this rank's stages: the other stages' modules replaced by ``Skipped``
    (their memory freed)."""
    _check_no_ties(model, stages)
    for index, names in enumerate(stages):
        if index not in mine:
            for name in names:
                _replace(model, name, Skipped.standing_for(model.get_submodule(name)))
    for module in model.modules():  # a Hugging Face model, also inside a lockstep.Module: no key/value cache
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False):
            setattr(config, "use_cache", False)  # noqa: B010 - a config of any class


def stage_views(model: nn.Module, stages: list[list[str]], mine: list[int]) -> list[nn.Module]:
    """This rank's stage modules: ``model`` itself for one stage; for several, each a copy of its structure
    that shares the modules (and so the parameters) of its own stage with ``model``."""
    if len(mine) == 1:
        return [model]
    views = []
    for index in mine:
        memo: dict[int, Any] = {}
        for other in mine:
            for name in stages[other]:
                module = model.get_submodule(name)
                memo[id(module)] = module if other == index else Skipped.standing_for(module)
        views.append(copy.deepcopy(model, memo))
    return views


def model_output(output: Any) -> Any:
    """What a stage hands on and the loss function receives: a Hugging Face model's ``logits``, else the
    output itself."""
    logits = getattr(output, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else output


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


def model_inputs(batch: Any) -> torch.Tensor:
    """What the model is called with: a dict's ``input_ids`` (a Hugging Face batch), a tuple's first item,
    or the batch itself."""
    found = (batch.get("input_ids") if isinstance(batch, Mapping) else
             batch[0] if isinstance(batch, (tuple, list)) and batch else batch)
    if not isinstance(found, torch.Tensor):
        raise UsageError(f"the model's input in a batch of type {type(batch).__name__} is not a tensor: give "
                         "inputs=lambda batch: ... to rt.forward_backward.")
    return found


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


def check_settings(pp: int, schedule: str, microbatches: int | None, stages: Any, owner: str) -> tuple[str, int]:
    """The schedule's name and the number of micro-batches, refused before any process meets when wrong."""
    name = schedule_name(schedule)
    count = pp * stages_per_rank(name)
    micro = count if microbatches is None else microbatches
    if not isinstance(micro, int) or isinstance(micro, bool) or micro < 1:
        raise ConfigError(f"{owner}(pp_microbatches={microbatches!r}): a whole number of at least 1.")
    if stages is not None and len(stages) != count:
        raise ConfigError(f"{owner}(pp={pp}, pp_schedule={name!r}) runs {count} stages ({stages_per_rank(name)} per "
                          f"pipeline rank), but pp_stages gives {len(stages)}: give {count} lists of module names.")
    return name, micro


class PipelinedModule(WrappedModule):
    """What ``rt.setup`` returns under pipeline parallel: this rank's stages of the model (``state_dict``
    and checkpoints by the whole model's names). Training steps run through ``rt.forward_backward``;
    called with gradients off (evaluation, ``predict``), it runs its input through every stage, one
    after another, and every rank of the pipeline gets the last stage's output."""

    def __init__(self, pipeline: Pipeline, module: nn.Module, precision: Precision,
                 stand_in: Callable[[], dict[int, torch.Tensor]] | None = None, watchdog: Any = None) -> None:
        super().__init__(module, module, module, precision, stand_in, watchdog)
        self.__dict__["pipeline"] = pipeline

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled():
            raise UsageError("a model split into pipeline stages holds only some of its layers on each rank: run a "
                             "training step with rt.forward_backward(model, batch, loss_fn), not model(...) (which "
                             "runs under torch.no_grad(), for evaluation).")
        return super().forward(*args, **kwargs)

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
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


class Pipeline:
    """This rank's stages and the schedule that runs them. torch's stages size their send and receive
    buffers at the first step, and the data-parallel ranks of a stage share its collectives (FSDP's), so
    every step of every rank runs micro-batches of one shape: the first step's, agreed by all ranks."""

    def __init__(self, views: list[nn.Module], mine: list[int], num_stages: int, schedule: str, microbatches: int,
                 device: torch.device, group: Any, all_gather: Callable[[Any], list[Any]], precision: Precision,
                 outside_fsdp: bool) -> None:
        self.views, self.mine, self.num_stages = views, mine, num_stages
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
        """The step's loss, from the rank of the last stage to every rank of the pipeline."""
        value = (loss.detach().float() if loss is not None else torch.zeros((), device=self.device)).reshape(())
        self._move(value, self.holder[self.num_stages - 1], None)
        return value

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """The model's output on ``inputs`` (gradients off), every stage in turn, on every rank of the pipeline."""
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
        weighted = loss * step.factors[index]
        share = loss.detach() * step.shares[index]
        step.total = share if step.total is None else step.total + share
        return self._scale(weighted)
