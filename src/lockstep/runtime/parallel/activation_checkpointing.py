"""Activation checkpointing: a block keeps (almost) none of its activations for the backward and
recomputes them there, trading compute for memory.

Applied in place to the model's repeated blocks (the layers FSDP shards and ``compile`` compiles,
``repeated_blocks``): each block's ``forward`` runs under ``torch.utils.checkpoint`` (non-reentrant),
so its parameter names, ``state_dict`` and checkpoints stay as they were, and DDP's and FSDP's hooks
around the block see it as before. A Hugging Face layer is switched with its own
``gradient_checkpointing`` flag, which also keeps the recompute from writing its KV cache twice. Modes:

- ``"full"``: keep only each block's inputs; recompute everything in the backward.
- ``"selective"``: keep the outputs of matrix products, attention and collectives (the costly ops);
  recompute the cheap rest (norms, activations, element-wise ops): most of the memory saved, a
  fraction of the recompute.
- a function ``(name, module) -> bool``: fully checkpoint the modules it picks, at any depth.

Gradients are those of the same model without it (the recompute runs the same kernels).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lockstep.errors import ConfigError, UsageError
from lockstep.runtime.parallel.compiling import repeated_blocks

Policy = str | Callable[[str, nn.Module], bool]

_MARK = "_lockstep_activation_checkpointing"


def checkpoint_activations(module: nn.Module, policy: Policy | None) -> list[str]:
    """Checkpoint ``module``'s blocks as ``policy`` says, in place; returns their names. Applying
    it again to the same blocks changes nothing."""
    if policy is None or policy is False:
        return []
    if isinstance(policy, str):
        if policy not in ("full", "selective"):
            raise ConfigError(f"activation_checkpointing={policy!r}: use 'full', 'selective', a function "
                              "(name, module) -> bool, or None.")
        chosen = repeated_blocks(module)
        if not chosen:
            raise ConfigError(
                f"activation_checkpointing={policy!r} found no repeated blocks in {type(module).__name__} (the "
                "children of a ModuleList, Sequential or ModuleDict that share a class of your own): pass a function "
                "(name, module) -> bool that picks the modules to checkpoint.")
        context = _selective_context if policy == "selective" else None
    elif callable(policy):
        chosen = [(name, m) for name, m in module.named_modules() if name and policy(name, m)]
        chosen = [(name, m) for name, m in chosen if not any(name.startswith(f"{o}.") for o, _ in chosen)]
        context = None
    else:
        raise UsageError("activation_checkpointing takes 'full', 'selective' or a function; got "
                         f"{type(policy).__name__}.")
    selective = context is not None
    for _, block in chosen:
        if hasattr(block, "gradient_checkpointing"):  # a Hugging Face layer: its own switch, which drops the KV cache
            from torch.utils.checkpoint import checkpoint

            options: dict[str, Any] = {"context_fn": _selective_context} if selective else {}
            block.__dict__["_gradient_checkpointing_func"] = functools.partial(checkpoint, use_reentrant=False,
                                                                               **options)
            block.__dict__["gradient_checkpointing"] = True
        elif not getattr(block, _MARK, False):
            run = _selectively_checkpointed_forward if selective else _checkpointed_forward
            block.forward = types.MethodType(functools.partial(run, type(block).forward), block)
            setattr(block, _MARK, True)
    return [name for name, _ in chosen]


# Two functions, not one with the context as an argument: torch.compile traces checkpoint() only
# with a context_fn it can see as a function, not one passed in as a value.
def _checkpointed_forward(forward: Callable[..., Any], self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():  # evaluation: nothing is kept anyway
        return forward(self, *args, **kwargs)
    from torch.utils.checkpoint import checkpoint

    return checkpoint(forward, self, *args, use_reentrant=False, **kwargs)


def _selectively_checkpointed_forward(forward: Callable[..., Any], self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    if not torch.is_grad_enabled():
        return forward(self, *args, **kwargs)
    from torch.utils.checkpoint import checkpoint

    return checkpoint(forward, self, *args, use_reentrant=False, context_fn=_selective_context, **kwargs)


def _selective_context() -> Any:
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    saved = _saved_ops()

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


@functools.cache
def _saved_ops() -> frozenset[Any]:
    """The ops whose outputs selective checkpointing keeps: products, attention, collectives."""
    aten = torch.ops.aten
    names = ["mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_scaled_dot_product_flash_attention",
             "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
             "_scaled_dot_product_flash_attention_for_cpu"]
    ops = {getattr(aten, name).default for name in names if hasattr(aten, name)}
    functional = getattr(torch.ops, "_c10d_functional", None)
    for name in ("reduce_scatter_tensor", "all_gather_into_tensor", "all_reduce"):
        if functional is not None and hasattr(functional, name):
            ops.add(getattr(functional, name).default)
    return frozenset(ops)
