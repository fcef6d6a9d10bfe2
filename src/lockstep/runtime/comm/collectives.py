"""Collectives over nested data (tensors, numbers, dicts, lists, picklable objects).

Every function here must be called by every rank of the default group (or of the group it is given), in
the same order; each blocks until all ranks arrive (bounded by the group's timeout). Without a process
group, or with one rank, each is the identity.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lockstep.errors import ConfigError
from lockstep.runtime.tree import Spec, flatten, leaf_names, map_tensors, unflatten

REDUCE_OPS = ("sum", "mean", "max", "min")


def active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier(device: torch.device) -> None:
    if not active():
        return
    if device.type == "cuda":
        dist.barrier(device_ids=[device.index])
    else:
        dist.barrier()


def _reducible(value: Any) -> bool:
    return isinstance(value, (int, float, torch.Tensor)) or _numpy_scalar(value)


def _numpy_scalar(value: Any) -> bool:
    return type(value).__module__ == "numpy" and getattr(value, "shape", None) == () and hasattr(value, "item")


def keys_sorted(data: Any) -> Any:
    """``data`` with each plain dict's entries in the order of their keys (as strings): ranks that built the
    same dict in another order then line up leaf by leaf."""
    if type(data) is dict:
        return {key: keys_sorted(data[key]) for key in sorted(data, key=str)}
    if type(data) in (list, tuple):
        return type(data)(keys_sorted(item) for item in data)
    return data


def _shape(data: Any) -> str:
    """The structure of ``data``: its containers' kinds, keys and lengths (no value, no address)."""
    if isinstance(data, dict):
        return "{" + ", ".join(f"{key!r}: {_shape(value)}" for key, value in data.items()) + "}"
    if isinstance(data, (list, tuple)):
        return f"{type(data).__name__}[" + ", ".join(_shape(item) for item in data) + "]"
    return "*"


def _same_structure(data: Any, what: str, device: torch.device) -> None:
    """Every rank's ``data`` has the same structure (one small all-reduce, on the collectives' device); else
    a ConfigError showing each rank's."""
    text = _shape(data)
    code = int(hashlib.sha1(text.encode()).hexdigest()[:12], 16)
    check = torch.tensor([code, -code], dtype=torch.int64, device=device)
    dist.all_reduce(check, op=dist.ReduceOp.MAX)
    if check.tolist() != [code, -code]:
        shown = "; ".join(f"rank {r}: {t}" for r, t in enumerate(_all_gather_object(text)))
        raise ConfigError(f"{what}: the ranks passed data of different structures (dict keys, lengths), so their "
                          f"values cannot be matched one to one: {shown}. Give every rank the same keys.")


def all_reduce(data: Any, op: str, device: torch.device) -> Any:
    """Reduce every tensor and number in ``data`` across ranks; returns the same structure.

    Numbers come back as Python numbers; tensors keep their device and dtype, except that
    ``mean`` of integers gives floats. Other leaves (strings, None, ...) are kept as they are.
    """
    if op not in REDUCE_OPS:
        raise ConfigError(f"unknown reduce op {op!r}: use one of {', '.join(REDUCE_OPS)}.")
    if not active():
        return data
    dist_op = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM,
               "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
    size = dist.get_world_size()

    def reduce_tensor(tensor: torch.Tensor) -> torch.Tensor:
        work = tensor.detach().to(device)
        narrow = op in ("sum", "mean") and work.dtype in (torch.float16, torch.bfloat16)
        if op == "mean" and not (work.is_floating_point() or work.is_complex()):
            work = work.double()
        elif narrow:  # summed in float32: a mean of float16 values near its range does not overflow
            work = work.float()
        work = work.clone()
        dist.all_reduce(work, op=dist_op)
        if op == "mean":
            work = work / size
        return work.to(tensor.device, tensor.dtype if narrow else work.dtype)

    def reduce(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return reduce_tensor(value)
        number = value.item() if _numpy_scalar(value) else value  # a numpy scalar comes back as its own type
        dtype = torch.float64 if isinstance(number, float) or op == "mean" else torch.int64
        result = reduce_tensor(torch.tensor(int(number) if isinstance(number, bool) else number, dtype=dtype)).item()
        if isinstance(number, bool) and op in ("max", "min"):  # any / all
            result = bool(result)
        elif isinstance(number, bool) or op == "mean":  # a count of bools; a mean (a float)
            return result
        return type(value)(result) if _numpy_scalar(value) else result

    data = keys_sorted(data)
    leaves, spec = flatten(data)
    if not spec.is_leaf():
        _same_structure(data, "rt.all_reduce", device)
    return unflatten([reduce(leaf) if _reducible(leaf) else leaf for leaf in leaves], spec)


def broadcast(data: Any, src: int, device: torch.device) -> Any:
    """Rank ``src``'s ``data`` on every rank (pickled; tensors land on this rank's device)."""
    if not active():
        return data
    box = [data if dist.get_rank() == src else None]
    dist.broadcast_object_list(box, src=src, device=device if device.type == "cuda" else None)
    return map_tensors(lambda t: t.to(device), box[0])


def broadcast_in_place(tensors: list[torch.Tensor], src: int, group: Any = None) -> None:
    """Rank ``src``'s values into ``tensors`` on every rank (of ``group``; ``src`` a global rank), one
    broadcast per dtype and device (the ranks must hold tensors of the same shapes, in the same order: a
    module's buffers)."""
    if not active():
        return
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for same in groups.values():
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        dist.broadcast(flat, src=src, group=group)
        with torch.no_grad():
            for tensor, values in zip(same, flat.split([t.numel() for t in same]), strict=True):
                tensor.copy_(values.view_as(tensor))


def fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes taken as 64-bit words and summed (wrapping, so in any order and on any device the same):
    equal for equal bytes, and for two tensors that differ anywhere equal only by a chance of 2**-64 (what
    swapped words would leave alike, a model's two initialisations do not). Any dtype, layout or torch."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
    try:
        words = raw.view(torch.int64)
    except RuntimeError:  # a size or an offset that is not a whole number of words: a padded copy
        words = torch.cat([raw, raw.new_zeros(-raw.numel() % 8)]).view(torch.int64)
    return words.sum()


def agree_with_first(tensors: list[torch.Tensor], group: Any, device: torch.device, what: str,
                     readable: bool = True) -> bool:
    """Every rank of ``group`` given the first rank's values in ``tensors`` where any rank's differ (compared by
    their ``fingerprint``s, weighed by position); whether they differed. One all-gather of four numbers where
    they agree (a seeded or loaded model). Raises ConfigError, on every rank, where the ranks hold tensors of
    other shapes (``what``: the tensors' owner, for the message). ``device``: where the group's collectives
    run (a CPU-offloaded tensor travels through it). ``readable``: False where this rank's tensors hold no
    values yet (the meta device): their shapes are compared, and no values where any rank's are not."""
    if not active() or dist.get_world_size(group) < 2:
        return False
    shapes = hashlib.blake2b(repr([(tuple(t.shape), str(t.dtype)) for t in tensors]).encode(), digest_size=8)
    values = torch.zeros((), dtype=torch.int64, device=device)
    for position, tensor in enumerate(tensors if readable else []):  # wrapping sums: any order, any device
        values += fingerprint(tensor).to(device) * (2 * position + 1)
    layout = [len(tensors), sum(t.numel() for t in tensors), int.from_bytes(shapes.digest(), "little", signed=True),
              int(readable)]
    mine = torch.cat([torch.tensor(layout, dtype=torch.int64, device=device), values.reshape(1)])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    if any(not torch.equal(theirs[:3], everyone[0][:3]) for theirs in everyone):
        ranks = "; ".join(f"rank {dist.get_global_rank(group, index)}: {int(theirs[0])} tensors, {int(theirs[1])} "
                          "elements" for index, theirs in enumerate(everyone))
        raise ConfigError(f"{what} differs between the ranks in the number, shapes or dtypes of its parameters and "
                          f"buffers ({ranks}): every rank must build the same model (the same class and arguments; a "
                          "layer added on some ranks only, or a checkpoint of another shape loaded on one rank, "
                          "makes them differ).")
    if not all(int(theirs[3]) for theirs in everyone) or all(torch.equal(theirs, everyone[0]) for theirs in everyone):
        return False
    first = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in tensors:
            sent = tensor.detach().to(device).contiguous()
            dist.broadcast(sent, src=first, group=group)
            if sent.data_ptr() != tensor.data_ptr():
                tensor.copy_(sent)
    return True


@dataclass(frozen=True)
class _TensorSlot:
    """Where a tensor sits in data sent as a skeleton: its shape and dtype, not its values."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def _skeleton(leaves: list[Any]) -> list[Any]:
    return [_TensorSlot(tuple(leaf.shape), leaf.dtype) if isinstance(leaf, torch.Tensor) else leaf
            for leaf in leaves]


def _all_gather_object(obj: Any) -> list[Any]:
    boxes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(boxes, obj)
    return boxes


def gather_objects(obj: Any, to_rank0: bool) -> list[Any]:
    """Every rank's picklable ``obj`` in rank order: on rank 0 only (``to_rank0``; the others get ``[]``,
    so one rank holds them all) or on every rank."""
    if not active():
        return [obj]
    if not to_rank0:
        return _all_gather_object(obj)
    boxes: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, boxes, dst=0)
    return boxes or []


def all_gather(data: Any, device: torch.device) -> list[Any]:
    """Every rank's ``data``, as a list indexed by rank.

    Tensors may differ in shape across ranks (not in dtype or number of dimensions); they travel
    through tensor collectives, padded to the largest. Other leaves are pickled.
    """
    if not active():
        return [data]
    leaves, spec = flatten(data)
    # The structure travels as the data itself with slots for its tensors (a TreeSpec would be
    # pickled through a deprecated torch path); tensors follow through tensor collectives.
    everyone = [_slot_leaves(s) for s in _all_gather_object(unflatten(_skeleton(leaves), spec))]
    slots = [[i for i, leaf in enumerate(rank_leaves) if isinstance(leaf, _TensorSlot)] for rank_leaves, _ in everyone]
    if len({len(s) for s in slots}) != 1:
        raise ConfigError(
            "all_gather needs the same structure on every rank, but the ranks passed "
            + ", ".join(f"rank {r}: {len(s)} tensor(s)" for r, s in enumerate(slots))
        )
    results = [list(rank_leaves) for rank_leaves, _ in everyone]
    mine = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    for i, tensor in enumerate(mine):
        positions = [s[i] for s in slots]
        pieces = _gather_tensor(tensor, [results[r][p] for r, p in enumerate(positions)], device)
        for rank, (position, piece) in enumerate(zip(positions, pieces, strict=True)):
            results[rank][position] = piece
    return [unflatten(result, rank_spec) for result, (_, rank_spec) in zip(results, everyone, strict=True)]


def _slot_leaves(skeleton: Any) -> tuple[list[Any], Spec]:
    return flatten(skeleton, is_leaf=lambda node: isinstance(node, _TensorSlot))


def _gather_tensor(
    tensor: torch.Tensor, slots: list[_TensorSlot], device: torch.device
) -> list[torch.Tensor]:
    dtypes = {s.dtype for s in slots}
    if len(dtypes) != 1:
        raise ConfigError(
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


def _is_rows(node: Any) -> bool:
    """In ``gather``, a list holds rows (or chunks of rows): it is a leaf, not a container."""
    return isinstance(node, list)


def _reading(leaf: Any, sizes: list[int] | None) -> tuple[bool, bool, tuple[int, ...] | None] | None:
    """How this rank could read ``leaf``, a list of tensors or of lists in a loader's pass of batches of ``sizes``
    rows: (as one chunk per batch, as one row per sample, the rows' common shape: None for lists or where the
    shapes differ). None for anything else, and outside a pass."""
    if sizes is None or not isinstance(leaf, list) or not leaf:
        return None
    if all(isinstance(v, torch.Tensor) for v in leaf):
        lengths = [len(v) if v.dim() else -1 for v in leaf]
        shape = tuple(leaf[0].shape) if all(v.shape == leaf[0].shape for v in leaf) else None
    elif all(isinstance(v, list) for v in leaf):
        # a batch's list of its fields ([logits, labels]), each with the batch's rows, is not that batch's rows,
        # also where it holds as many fields as the batch has rows
        lengths, shape = [-1 if _field_rows(v) == len(v) else len(v) for v in leaf], None
    else:
        return None
    return lengths in (sizes, [n for n in sizes if n]), len(leaf) == sum(sizes), shape  # a batch of no rows: left out


def _field_rows(values: list[Any]) -> int | None:
    """The rows of each tensor of ``values`` where it is two or more tensors with as many rows each (a batch's
    fields, ``[logits, labels]``), else None. As many rows as fields: read as the batch's rows, the rows would be
    the fields' tensors."""
    if len(values) < 2 or not all(isinstance(v, torch.Tensor) and v.dim() for v in values):
        return None
    rows = len(values[0])
    return rows if all(len(v) == rows for v in values) else None


def _agreed(mine: list[Any], everyone: list[list[Any]]) -> list[str | None]:
    """One reading of each list for every rank (a rank's reading alone may differ from its peers': a rank
    whose batches hold one row each): "chunks" where every rank's list is one chunk per batch, else "stack"
    or "rows" where every rank's is one row per sample (stacked where all the rows share one shape)."""
    agreed: list[str | None] = []
    for i, reading in enumerate(mine):
        votes = [theirs[i] for theirs in everyone if len(theirs) == len(mine) and theirs[i] is not None]
        if reading is None:
            agreed.append(None)
        elif all(chunks for chunks, _, _ in votes):
            agreed.append("chunks")
        elif all(rows for _, rows, _ in votes):
            agreed.append("stack" if reading[2] is not None and all(v[2] == reading[2] for v in votes) else "rows")
        else:
            agreed.append(None)  # read as it is: its number of rows says what is wrong
    return agreed


def _joined(leaf: Any, reading: str | None, in_pass: bool) -> Any:
    """``leaf`` as rows: chunks joined (a list of tensors outside a loader's pass is taken as chunks, as
    always), per-sample tensors stacked, anything else as it is."""
    if not (isinstance(leaf, list) and leaf) or reading in ("rows", None) and in_pass:
        return leaf
    if reading == "stack":
        return torch.stack(leaf)
    if all(isinstance(v, torch.Tensor) for v in leaf):
        return torch.cat([v.reshape(1) if v.dim() == 0 else v for v in leaf])
    return [row for chunk in leaf for row in chunk] if in_pass else leaf  # one list of rows per batch (texts)


def merge_batches(data: Any, sizes: list[int] | None = None) -> Any:
    """A list of per-batch structures of tensors (dicts, ``ModelOutput``s, namedtuples, dataclasses,
    tuples) of one shape becomes one structure whose leaves are the lists of the batches' values (joined
    along dim 0 later, ``_joined``); in a loader's pass (``sizes``), a list in them is a batch's rows too
    (decoded texts). Anything else is returned as it is."""
    if not isinstance(data, list) or not data or any(isinstance(item, (torch.Tensor, list)) for item in data):
        return data
    flat = [flatten(item, is_leaf=_is_rows if sizes is not None else None) for item in data]
    spec, kinds = flat[0][1], (torch.Tensor, list) if sizes is not None else torch.Tensor
    if spec.num_leaves == 0 or not all(isinstance(leaf, kinds) for leaves, _ in flat for leaf in leaves):
        return data
    if any(item_spec != spec for _, item_spec in flat):
        return data
    return unflatten([[leaves[i] for leaves, _ in flat] for i in range(spec.num_leaves)], spec)


Handed = tuple[torch.Tensor, "torch.Tensor | None", list[int]]  # a loader pass's rows: indices, places, batch sizes


def gather_rows(data: Any, device: torch.device, handed: Handed | None = None, replica: bool = False) -> Any:
    """Concatenate every rank's rows in rank order (see ``Runtime.gather`` for the contract); with the rows a
    loader pass ``handed`` this rank (each one's dataset index), put the rows in dataset order, the rows of one
    index in the order of their places in the pass (the same on every rank: a sampler that draws an index
    twice). ``replica``: this rank's rows are a copy of another rank's (a tensor-parallel peer): it adds none."""
    indices, places, sizes = handed if handed is not None else (None, None, None)
    merged = merge_batches(keys_sorted(data), sizes)
    leaves, spec = flatten(merged, is_leaf=_is_rows)
    readings: list[Any] = [_reading(leaf, sizes) for leaf in leaves]
    if active():  # every rank must take the same path: all in dataset order, or none; each list read alike
        reports = _all_gather_object((indices is not None, readings))
        if len({ordered for ordered, _ in reports}) > 1:
            raise ConfigError("rt.gather: some ranks have a loader pass to order the rows by and others not ("
                              + ", ".join(f"rank {r}: {'yes' if o else 'no'}" for r, (o, _) in enumerate(reports))
                              + "). Every rank must iterate the same loaders; or pass order='rank'.")
        readings = _agreed(readings, [theirs for _, theirs in reports])
    else:
        readings = _agreed(readings, [readings])
    try:  # a failure here is this rank's alone: said on every rank below, before any collective of the rows
        leaves = [_joined(leaf, reading, sizes is not None) for leaf, reading in zip(leaves, readings, strict=True)]
        problem = _rows_problem(leaves, sizes, lambda: leaf_names(merged, _is_rows)) if sizes is not None else None
    except RuntimeError as error:  # torch.cat of chunks of other shapes
        problem = f"its outputs cannot be joined ({str(error).splitlines()[0]})"
    if replica and problem is None:
        leaves = [leaf[:0] if isinstance(leaf, list) or (isinstance(leaf, torch.Tensor) and leaf.dim()) else leaf
                  for leaf in leaves]
        indices = indices[:0] if indices is not None else None
        places = places[:0] if places is not None else None
    problems = _all_gather_object(problem) if active() else [problem]
    if any(problems):
        raise ConfigError("rt.gather cannot " + ("put these outputs in dataset order: " if sizes is not None else
                                                 "join these outputs: ")
                          + "; ".join(f"rank {r}: {p}" for r, p in enumerate(problems) if p)
                          + ". Collect one output row per sample of one loader pass, batch by batch, or "
                          "pass order='rank' for data that does not come from a loader.")
    result = _gather_leaves(leaves, spec, device) if active() else unflatten(leaves, spec)
    if indices is None:
        return result
    everyone = torch.cat(all_gather(indices.to(torch.int64), device)) if active() else indices
    if places is not None:  # by place first: the stable sort by index then keeps that order among equal indices
        by_place = torch.argsort(torch.cat(all_gather(places, device)) if active() else places, stable=True)
        order = by_place[torch.argsort(everyone[by_place], stable=True)]
    else:
        order = torch.argsort(everyone, stable=True)
    rows, spec = flatten(result, is_leaf=_is_rows)
    return unflatten([row[order] if isinstance(row, torch.Tensor) else [row[i] for i in order.tolist()]
                      for row in rows], spec)


def _rows_problem(leaves: list[Any], sizes: list[int], names: Callable[[], list[str]]) -> str | None:
    """Why the ``leaves`` are not one row per sample of batches of ``sizes`` rows each (None when they are), naming
    the first leaf that is not (``names``: where each leaf sits in the outputs)."""
    for index, leaf in enumerate(leaves):
        problem = _leaf_rows_problem(leaf, sizes)
        if problem is not None:
            name = names()[index]
            return problem if name == "the output" else f"{name}: {problem}"
    return None


def _leaf_rows_problem(leaf: Any, sizes: list[int]) -> str | None:
    """Why ``leaf`` is not one row per sample of batches of ``sizes`` rows each (None when it is)."""
    count = sum(sizes)
    if isinstance(leaf, torch.Tensor):
        rows = leaf.shape[0] if leaf.dim() else None
    else:
        rows = len(leaf) if isinstance(leaf, list) else None
    if rows is None:
        return f"an output of type {type(leaf).__name__} has no rows"
    if rows != count and isinstance(leaf, list) and leaf and all(isinstance(v, torch.Tensor) and not v.dim()
                                                                 for v in leaf):
        return (f"one number per batch ({rows} of them: a batch's loss, say), not one per sample ({count}): leave it "
                "out of what is gathered (all_reduce it), or give one value per row")
    if rows != count and isinstance(leaf, list) and leaf and all(isinstance(v, torch.Tensor) for v in leaf):
        return (f"an output is a list of {rows} tensors, neither one per batch of the loader's last pass "
                f"({len(sizes)} batches of {', '.join(map(str, sizes))} rows here) nor one per sample ({count})")
    if rows != count and isinstance(leaf, list) and leaf and all(isinstance(v, list) and _field_rows(v) is not None
                                                                 for v in leaf):
        return (f"an output is a list of {rows} lists of tensors, each a batch's fields ([logits, labels]), "
                f"not its rows: collect each batch's fields as a tuple or a dict, which are gathered field by "
                f"field")
    if rows != count:
        return f"an output holds {rows} rows, but the loader's last pass handed out {count} samples here"
    return None


class _Boxed:
    """Rows that hold tensors of their own shapes (one per sample, of varying lengths): sent whole, pickled
    from the CPU, as one leaf (a tensor collective needs as many tensors on every rank; the walker of nested
    data opens a dataclass, not this)."""

    def __init__(self, rows: list[Any]) -> None:
        self.rows = rows


def _box(leaf: Any) -> Any:
    if isinstance(leaf, list) and any(isinstance(row, torch.Tensor) for row in leaf):
        return _Boxed([map_tensors(lambda t: t.detach().cpu(), row) for row in leaf])
    return leaf


def _gather_leaves(leaves: list[Any], spec: Spec, device: torch.device) -> Any:
    home = next((row.device for leaf in leaves if isinstance(leaf, list) for row in leaf
                 if isinstance(row, torch.Tensor)), device)  # where boxed rows come back to
    leaves = [_box(leaf) for leaf in leaves]
    # Every rank's structure, tensors as slots: where this rank has no rows ([]), it takes the
    # others' structure (a whole one when it had no batches at all) with zero-row tensors.
    structures = _all_gather_object(unflatten([_Boxed([]) if isinstance(leaf, _Boxed) else leaf  # rows apart
                                               for leaf in _skeleton(leaves)], spec))
    if spec.is_leaf() and isinstance(leaves[0], list) and not leaves[0]:  # no batches: []
        other = next((s for s in structures if not (isinstance(s, list) and not s)), None)
        if other is not None:
            leaves, spec = flatten(other, is_leaf=_is_rows_or_slot)
            leaves = [[] if isinstance(leaf, (list, _Boxed)) else leaf for leaf in leaves]
    flat = [flatten(s, is_leaf=_is_rows_or_slot) for s in structures]
    shapes = {str(shape) for s, (_, shape) in zip(structures, flat, strict=True) if not (isinstance(s, list) and not s)}
    if len(shapes) > 1:
        raise ConfigError("rt.gather: the ranks' outputs have different structures (dict keys, lengths), so their "
                          f"rows cannot be joined: {sorted(shapes)}. Give every rank outputs of the same keys.")
    others = [leaves_of_rank for leaves_of_rank, _ in flat]
    leaves = [_fill_empty_rows(leaf, [o[i] if i < len(o) else None for o in others]) for i, leaf in enumerate(leaves)]
    per_rank = [flatten(d, is_leaf=_is_rows)[0] for d in all_gather(unflatten(leaves, spec), device)]
    joined = [_concat_ranks([rank_leaves[i] for rank_leaves in per_rank]) for i in range(len(leaves))]
    if any(isinstance(leaf, _Boxed) for rank_leaves in per_rank for leaf in rank_leaves):
        joined = [map_tensors(lambda t: t.to(home), leaf) if isinstance(leaf, list) else leaf for leaf in joined]
    return unflatten(joined, spec)


def _is_rows_or_slot(node: Any) -> bool:
    return _is_rows(node) or isinstance(node, _TensorSlot)


def _fill_empty_rows(leaf: Any, others: list[Any]) -> Any:
    """Where this rank holds ``[]`` (or a slot taken from another rank) and others hold a tensor: a
    0-row tensor of their shape and dtype."""
    if isinstance(leaf, _TensorSlot) or (isinstance(leaf, list) and not leaf):
        for other in [leaf, *others]:
            if isinstance(other, _TensorSlot):
                return torch.empty((0, *other.shape[1:]), dtype=other.dtype)
    return leaf


def _concat_ranks(per_rank: list[Any]) -> Any:
    per_rank = [leaf.rows if isinstance(leaf, _Boxed) else leaf for leaf in per_rank]
    first = per_rank[0]
    if isinstance(first, torch.Tensor):
        return torch.cat([t.reshape(1) if t.dim() == 0 else t for t in per_rank])
    if isinstance(first, list):
        return [row for rows in per_rank for row in rows]
    return list(per_rank)
