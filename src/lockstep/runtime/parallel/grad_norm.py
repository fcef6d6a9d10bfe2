"""Gradient clipping by total norm, over gradients that live on different device meshes.

On a 2-D mesh the weights that tensor parallelism splits are DTensors over (data, tp) and the
others over data only; ``torch.nn.utils.clip_grad_norm_`` stacks their norms and refuses the mix.
Here each mesh's norm is computed whole (a collective over that mesh), the norms are combined,
and every rank scales its own shards by the one factor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
import torch.distributed as dist

from lockstep.runtime._torch_compat import foreach_mul_, full_tensor, to_local


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                   across: Callable[[torch.Tensor, float], torch.Tensor] | None = None) -> torch.Tensor:
    """Scale the gradients so that their total ``norm_type``-norm is at most ``max_norm``; returns the
    norm before clipping, a plain tensor equal on every rank. ``across``: the total over the ranks that
    hold other parameters of the model (pipeline stages) from this rank's norm."""
    params = [p for p in parameters if p.grad is not None]
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for param in params:
        by_mesh.setdefault(getattr(param.grad, "device_mesh", None), []).append(param.grad)  # type: ignore[arg-type]
    largest = math.isinf(norm_type) and norm_type > 0  # torch's infinity norm fails on a shard left empty
    if len(by_mesh) <= 1 and across is None and not largest:  # one mesh (or none): torch's own (DTensors too)
        return full_tensor(torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type))
    with torch.no_grad():
        norms = [_largest_entry(grads) if largest else full_tensor(torch.nn.utils.get_total_norm(grads, norm_type))
                 for grads in by_mesh.values()]
        device = norms[0].device if norms else torch.device("cpu")
        total = torch.nn.utils.get_total_norm([n.to(device) for n in norms], norm_type)
        if across is not None:
            total = across(total, norm_type)
        factor = (max_norm / (total + 1e-6)).clamp(max=1.0)
        local = [to_local(g) for grads in by_mesh.values() for g in grads]
        for key in {(g.device, g.dtype) for g in local}:
            same = [g for g in local if (g.device, g.dtype) == key]
            foreach_mul_(same, factor.to(device=key[0], dtype=key[1]))
    return total


def _largest_entry(grads: list[torch.Tensor]) -> torch.Tensor:
    """The infinity norm of gradients on one mesh: the largest magnitude of this rank's shards, then the
    largest over the mesh. A shard may be empty (a bias of fewer rows than the ranks that shard it), where
    torch's ``_foreach_norm`` refuses the infinity norm ("does not have an identity")."""
    local = [to_local(g) for g in grads]
    largest = torch.zeros((), dtype=torch.float32, device=local[0].device)
    for shard in local:
        if shard.numel():
            largest = torch.maximum(largest, shard.detach().abs().max().to(largest))
    mesh = getattr(grads[0], "device_mesh", None)
    if mesh is not None:  # every mesh dimension: a replicated dimension holds the same largest entry already
        for dim in range(mesh.ndim):
            dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=mesh.get_group(dim))
    return largest
