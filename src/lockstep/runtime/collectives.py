"""Collectives over nested data (tensors, numbers, dicts, lists, picklable objects).

Every function here must be called by every rank of the default group, in the same order; each
blocks until all ranks arrive (bounded by the group's timeout). Without a process group, or with
one rank, each is the identity.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lockstep.runtime.tree import map_tensors

REDUCE_OPS = ("sum", "mean", "max", "min")


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def barrier(device: torch.device) -> None:
    if not active():
        return
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def all_reduce(data: Any, op: str, device: torch.device) -> Any:
    """Reduce every tensor and number in ``data`` across ranks; returns the same structure.

    Numbers come back as Python numbers; tensors keep their device and dtype, except that
    ``mean`` of integers gives floats.
    """
    if op not in REDUCE_OPS:
        raise ValueError(f"unknown reduce op {op!r}: use one of {', '.join(REDUCE_OPS)}.")
    if not active():
        return data
    dist_op = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM,
               "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    size = dist.get_world_size()

    def reduce_tensor(tensor: torch.Tensor) -> torch.Tensor:
        work = tensor.detach().to(device)
        if op == "mean" and not work.is_floating_point():
            work = work.double()
        work = work.clone()
        dist.all_reduce(work, op=dist_op)
        if op == "mean":
            work = work / size
        return work.to(tensor.device)

    def reduce(value: Any) -> Any:
        if isinstance(value, bool) or not isinstance(value, (int, float, torch.Tensor)):
            if isinstance(value, Mapping):
                return type(value)({k: reduce(v) for k, v in value.items()})  # type: ignore[call-arg]
            if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
                return type(value)(reduce(v) for v in value)
            return value
        if isinstance(value, torch.Tensor):
            return reduce_tensor(value)
        dtype = torch.float64 if isinstance(value, float) or op == "mean" else torch.int64
        result = reduce_tensor(torch.tensor(value, dtype=dtype)).item()
        return result

    return reduce(data)


def broadcast(data: Any, src: int, device: torch.device) -> Any:
    """Rank ``src``'s ``data`` on every rank (pickled; tensors land on this rank's device)."""
    if not active():
        return data
    box = [data if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, device=device if device.type == "cuda" else None)
    return map_tensors(lambda t: t.to(device), box[0])


@dataclass(frozen=True)
class _TensorSlot:
    shape: tuple[int, ...]
    dtype: torch.dtype


def _flatten(data: Any) -> tuple[Any, list[torch.Tensor]]:
    tensors: list[torch.Tensor] = []

    def slot(tensor: torch.Tensor) -> _TensorSlot:
        tensors.append(tensor)
        return _TensorSlot(tuple(tensor.shape), tensor.dtype)

    return map_tensors(slot, data), tensors


def _unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    return _unflatten_from(skeleton, iter(tensors))


def _unflatten_from(skeleton: Any, feed: Any) -> Any:
    if isinstance(skeleton, _TensorSlot):
        return next(feed)
    if isinstance(skeleton, Mapping):
        return type(skeleton)({k: _unflatten_from(v, feed) for k, v in skeleton.items()})  # type: ignore[call-arg]
    if isinstance(skeleton, tuple) and hasattr(skeleton, "_fields"):
        return type(skeleton)(*(_unflatten_from(v, feed) for v in skeleton))
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(_unflatten_from(v, feed) for v in skeleton)
    return skeleton


def _all_gather_object(obj: Any) -> list[Any]:
    boxes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(boxes, obj)
    return boxes


def all_gather(data: Any, device: torch.device) -> list[Any]:
    """Every rank's ``data``, as a list indexed by rank.

    Tensors may differ in shape across ranks (not in dtype or number of dimensions); they travel
    through tensor collectives, padded to the largest. Other leaves are pickled.
    """
    if not active():
        return [data]
    skeleton, tensors = _flatten(data)
    skeletons = _all_gather_object(skeleton)
    counts = [len(_flatten_slots(s)) for s in skeletons]
    if len(set(counts)) != 1:
        raise ValueError(
            "all_gather needs the same structure on every rank, but the ranks passed "
            + ", ".join(f"rank {r}: {c} tensor(s)" for r, c in enumerate(counts))
        )
    per_rank_slots = [_flatten_slots(s) for s in skeletons]
    gathered: list[list[torch.Tensor]] = [[] for _ in skeletons]
    for i, tensor in enumerate(tensors):
        slots = [slots_of_rank[i] for slots_of_rank in per_rank_slots]
        for rank, piece in enumerate(_gather_tensor(tensor, slots, device)):
            gathered[rank].append(piece)
    return [_unflatten(s, g) for s, g in zip(skeletons, gathered, strict=True)]


def _flatten_slots(skeleton: Any) -> list[_TensorSlot]:
    slots: list[_TensorSlot] = []

    def walk(node: Any) -> None:
        if isinstance(node, _TensorSlot):
            slots.append(node)
        elif isinstance(node, Mapping):
            for value in node.values():
                walk(value)
        elif isinstance(node, (list, tuple)):
            for value in node:
                walk(value)

    walk(skeleton)
    return slots


def _gather_tensor(
    tensor: torch.Tensor, slots: list[_TensorSlot], device: torch.device
) -> list[torch.Tensor]:
    dtypes = {s.dtype for s in slots}
    if len(dtypes) != 1:
        raise ValueError(
            "tensors gathered together must share a dtype; the ranks passed "
            + ", ".join(f"rank {r}: {s.dtype}" for r, s in enumerate(slots))
        )
    numels = [int(torch.Size(s.shape).numel()) for s in slots]
    longest = max(numels)
    flat = torch.zeros(longest, dtype=tensor.dtype, device=device)
    flat[: tensor.numel()] = tensor.detach().reshape(-1).to(device)
    buffers = [torch.empty_like(flat) for _ in slots]
    dist.all_gather(buffers, flat)
    return [
        buffer[:numel].reshape(slot.shape).to(tensor.device)
        for buffer, numel, slot in zip(buffers, numels, slots, strict=True)
    ]


def gather_rows(data: Any, device: torch.device) -> Any:
    """Concatenate every rank's rows in rank order (see ``Runtime.gather`` for the contract)."""
    local = _join_chunks(data)
    if not active():
        return local
    skeletons = _all_gather_object(_flatten(local)[0])
    local = _fill_empty_rows(local, skeletons)
    return _concat_ranks(all_gather(local, device))


def _join_chunks(data: Any) -> Any:
    """A list of tensors is a sequence of chunks (e.g. per-batch outputs): join it into one."""
    if isinstance(data, list) and data and all(isinstance(v, torch.Tensor) for v in data):
        return torch.cat([v.reshape(1) if v.dim() == 0 else v for v in data])
    if isinstance(data, Mapping):
        return type(data)({k: _join_chunks(v) for k, v in data.items()})  # type: ignore[call-arg]
    if isinstance(data, tuple):
        joined = [_join_chunks(v) for v in data]
        return type(data)(*joined) if hasattr(data, "_fields") else tuple(joined)
    return data


def _fill_empty_rows(local: Any, skeletons: list[Any]) -> Any:
    """A rank with no rows holds ``[]`` where others hold a tensor: give it a 0-row tensor."""
    if isinstance(local, list) and not local:
        for other in skeletons:
            if isinstance(other, _TensorSlot):
                return torch.empty((0, *other.shape[1:]), dtype=other.dtype)
        return local
    if isinstance(local, Mapping):
        return type(local)(  # type: ignore[call-arg]
            {k: _fill_empty_rows(v, [s[k] if isinstance(s, Mapping) else None for s in skeletons])
             for k, v in local.items()}
        )
    if isinstance(local, tuple):
        filled = [
            _fill_empty_rows(v, [s[i] if isinstance(s, tuple) else None for s in skeletons])
            for i, v in enumerate(local)
        ]
        return type(local)(*filled) if hasattr(local, "_fields") else tuple(filled)
    return local


def _concat_ranks(per_rank: list[Any]) -> Any:
    first = per_rank[0]
    if isinstance(first, torch.Tensor):
        return torch.cat([t.reshape(1) if t.dim() == 0 else t for t in per_rank])
    if isinstance(first, Mapping):
        return type(first)({k: _concat_ranks([d[k] for d in per_rank]) for k in first})  # type: ignore[call-arg]
    if isinstance(first, tuple):
        joined = [_concat_ranks([t[i] for t in per_rank]) for i in range(len(first))]
        return type(first)(*joined) if hasattr(first, "_fields") else tuple(joined)
    if isinstance(first, list):
        return [row for rows in per_rank for row in rows]
    return list(per_rank)
