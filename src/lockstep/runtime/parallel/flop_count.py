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

import contextlib
from typing import Any

import torch

from lockstep.runtime._torch_compat import is_dtensor, pytree, raw_flop_formula, to_local


def _attention_formulas() -> dict[Any, Any]:
    """Attention counted as torch 2.13 counts it, on every torch: with grouped-query attention (fewer key
    and value heads than query heads, ``enable_gqa=True``) as if the key and value heads were repeated,
    which is what the kernels compute; torch 2.11's formulas refuse such shapes, which ended the training
    step. The CPU's flash attention, which torch's counter does not know, counts as the GPU kernels do."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count, shape_wrapper

    aten = torch.ops.aten

    def heads_of(shape: Any, query: Any) -> tuple[int, ...]:
        return (shape[0], query[1], *shape[2:])

    def forward(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
        return sdpa_flop_count(query, heads_of(key, query), heads_of(value, query))

    def backward(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
        return sdpa_backward_flop_count(grad_out, query, heads_of(key, query), heads_of(value, query))

    kernels = ("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
               "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    formulas = {}
    for name in kernels:
        if hasattr(aten, name) and hasattr(aten, name + "_backward"):
            formulas[getattr(aten, name)] = raw_flop_formula(shape_wrapper(forward))
            formulas[getattr(aten, name + "_backward")] = raw_flop_formula(shape_wrapper(backward))
    return formulas


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
    ``tp > 1`` (this rank's tensor-parallel degree), those its whole tp group spends on it; with ``cp > 1``
    (each rank holds a part of every row's sequence), those its cp ring spends on the rows.

    What runs in between runs eagerly (``torch.compiler.set_stance("force_eager")``): a compiled
    region first called under the counter's dispatch mode is never compiled after it, and ran eagerly
    for the rest of the run (so did every compiled Trainer fit that counted its MFU on the first batch)."""

    def __init__(self, tp: int = 1, cp: int = 1) -> None:
        from torch.utils.flop_counter import FlopCounterMode, flop_registry

        formulas = _attention_formulas()
        if tp > 1:  # every formula, torch's and ours, on the local shards
            formulas = {op: _on_local_shards(formula) for op, formula in {**flop_registry, **formulas}.items()}
        self.tp, self.cp = tp, cp
        self._mode: Any = FlopCounterMode(display=False, custom_mapping=formulas)
        self._active = contextlib.ExitStack()

    def start(self) -> None:
        self._active.enter_context(torch.compiler.set_stance("force_eager"))
        self._active.enter_context(self._mode)

    def stop(self) -> int:
        self._active.close()
        return int(self._mode.get_total_flops()) * self.tp * self.cp
