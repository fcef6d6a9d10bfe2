"""The one walker over nested data: torch's pytree, taught the containers batches come in.

Every collective, device move, batch-size count and debug signature flattens data here, so dicts,
lists, tuples, namedtuples, dataclasses and Mappings such as ``transformers``' ``BatchEncoding``
and ``ModelOutput`` behave the same everywhere.

``torch.utils._pytree`` knows dict, list, tuple, namedtuple, OrderedDict, defaultdict and deque,
and whatever libraries register (``transformers`` registers its ``ModelOutput`` classes). A
Mapping or dataclass type it does not know is registered the first time lockstep meets one: a
Mapping flattens to its values by key, a dataclass to its ``init`` fields. The registry is
torch's own (global), so such a type then also flattens the same way in torch's own tools.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from lockstep.runtime._torch_compat import pytree

Spec = pytree.TreeSpec

_LOCK = threading.Lock()


def _flatten_mapping(node: Mapping[Any, Any]) -> tuple[list[Any], Any]:
    keys = list(node.keys())
    return [node[key] for key in keys], (type(node), keys)


def _unflatten_mapping(values: Any, context: Any) -> Any:
    cls, keys = context
    items = dict(zip(keys, values, strict=True))
    # A dataclass that is a Mapping (transformers' ModelOutput) takes its fields as keywords.
    if isinstance(cls, type) and dataclasses.is_dataclass(cls):
        return cls(**items)
    try:
        return cls(items)
    except TypeError:  # a Mapping whose constructor takes no dict comes back as a plain dict
        return items


def _flatten_dataclass(node: Any) -> tuple[list[Any], Any]:
    names = [field.name for field in dataclasses.fields(node) if field.init]
    return [getattr(node, name) for name in names], (type(node), names)


def _unflatten_dataclass(values: Any, context: Any) -> Any:
    cls, names = context
    return cls(**dict(zip(names, values, strict=True)))


def _learn(cls: type) -> None:
    with _LOCK:
        if cls in pytree.SUPPORTED_NODES:
            return
        if issubclass(cls, Mapping):
            pytree.register_pytree_node(cls, _flatten_mapping, _unflatten_mapping)
        else:
            pytree.register_pytree_node(cls, _flatten_dataclass, _unflatten_dataclass)


def _known(node: Any) -> bool:
    """False for every node, so that it is walked; first registers a container pytree lacks.

    pytree asks this before it looks the node's type up, which is where an unknown type is learnt.
    """
    cls = type(node)
    namedtuple = issubclass(cls, tuple) and hasattr(cls, "_fields")  # pytree walks every namedtuple
    if cls not in pytree.SUPPORTED_NODES and not namedtuple:
        if isinstance(node, Mapping) or (dataclasses.is_dataclass(node) and not isinstance(node, type)):
            _learn(cls)
    return False


def _leaf_test(is_leaf: Callable[[Any], bool] | None) -> Callable[[Any], bool]:
    if is_leaf is None:
        return _known
    return lambda node: is_leaf(node) or _known(node)


def flatten(data: Any, is_leaf: Callable[[Any], bool] | None = None) -> tuple[list[Any], Spec]:
    """The leaves of ``data`` in a fixed order, and the structure to rebuild it with ``unflatten``.

    ``is_leaf`` stops the walk at the nodes it returns True for (they become leaves).
    """
    return pytree.tree_flatten(data, is_leaf=_leaf_test(is_leaf))


def leaf_names(data: Any, is_leaf: Callable[[Any], bool] | None = None) -> list[str]:
    """Where each leaf of ``flatten(data, is_leaf)`` sits in ``data`` (``['loss']``, ``.logits``, ``[0]``), to name
    it in a message; "the output" for a leaf that is ``data`` itself."""
    paths, _ = pytree.tree_flatten_with_path(data, is_leaf=_leaf_test(is_leaf))
    return [pytree.keystr(path) or "the output" for path, _ in paths]


def unflatten(leaves: list[Any], spec: Spec) -> Any:
    return pytree.tree_unflatten(leaves, spec)


def tensors(data: Any) -> Iterator[torch.Tensor]:
    """The tensors inside ``data``, in flatten order."""
    return (leaf for leaf in flatten(data)[0] if isinstance(leaf, torch.Tensor))


def first_tensor(data: Any) -> torch.Tensor | None:
    """The first tensor in ``data`` (a module's arguments or output: a tensor, a tuple, a dict, a ``ModelOutput``)."""
    return next(tensors(data), None)


def map_tensors(fn: Callable[[torch.Tensor], Any], data: Any) -> Any:
    """Return ``data`` with every tensor ``t`` replaced by ``fn(t)``; other leaves are kept."""
    leaves, spec = flatten(data)
    return unflatten([fn(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves], spec)


def to_device(data: Any, device: torch.device, non_blocking: bool = False) -> Any:
    return map_tensors(lambda t: t.to(device, non_blocking=non_blocking), data)


def batch_size_of(batch: Any) -> int:
    """The number of samples in a batch: dim 0 of its first tensor (1 for a scalar, 0 with none)."""
    for tensor in tensors(batch):
        size = int(tensor.shape[0]) if tensor.dim() else 1
        if size:
            return size
    return 0


def _is_row_list(node: Any) -> bool:
    return isinstance(node, list) and not any(isinstance(item, torch.Tensor) for item in node)


def empty_rows(batch: Any) -> Any:
    """``batch`` with zero rows: every tensor cut to ``[:0]``, every list of non-tensors emptied."""
    leaves, spec = flatten(batch, is_leaf=_is_row_list)
    return unflatten([leaf[:0] if isinstance(leaf, torch.Tensor) and leaf.dim() else
                      [] if _is_row_list(leaf) else leaf for leaf in leaves], spec)
