"""Tensor-parallel plans: which submodules split their weights over the ``tp`` ranks, and how.

A plan maps module-name patterns (``*`` stands for one name, such as a layer's index) to a style:
``"colwise"``, ``"rowwise"``, ``"colwise_gather_output"``, ``"embedding_rowwise"``,
``"sequence_parallel"`` (the names Hugging Face plans use), or a ``torch.distributed.tensor.parallel``
``ParallelStyle`` object. A Hugging Face model brings its own (``model._tp_plan``). A plan that does
not fit the model is refused before any weight moves, naming the module.
"""

from __future__ import annotations

import re
import traceback
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from lockstep.errors import ConfigError, UsageError

Plan = Mapping[str, Any] | Callable[[nn.Module, Any], Any]

_STYLE_NAMES = ("colwise", "rowwise", "colwise_gather_output", "colwise_rep", "embedding_rowwise", "sequence_parallel")


def _style(name: str) -> Any:
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if name == "colwise":
        return ColwiseParallel()
    if name == "rowwise":
        return RowwiseParallel()
    if name in ("colwise_gather_output", "colwise_rep"):
        return ColwiseParallel(output_layouts=Replicate())
    if name == "embedding_rowwise":
        return RowwiseParallel(input_layouts=Replicate())
    return SequenceParallel()


def layout_root(model: nn.Module) -> tuple[nn.Module, str]:
    """The module whose submodule names a tensor-parallel plan and ``pp_stages`` are written in, and its name
    in ``model``: ``model`` itself, or the submodule that its class names as ``layout_root`` (a wrapper of the
    user's model, the Trainer's, names the user's model, whose names the user writes)."""
    name = getattr(type(model), "layout_root", "")
    return (model.get_submodule(name), name) if name else (model, "")


def plan_of(module: nn.Module, plan: Plan | None, owner: str = "FSDP") -> Plan:
    """The plan given, else the ones the model's Hugging Face ``PreTrainedModel``s ship (``_tp_plan``),
    wherever they sit in it, their patterns prefixed with their place. ``owner``: the strategy that
    asked for tensor parallel, as the error names it."""
    module = layout_root(module)[0]
    if plan is not None:
        return plan
    shipped: dict[str, Any] = {}
    owners: list[str] = []
    for name, sub in module.named_modules():
        own = sub.__dict__.get("_tp_plan") or getattr(type(sub), "_tp_plan", None)
        if not isinstance(own, Mapping) or not own or any(name.startswith(f"{o}.") or not o for o in owners):
            continue
        owners.append(name)
        shipped.update({f"{name}.{pattern}" if name else pattern: style for pattern, style in own.items()})
    if shipped:
        return shipped
    raise ConfigError(
        f"{owner}(tp=...) needs a tensor-parallel plan, and {type(module).__name__} ships none: pass "
        f"{owner}(tp=2, tp_plan={{'layers.*.attn.q': 'colwise', 'layers.*.attn.out': 'rowwise', ...}}) or a "
        "function parallelize(model, tp_mesh).")


def apply_plan(module: nn.Module, tp_mesh: Any, plan: Plan, stage: bool = False) -> None:
    """Split ``module``'s weights over ``tp_mesh`` as ``plan`` says, after checking that it fits. ``stage``:
    ``module`` is a pipeline stage, whose other stages' modules hold no parameters and are left alone.
    Each split module is marked with its name and style, which ``explain_failure`` reports."""
    from torch.distributed.tensor import DTensor

    module = layout_root(module)[0]
    if callable(plan) and not isinstance(plan, Mapping):
        plan(module, tp_mesh)
        if not stage and not any(isinstance(p, DTensor) for p in module.parameters()):
            raise ConfigError(f"the tensor-parallel plan function {getattr(plan, '__name__', plan)!r} split no "
                              f"parameter of {type(module).__name__}: its names must be the model's own (torch only "
                              "warns and skips a name that resolves to no module), e.g. "
                              f"{[name for name, _ in module.named_modules() if name][:4]}.")
        styles = {}
    else:
        from torch.distributed.tensor.parallel import parallelize_module

        resolved = resolve_plan(module, plan, tp_mesh.size(), stage)
        tied = _tied_slots(module)
        parallelize_module(module, tp_mesh, resolved)
        _tie_again(module, tied)
        styles = {name: plan[matched] for name, matched in _patterns_of(resolved, plan).items()}
    for name, sub in module.named_modules():
        if any(isinstance(p, DTensor) for p in sub.parameters(recurse=False)):
            style = styles.get(name)
            shown = style if isinstance(style, str) else type(style).__name__ if style is not None else "your plan's"
            sub.__dict__[_SPLIT] = (name, shown, tp_mesh.size())


_SPLIT = "_lockstep_tp_split"  # on a split module: (its name, its style, tp), for explain_failure


def _tied_slots(module: nn.Module) -> list[list[tuple[str, str]]]:
    """The parameters that several places of ``module`` share (tied embeddings: the input embedding and the
    output head), as (module name, attribute) per place."""
    places: dict[int, list[tuple[str, str]]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        owner, _, attribute = name.rpartition(".")
        places.setdefault(id(param), []).append((owner, attribute))
    return [slots for slots in places.values() if len(slots) > 1]


def _tie_again(module: nn.Module, tied: list[list[tuple[str, str]]]) -> None:
    """torch's ``parallelize_module`` gives each split module a parameter of its own, untying shared weights
    (each would then train apart): tie them again where every place holds the same split (the embedding's
    rows and the head's output features, both sharded by vocabulary), else refuse."""
    for slots in tied:
        params = [getattr(module.get_submodule(owner), attribute) for owner, attribute in slots]
        layouts = {(tuple(getattr(p, "placements", ())), tuple(p.shape)) for p in params}
        if len(layouts) > 1:
            shown = ", ".join(f"{owner}.{attribute} {tuple(getattr(p, 'placements', ())) or 'not split'}"
                              for (owner, attribute), p in zip(slots, params, strict=True))
            raise ConfigError(f"the tensor-parallel plan splits a weight shared by several modules differently "
                              f"({shown}): each would train a copy of its own. Give them styles that split it "
                              "alike (an embedding's rows and a head's output features: 'rowwise' embedding, "
                              "'colwise' head), or untie them (tie_word_embeddings=False).")
        for owner, attribute in slots[1:]:
            setattr(module.get_submodule(owner), attribute, params[0])


def _matcher(pattern: str) -> re.Pattern[str]:
    """A plan pattern as a regular expression: ``*`` stands for one name (a layer's index)."""
    return re.compile(re.escape(pattern).replace(r"\*", r"[^.]+"))


def _patterns_of(resolved: Mapping[str, Any], plan: Mapping[str, Any]) -> dict[str, str]:
    """Each resolved module name → the plan's pattern that matched it."""
    regexes = {pattern: _matcher(pattern) for pattern in plan}
    return {name: next(p for p, regex in regexes.items() if regex.fullmatch(name)) for name in resolved}


def explain_failure(error: BaseException, model: nn.Module) -> ConfigError | None:
    """What a forward's ``error`` says about the tensor-parallel plan of ``model``, as an error that names the
    split module it happened in (DTensor's sharding failed there), or the split modules (a matrix product's
    widths that do not match, after them); None when ``model`` splits nothing over tp ranks, or the error is
    neither (out of memory, the model's own)."""
    if isinstance(error, torch.OutOfMemoryError):
        return None
    split = [sub.__dict__[_SPLIT] for sub in model.modules() if _SPLIT in sub.__dict__]
    if not split:
        return None
    frames = [frame for frame, _ in traceback.walk_tb(error.__traceback__)]
    inside = [frame.f_locals.get("self") for frame in frames]
    failed = [m.__dict__[_SPLIT] for m in inside if isinstance(m, nn.Module) and _SPLIT in m.__dict__]
    through_dtensor = any("distributed/tensor/" in frame.f_code.co_filename.replace("\\", "/") for frame in frames)
    if not (failed and through_dtensor) and "shapes cannot be multiplied" not in str(error):
        return None  # neither a split module's sharding nor a matrix product's widths: the model's own error
    first = (str(error).strip().splitlines() or [type(error).__name__])[0].rstrip(".")
    tp = split[0][2]
    where = (f"in module {failed[-1][0]!r} (style {failed[-1][1]})" if failed else
             "after the split modules " + ", ".join(f"{name!r} ({style})" for name, style, _ in split[:6])
             + (", ..." if len(split) > 6 else ""))
    return ConfigError(
        f"tensor parallel (tp={tp}): the forward failed {where}: {first}. The usual cause is the plan: a colwise "
        "module takes the whole input and leaves its output split along the last dimension (each rank holds "
        f"1/{tp} of it); a rowwise module takes exactly that split input and gives the whole output back. So each "
        "colwise module needs a rowwise one after it (before anything that needs the whole width), and a rowwise "
        "module needs a colwise one before it. See docs/parallelism.md (Tensor-parallel plans); torch's error is "
        "above.")


def resolve_plan(module: nn.Module, plan: Mapping[str, Any], tp: int, stage: bool = False) -> dict[str, Any]:
    """Module name → style object for every module a pattern matches; refuses a plan that does not fit.
    ``stage``: modules without parameters (another pipeline stage's) are not split."""
    from torch.distributed.tensor.parallel import ParallelStyle

    named = dict(module.named_modules())
    resolved: dict[str, Any] = {}
    matched_by: dict[str, str] = {}
    for pattern, style in plan.items():
        if isinstance(style, str) and style not in _STYLE_NAMES:
            raise ConfigError(f"tensor-parallel plan: {pattern!r} asks for style {style!r}, which lockstep does not "
                              f"know; use one of {', '.join(_STYLE_NAMES)}, or a ParallelStyle object.")
        if not isinstance(style, (str, ParallelStyle)):
            raise UsageError(f"tensor-parallel plan: {pattern!r} maps to a {type(style).__name__}; give a style name "
                             "or a ParallelStyle object.")
        regex = _matcher(pattern)
        names = [name for name in named if name and regex.fullmatch(name)]
        if not names:
            raise ConfigError(f"tensor-parallel plan: {pattern!r} matches no module of {type(module).__name__} "
                              f"(its modules include {_some_names(named)}).")
        for name in names:
            if stage and not any(True for _ in named[name].parameters()):
                continue
            if name in matched_by:
                raise ConfigError(f"tensor-parallel plan: module {name!r} is matched by both {matched_by[name]!r} "
                                  f"and {pattern!r}; give each module one style.")
            matched_by[name] = pattern
            obj = _style(style) if isinstance(style, str) else style
            _check_fits(name, named[name], obj, tp)
            resolved[name] = obj
    _check_heads(module, tp)
    return resolved


def _check_fits(name: str, module: nn.Module, style: Any, tp: int) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if not isinstance(style, (ColwiseParallel, RowwiseParallel)):
        return
    kind = "colwise" if isinstance(style, ColwiseParallel) else "rowwise"
    if isinstance(module, nn.Linear):
        size, what = (module.out_features, "out_features") if kind == "colwise" else (module.in_features, "in_features")
    elif isinstance(module, nn.Embedding):
        size, what = ((module.embedding_dim, "embedding_dim") if kind == "colwise"
                      else (module.num_embeddings, "num_embeddings"))
    else:
        raise ConfigError(f"tensor-parallel plan: {name!r} is a {type(module).__name__}; {kind} splits only "
                          "nn.Linear and nn.Embedding. Give it another style, or leave it out of the plan.")
    if size % tp:
        raise ConfigError(f"tensor-parallel plan: {name!r} ({type(module).__name__}) has {what}={size}, which "
                          f"{kind} cannot split into tp={tp} equal parts: choose a tp that divides {size}.")


def _check_heads(module: nn.Module, tp: int) -> None:
    """Attention heads are split whole: a Hugging Face config's head counts must divide by tp."""
    config = getattr(module, "config", None)
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, field, None)
        if isinstance(heads, int) and heads % tp:
            raise ConfigError(f"tensor parallel: the model's {field}={heads} does not divide by tp={tp}, so a head "
                              f"would be split between ranks: choose a tp that divides {heads}.")


def _some_names(named: dict[str, nn.Module]) -> str:
    names = [n for n in named if n]
    return ", ".join(repr(n) for n in names[:6]) + (", ..." if len(names) > 6 else "")


def sync_replicas(module: nn.Module, tp_mesh: Any) -> None:
    """Give the tensors that tensor parallelism does not split (norms, biases of the plan's outsiders,
    buffers) the values of the first rank of each tensor-parallel group, so that the peers agree."""
    import torch.distributed as dist

    from lockstep.runtime._torch_compat import to_local

    group = tp_mesh.get_group()
    source = dist.get_global_rank(group, 0)
    for tensor in [*module.parameters(), *module.buffers()]:
        mesh = getattr(tensor, "device_mesh", None)
        if mesh is not None and "tp" in (mesh.mesh_dim_names or ()):
            continue
        with torch.no_grad():
            dist.broadcast(to_local(tensor.data if isinstance(tensor, nn.Parameter) else tensor), source, group=group)
