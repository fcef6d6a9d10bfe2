"""``torch.compile`` in the right place: the repeated blocks, in place, before DDP or FSDP wrap them.

Compiling the DDP wrapper breaks the graph at DDP's hooks, and ``torch.compile(model)`` returns a
wrapper whose ``state_dict`` keys gain ``_orig_mod.``. Here each repeated block (the layers of a
transformer: children of one ``ModuleList``, ``Sequential`` or ``ModuleDict`` sharing a class of your own) is
compiled in place with ``nn.Module.compile``, so its keys stay as they were, DDP's gradient hooks
and FSDP's per-block all-gathers sit between compiled regions, and the block's code is compiled
once and reused by every layer (regional compilation: compile time of one block, not of the model).
A model without repeated blocks is compiled whole, in place (a module without a ``forward`` of its
own, as a Trainer's often is, by its children); so is one whose blocks of a class come in too many
layouts (shapes of their weights, their submodules): more than torch's recompile limit allows for
training and evaluation, as a ResNet's blocks do (8: four widths, a downsampling first block in each
stage), or more than half as many as the blocks (a graph per block reuses nothing): each layout compiles
the block's code again, and the code between the blocks would run eagerly.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

from torch import nn
from torch.nn.parameter import is_lazy

from lockstep.errors import UsageError
from lockstep.runtime._torch_compat import compiled_inner


def unwrap_compiled(module: nn.Module) -> tuple[nn.Module, bool]:
    """The module behind ``torch.compile(module)``'s wrapper, and whether there was one."""
    inner = compiled_inner(module)
    return (inner, True) if isinstance(inner, nn.Module) else (module, False)


def compile_options(value: bool | dict[str, Any] | None) -> dict[str, Any] | None:
    """``compile=`` as given to ``setup``: None (off), or the options for ``torch.compile``."""
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if isinstance(value, dict):
        return dict(value)
    raise UsageError(f"compile= takes True, False or a dict of torch.compile options (mode=, fullgraph=, "
                     f"dynamic=, backend=, regional=); got {type(value).__name__}.")


#: What holds a model's repeated blocks: a list of layers, or a dict of them (torchtitan's models keep
#: their layers in an ``nn.ModuleDict`` keyed "0", "1", ..., so that a pipeline stage keeps the names).
CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def repeated_blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The children of each ModuleList/Sequential/ModuleDict that holds two or more modules of one class
    of your own (not a torch.nn built-in such as Linear), by qualified name."""
    found: list[tuple[str, nn.Module]] = []
    for name, container in module.named_modules():
        if any(name.startswith(f"{outer}.") for outer, _ in found):
            continue  # inside a block already found: compiled with it
        if not isinstance(container, CONTAINERS) or len(container) < 2:
            continue
        children = list(container.named_children())
        classes = Counter(type(child) for _, child in children)
        (cls, count), = classes.most_common(1)
        if count >= 2 and len(classes) == 1 and not cls.__module__.startswith("torch."):
            found += [(f"{name}.{key}" if name else key, child) for key, child in children]
    return found


def layout(block: nn.Module) -> tuple[Any, ...]:
    """What a block's compiled graph depends on besides its input: its submodules' classes and its
    parameters' and buffers' shapes and dtypes (a lazy module's, not yet known: None)."""
    tensors = [*block.named_parameters(), *block.named_buffers()]
    return (tuple((name, type(sub)) for name, sub in block.named_modules()),
            tuple((name, None if is_lazy(tensor) else tuple(tensor.shape), tensor.dtype) for name, tensor in tensors))


def few_layouts(blocks: list[tuple[str, nn.Module]]) -> bool:
    """Whether the blocks of each class come in few enough layouts that regions pay: each layout's graph
    serves two blocks or more on average, and compiling the class's code once per layout, for training and
    again for evaluation, stays within torch's recompile limit (8: at most 4 layouts). One layout is the
    usual case (a transformer's layers); two, a model whose first layers are dense and the others mixtures
    of experts. A ResNet-50's 16 blocks come in 8 layouts, and 4 stages that each differ serve one each."""
    import torch._dynamo.config

    limit = getattr(torch._dynamo.config, "recompile_limit", None) or torch._dynamo.config.cache_size_limit
    by_class: defaultdict[type, list[nn.Module]] = defaultdict(list)
    for _, block in blocks:
        by_class[type(block)].append(block)
    return all(len({layout(block) for block in same}) <= min(limit // 2, len(same) // 2)
               for same in by_class.values())


def whole(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """What compiling ``module`` whole compiles: the module, where its class has a ``forward``; else (a
    Trainer's module whose steps call its submodules, a ModuleList) each child with parameters, so."""
    if type(module).forward is not nn.Module.forward:
        return [("", module)]
    found = [(f"{name}.{inner}" if inner else name, part)
             for name, child in module.named_children() if any(True for _ in child.parameters())
             for inner, part in whole(child)]
    return found or [("", module)]


def compile_in_place(module: nn.Module, options: dict[str, Any]) -> list[str]:
    """Compile ``module``'s repeated blocks, where they come in few layouts (or, with none, blocks of too many
    layouts, or ``regional=False``, the whole module) in place; returns what was compiled ("" for the whole
    module)."""
    options = dict(options)
    regional = options.pop("regional", True)
    blocks = repeated_blocks(module) if regional else []
    if not blocks or not few_layouts(blocks):
        blocks = whole(module)
    for _, block in blocks:
        block.compile(**options)
    return [name for name, _ in blocks]
