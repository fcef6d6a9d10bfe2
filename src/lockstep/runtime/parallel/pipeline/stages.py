"""The cut: a model split into pipeline stages by layer (or by module names per stage), this rank's stages
kept, and torch's schedules by name with the stages each pipeline rank holds.

A stage is the whole model with the modules of the other stages replaced by ``Skipped`` (which hands its
first input on): the parameters a stage holds keep the names they have in the whole model, so its
checkpoints load on any other split, on any data-parallel degree and on one process. The cut is
automatic for a chain of repeated blocks (the embedding goes to the first stage; the norm and the head to
the last), or given as module names per stage.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lockstep.errors import ConfigError

# torch's schedules by name: those that run one stage per rank, and the interleaved ones (several per rank;
# the V-shaped ones hold stage r and 2·pp − 1 − r, the looped ones r, r + pp, ...).
SINGLE = ("GPipe", "1F1B")
LOOPED = ("Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")
SCHEDULES = SINGLE + LOOPED + V_SHAPED


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
                          f"block(s) ({name}): use at most {len(blocks)} stage(s) (a smaller pp, or a schedule with "
                          "one stage per rank).")
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
                raise ConfigError(f"pp_stages names {name!r}, which is no submodule of {type(model).__name__} (its "
                                  f"submodules include {[n for n in modules if n and '.' not in n][:6]}).")
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
