"""Counting a model's FLOPs on this rank's batch, also when its layers are tensor parallel.

``torch.utils.flop_counter`` counts an op on DTensors at their global shapes, and an op on plain
tensors at theirs. Under tensor parallelism the two mix: a parallel Linear runs on DTensors, the
attention between them on this rank's heads as plain tensors. Counted as torch counts, a tp rank
would count the linear layers of its whole tp group and the attention of its own heads only. Here,
with ``tp > 1``, every op is counted at the shapes this rank computes (DTensors at their local
shards) and the total multiplied by ``tp``: the FLOPs the tp group spends on its batch, with the
work split evenly over the group, as tensor-parallel plans split it. Work a plan leaves replicated
on every tp rank is then counted ``tp`` times.
"""

from __future__ import annotations

from typing import Any

import torch

from lockstep.runtime._torch_compat import is_dtensor, pytree, raw_flop_formula, to_local


def _cpu_attention_formulas() -> dict[Any, Any]:
    """torch's counter knows the GPU attention kernels but not the CPU's flash attention, so
    scaled_dot_product_attention on the CPU would count as 0: count it as the GPU kernels are."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper

    aten = torch.ops.aten
    if not hasattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward"):
        return {}

    def forward(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
        return sdpa_flop_count(query, key, value)

    def backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
        return sdpa_backward_flop_count(grad_out, query, key, value)

    return {aten._scaled_dot_product_flash_attention_for_cpu: raw_flop_formula(shape_wrapper(forward)),
            aten._scaled_dot_product_flash_attention_for_cpu_backward: raw_flop_formula(shape_wrapper(backward))}


def _on_local_shards(formula: Any) -> Any:
    """``formula`` (which takes the op's tensors) applied to each DTensor's local shard."""
    def local(value: Any) -> Any:
        return to_local(value) if is_dtensor(value) else value

    def count(*args: Any, **kwargs: Any) -> int:
        with torch.no_grad():
            args, kwargs = pytree.tree_map(local, (args, kwargs))
        return formula(*args, **kwargs)

    return raw_flop_formula(count)


class FlopCount:
    """Counts the FLOPs of what runs between ``start`` and ``stop`` on this rank's batch; with
    ``tp > 1`` (this rank's tensor-parallel degree), those its whole tp group spends on it."""

    def __init__(self, tp: int = 1) -> None:
        from torch.utils.flop_counter import FlopCounterMode, flop_registry

        formulas = _cpu_attention_formulas()
        if tp > 1:  # every formula, torch's and ours, on the local shards
            formulas = {op: _on_local_shards(formula) for op, formula in {**flop_registry, **formulas}.items()}
        self.tp = tp
        self._mode: Any = FlopCounterMode(display=False, custom_mapping=formulas)

    def start(self) -> None:
        self._mode.__enter__()

    def stop(self) -> int:
        self._mode.__exit__(None, None, None)
        return int(self._mode.get_total_flops()) * self.tp
