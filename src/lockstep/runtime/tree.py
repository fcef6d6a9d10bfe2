"""Map a function over the tensors inside nested data (dicts, lists, tuples, namedtuples)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch


def map_tensors(fn: Callable[[torch.Tensor], Any], data: Any) -> Any:
    """Return ``data`` with every tensor ``t`` replaced by ``fn(t)``; other leaves are kept."""
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, Mapping):
        return type(data)({k: map_tensors(fn, v) for k, v in data.items()})  # type: ignore[call-arg]
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # namedtuple
        return type(data)(*(map_tensors(fn, v) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(map_tensors(fn, v) for v in data)
    return data


def to_device(data: Any, device: torch.device, non_blocking: bool = False) -> Any:
    return map_tensors(lambda t: t.to(device, non_blocking=non_blocking), data)
