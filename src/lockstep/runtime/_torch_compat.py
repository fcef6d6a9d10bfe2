"""Every private torch API lockstep uses, and every torch version gate, in one place.

torch may change a private name in any release. Each one is used here only, with the public
alternative or why there is none, so that a new torch breaks this file and no other. lockstep is
tested with torch 2.13 and 2.14 (``pyproject.toml`` declares that range). This module imports no
heavy torch subsystem: FSDP, DTensor and DCP are looked up only when a caller already loaded them.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree  # noqa: F401 - re-exported below

# torch.utils._pytree: torch's own walker of nested containers, which torch.compile, DTensor and
# FSDP use. torch has no public pytree module (2.13, 2.14); ``optree`` is a separate package.
__all__ = ["DCP_METADATA_PRIVATE_NAMES", "compiled_inner", "constant_divisor", "dcp_metadata_name", "dcp_shard_pattern",
           "default_store", "foreach_mul_", "forget_unscale", "full_tensor", "hide_worker_info", "is_dtensor",
           "is_plain_random_sampler", "mark_wrapped_by_lr_scheduler", "profiler_enabled", "pytree", "raw_flop_formula",
           "set_default_timeout", "shutdown_workers", "stamp_load_id", "to_local", "use_file_system"]


def is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor, without importing DTensor: none exists before FSDP (or tensor
    parallel) loaded it. Public: ``isinstance(value, torch.distributed.tensor.DTensor)``, which
    costs every job DTensor's import (sympy included, about a second)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def constant_divisor(loss: torch.Tensor) -> float | None:
    """The number ``loss`` was last divided by (``x / 4``, ``x * 0.25``), when it was a Python number;
    else None. Reads the autograd node's saved operand (``grad_fn._saved_other``, the ``_saved_``
    attributes that torch's autograd notes describe); there is no public way to read it. A number
    wrapped by torch is a 0-dim CPU tensor: reading it waits for no device."""
    node = loss.grad_fn
    name = node.name() if node is not None else ""
    if name not in ("DivBackward0", "MulBackward0"):
        return None
    other = getattr(node, "_saved_other", None)
    if not isinstance(other, torch.Tensor) or other.dim() != 0 or other.device.type != "cpu" or other.requires_grad:
        return None
    value = float(other)
    if name == "MulBackward0":
        return 1.0 / value if 0.0 < value < 1.0 else None
    return value


def to_local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor; any other tensor as it is."""
    return tensor.to_local() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered whole on every rank (a collective); any other tensor as it is."""
    return tensor.full_tensor() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]


def foreach_mul_(tensors: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply every tensor in place by ``factor`` in one kernel per device and dtype.
    ``torch._foreach_mul_``: what torch's own optimizers and ``clip_grad_norm_`` use; no public name."""
    torch._foreach_mul_(tensors, factor)


def raw_flop_formula(formula: Any) -> Any:
    """Mark a FLOP formula for ``FlopCounterMode(custom_mapping=...)`` as one that takes the op's
    tensors, not their shapes. ``_get_raw`` is how the counter tells the two apart; the public
    ``register_flop_formula(get_raw=True)`` registers an op for every counter in the process, and
    refuses an op torch already registered."""
    formula._get_raw = True
    return formula


def compiled_inner(module: Any) -> Any:
    """The module inside ``torch.compile(module)``'s ``OptimizedModule``, or None. ``_orig_mod`` is
    the only way to it: torch offers no public accessor."""
    return getattr(module, "_orig_mod", None)


def mark_wrapped_by_lr_scheduler(original: Any, replacement: Any) -> None:
    """An LR scheduler made before ``rt.setup`` wrapped ``optimizer.step`` to count its calls, and
    marked the wrapper ``_wrapped_by_lr_sched``; a ``step`` that replaces it keeps the mark, or the
    scheduler warns that ``lr_scheduler.step()`` came before ``optimizer.step()``. No public API."""
    if getattr(original, "_wrapped_by_lr_sched", False):
        replacement._wrapped_by_lr_sched = True


def is_plain_random_sampler(sampler: Any) -> bool:
    """A ``RandomSampler`` that shuffles the whole dataset once per epoch (no replacement, no
    ``num_samples``, and no ``__iter__`` of a subclass's own, which may choose other samples): lockstep's own
    global shuffle replaces it. ``num_samples`` (public) returns the dataset's length when unset; only
    ``_num_samples`` tells whether it was set."""
    from torch.utils.data import RandomSampler

    return (isinstance(sampler, RandomSampler) and type(sampler).__iter__ is RandomSampler.__iter__
            and not sampler.replacement and sampler._num_samples is None)


def profiler_enabled() -> bool:
    """Whether a ``torch.profiler`` profile is recording (a C call). ``torch.autograd._profiler_enabled`` is
    what the DataLoader's iterator asks too; there is no public query."""
    return torch.autograd._profiler_enabled()


def shutdown_workers(batches: Any) -> None:
    """Stop a DataLoader iterator's workers now. ``_shutdown_workers`` is what the iterator's own
    ``__del__`` calls; there is no public way to stop persistent workers before garbage collection."""
    batches._shutdown_workers()


@contextlib.contextmanager
def hide_worker_info() -> Iterator[None]:
    """Make ``get_worker_info()`` return None inside the block, in a DataLoader worker: a stream that
    splits itself over the workers (Hugging Face's does) then yields the whole stream, which
    lockstep splits itself. The worker info is a private module global; no public setter exists."""
    from torch.utils.data._utils import worker

    saved = worker._worker_info
    worker._worker_info = None
    try:
        yield
    finally:
        worker._worker_info = saved


def default_store() -> Any:
    """The default process group's rendezvous store (for heartbeats beside the collectives).
    ``_get_default_store``: no public accessor in torch 2.13 or 2.14."""
    return dist.distributed_c10d._get_default_store()


def set_default_timeout(timeout: timedelta) -> None:
    """The default group's collective timeout: ``dist.set_timeout`` from torch 2.14 on; before it,
    the private ``_set_pg_timeout`` is the only way."""
    public = getattr(dist, "set_timeout", None)
    (public or dist.distributed_c10d._set_pg_timeout)(timeout)


# -- DCP's file layout and metadata (torch.distributed.checkpoint), for checksums and safe reading --
# DCP documents its folder as opaque. lockstep checksums each rank's files and reads ``.metadata``
# with a restricted unpickler, so it relies on these, none of them public in torch 2.13 or 2.14.

def dcp_shard_pattern(rank: int) -> str:
    """The names of the data files rank ``rank`` writes (``FileSystemWriter``: ``__{rank}_{n}.distcp``)."""
    return f"__{rank}_*"


def dcp_metadata_name(rank: int | None) -> str:
    """DCP's ``.metadata`` file, or the per-rank one it reads when ``rank`` is given (``__{rank}.metadata``)."""
    return ".metadata" if rank is None else f"__{rank}.metadata"


# Besides DCP's metadata classes, ``.metadata`` pickles these private names (2.13, 2.14).
DCP_METADATA_PRIVATE_NAMES = frozenset({
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
})


def use_file_system(writer: Any, file_system: Any) -> None:
    """Make DCP's ``FileSystemWriter`` write through ``file_system`` (a ``FileSystem`` subclass): its
    ``fs`` attribute, which no constructor argument sets."""
    writer.fs = file_system


def stamp_load_id(metadata: Any, load_id: Any) -> Any:
    """What ``FileSystemReader.read_metadata`` does to the metadata it read: its ``storage_meta``
    (made when absent) carries the reader's ``load_id``."""
    from torch.distributed.checkpoint.metadata import StorageMeta

    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = load_id
    return metadata


#: Set on an optimizer (its ``__dict__``) while DCP reads or writes its state: torch's state dict functions
#: create an empty state by calling ``optimizer.step()`` on zero gradients at lr 0
#: (``torch.distributed.checkpoint.state_dict._init_optim_state``; no public way to create it), which must
#: run as the optimizer's own step, not as a training step (no item count, no verify record, no commit).
DCP_STATE_INIT_STEP = "_lockstep_state_init_step"


def flatten_mesh(mesh: Any, name: str) -> Any:
    """``mesh``'s dimensions as one, named ``name``, kept in the root mesh (``DeviceMesh._flatten``; torch has no
    public spelling yet: torchtitan flattens its ``dp_shard × cp`` the same way)."""
    return mesh._flatten(name)


def ring_attention(group: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   scale: float | None) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
    """Causal attention over the ``group``'s ring, each rank holding the head-tail chunks of the sequence
    (dimension 2): the output, its log-sum-exp and what the kernel's backward needs besides, by torch's ring
    template (``torch.distributed.tensor.experimental._context_parallel._attention._templated_ring_attention``)
    over the device's SDPA flash kernel (CUDA's takes bf16 and fp16 only). The public alternative,
    ``context_parallel()``, shards named buffers and dispatches SDPA on DTensors; it refuses causal attention
    on the CPU."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    if not cp._cp_options.enable_load_balance:  # torch's own cp without a load balancer turns it off for good
        from lockstep.errors import ConfigError

        raise ConfigError("torch's context-parallel options have load balancing off (set by torch's own "
                           "context_parallel without a load balancer): lockstep's ring needs it on.")
    forward, _ = _ring_kernels(query.device.type)
    out, lse, *rest = cp._templated_ring_attention(group, 2, forward, query, key, value, is_causal=True,
                                                   dropout_p=0.0, scale=scale)
    return out, lse, rest


def ring_attention_backward(group: Any, grad_out: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, rest: list[Any],
                            scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of ``ring_attention``'s query, key and value (torch's ring template's backward; on CUDA
    with the flash kernel's bookkeeping from the forward, as torch's own ring handler passes it)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    _, backward = _ring_kernels(query.device.type)
    extra: dict[str, Any] = {}
    if query.device.type == "cuda":
        names = ("cum_seq_q", "cum_seq_k", "max_q", "max_k", "philox_seed", "philox_offset")
        extra = dict(zip(names, rest, strict=False))
    grads = cp._templated_ring_attention_backward(group, 2, backward, grad_out, "grad_out", query, key, value, out,
                                                  lse, is_causal=True, dropout_p=0.0, scale=scale, **extra)
    return grads[0], grads[1], grads[2]


def _ring_kernels(device_type: str) -> tuple[Any, Any]:
    """The SDPA flash kernel of ``device_type`` and its backward, as torch's ring template calls them."""
    aten = torch.ops.aten
    if device_type == "cpu":
        return (aten._scaled_dot_product_flash_attention_for_cpu,
                aten._scaled_dot_product_flash_attention_for_cpu_backward)
    return aten._scaled_dot_product_flash_attention, aten._scaled_dot_product_flash_attention_backward.default


def forget_unscale(scaler: Any, optimizer: torch.optim.Optimizer) -> None:
    """Make ``scaler`` (a GradScaler or FSDP's ShardedGradScaler) forget that it unscaled ``optimizer``'s
    gradients since its last ``update()``: they were dropped with a step not taken (fault tolerance), and
    the next step's must be unscaled again. GradScaler has no public call for it (``update()`` would move
    the scale, as if a step had been taken); its private ``_per_optimizer_states`` is a defaultdict that
    builds a fresh record for a missing optimizer (2.13, 2.14)."""
    scaler._per_optimizer_states.pop(id(optimizer), None)


def fsdp_unsynced_grads(model: Any) -> Iterator[torch.Tensor]:
    """The gradients FSDP2 keeps unsharded between backwards without gradient sync (``no_sync``: an
    accumulation's micro-steps), which no ``param.grad`` shows (private: ``FSDPParamGroup.fsdp_params``)."""
    for module in model.modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        group = getattr(state, "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", ()):
            kept = getattr(fsdp_param, "unsharded_accumulated_grad", None)
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            grad = kept if kept is not None else unsharded.grad if unsharded is not None else None
            if grad is not None:
                yield grad
