"""Context parallel: each training row's sequence cut over the ``cp`` ranks of a ring, causal attention run
as a ring over them (docs/parallelism.md, "Context parallel").

``SequenceCut`` cuts a training batch as the loader hands it out: its sequence dimension (dimension 1 of
every tensor of at least two dimensions whose length is the sequence's) into ``2 × cp`` chunks, rank ``i``
of the ring keeping chunks ``i`` and ``2 × cp - 1 - i``, which balances the work of causal attention.
A Hugging Face batch (a dict with ``input_ids``) also gets what a model needs to see the sequence as a
whole: ``position_ids`` (the positions of the rank's tokens in the row, for rotary embeddings),
``shift_labels`` (``labels`` shifted by one token over the whole row before the cut, which Hugging Face's
loss takes instead of shifting within the rank's part) and an ``attention_mask`` of ones (which tells
Hugging Face's mask builder that the cut positions are one sequence, not packed ones).

``RingAttention`` runs, for a training forward on a cut batch, every call of
``torch.nn.functional.scaled_dot_product_attention`` as torch's ring attention over the cp group: causal,
no mask, no dropout. Anything else is refused by name, as a full-attention answer on a part of the
sequence would be silently wrong. Evaluation batches are not cut: each cp rank runs the whole sequence.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from lockstep.errors import ConfigError, UsageError
from lockstep.runtime._torch_compat import ring_attention, ring_attention_backward
from lockstep.runtime.tree import map_tensors, tensors

IGNORE_INDEX = -100


class SequenceCut:
    """Rank ``rank`` of a ring of ``degree``: its head-tail part of each training batch's sequences."""

    def __init__(self, degree: int, rank: int) -> None:
        self.degree, self.rank = degree, rank
        self.length: int | None = None  # the current batch's whole sequence length (the ring's check)

    def __call__(self, batch: Any) -> Any:
        length = self._sequence_length(batch)
        chunks = 2 * self.degree
        if length % chunks:
            fit = -(-length // chunks) * chunks
            raise ConfigError(
                f"context parallel (cp={self.degree}) cuts each sequence into 2 × cp = {chunks} equal chunks, but "
                f"this batch's sequences hold {length} tokens: pad the rows to a multiple of {chunks} (e.g. "
                f"{fit}), with labels -100 on the padding and no attention mask.")
        self.length = length
        if isinstance(batch, Mapping) and "input_ids" in batch:
            batch = self._whole_sequence_inputs(batch, length)
        return map_tensors(lambda t: self.part(t) if t.dim() >= 2 and t.size(1) == length else t, batch)

    def part(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's chunks ``rank`` and ``2 × degree - 1 - rank`` of ``tensor``'s dimension 1."""
        pieces = tensor.chunk(2 * self.degree, dim=1)
        return torch.cat([pieces[self.rank], pieces[2 * self.degree - 1 - self.rank]], dim=1)

    @staticmethod
    def _sequence_length(batch: Any) -> int:
        found = batch.get("input_ids") if isinstance(batch, Mapping) else None
        if not isinstance(found, torch.Tensor):
            found = next((t for t in tensors(batch) if t.dim() >= 2), None)
        if found is None or found.dim() < 2:
            raise UsageError("context parallel cuts dimension 1 of a batch's tensors (rows × sequence × ...), but "
                             "this training batch holds no tensor of two dimensions or more.")
        return int(found.size(1))

    def _whole_sequence_inputs(self, batch: Mapping[str, Any], length: int) -> dict[str, Any]:
        """``position_ids``, ``shift_labels`` and a mask of ones, from the whole row (then cut with it)."""
        batch = dict(batch)
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor) and not bool(mask.all()):
            raise ConfigError(
                "context parallel runs causal attention without a mask, but this batch's attention_mask hides "
                "tokens (padding): pad the rows at the end, with labels -100 on the padding, and leave "
                "attention_mask out (under causal attention, padding at the end changes no earlier token's "
                "output).")
        positions = batch.get("position_ids")
        whole = torch.arange(length, device=ids.device).expand(ids.size(0), length)
        if isinstance(positions, torch.Tensor) and not torch.equal(positions.expand_as(whole), whole):
            raise ConfigError(
                "context parallel: this batch's position_ids restart within a row (packed sequences), which needs "
                "a mask the ring cannot run: give one sequence per row, or leave position_ids out.")
        batch["position_ids"] = whole
        batch["attention_mask"] = torch.ones_like(ids)
        labels = batch.get("labels")
        if isinstance(labels, torch.Tensor) and "shift_labels" not in batch:
            batch["shift_labels"] = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
        return batch


class _Ring(torch.autograd.Function):
    """Ring attention's forward and backward, each a pass around the ring."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: Any,
                scale: float | None) -> torch.Tensor:
        out, lse, rest = ring_attention(group, query, key, value, scale)
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.group, ctx.scale, ctx.rest = group, scale, rest
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Any, ...]:
        query, key, value, out, lse = ctx.saved_tensors
        grads = ring_attention_backward(ctx.group, grad_out.contiguous(), query, key, value, out, lse, ctx.rest,
                                        ctx.scale)
        return (*grads, None, None)


class RingAttention(TorchFunctionMode):
    """While active: ``scaled_dot_product_attention`` as the ring over ``group()`` (the cp ranks' process
    group, asked for at the first attention: the mesh is built by then), for the cut batch of ``cut``."""

    def __init__(self, group: Callable[[], Any], cut: SequenceCut) -> None:
        super().__init__()
        self.group, self.cut = group, cut

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return self.attention(*args, **kwargs)
        return func(*args, **kwargs)

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                  enable_gqa: bool = False) -> torch.Tensor:
        why = ("an attention mask" if attn_mask is not None else "dropout" if dropout_p else
               "attention that is not causal" if not is_causal else None)
        if why is not None:
            raise ConfigError(
                f"context parallel runs causal attention as a ring over the cp ranks; this model's attention asked "
                f"for {why} (scaled_dot_product_attention(attn_mask={'a tensor' if attn_mask is not None else None}"
                f", dropout_p={dropout_p}, is_causal={is_causal})). Give causal attention without a mask (no padding "
                "mask: pad at the end with labels -100) and attention dropout 0, or train without cp.")
        if query.device.type == "cuda" and query.dtype not in (torch.bfloat16, torch.float16):
            raise ConfigError(f"context parallel on CUDA runs the ring with the SDPA flash kernel, which takes "
                              f"bfloat16 or float16; this attention's inputs are {query.dtype}: train with "
                              "precision='bf16-mixed' (or 'bf16-true').")
        local = query.size(-2)
        if self.cut.length is None or local * self.cut.degree != self.cut.length:
            raise UsageError(
                f"context parallel: an attention over {local} positions in a training forward, but the batch the "
                f"training loader handed out holds {self.cut.length} per row, {self.cut.degree} ranks' parts: run "
                "the model on the batch as the loader handed it out (or under torch.no_grad(), unsplit).")
        if key.size(-3) != query.size(-3):  # grouped-query attention: each key head serves several query heads
            key = key.repeat_interleave(query.size(-3) // key.size(-3), dim=-3)
            value = value.repeat_interleave(query.size(-3) // value.size(-3), dim=-3)
        return _Ring.apply(query, key, value, self.group(), scale)


class ContextParallel:
    """A Runtime's context parallel: the training loaders' ``cut`` and the training forward's ``ring``."""

    def __init__(self, degree: int, rank: int, group: Callable[[], Any]) -> None:
        self.cut = SequenceCut(degree, rank)
        self._mode = RingAttention(group, self.cut)

    @contextlib.contextmanager
    def ring(self) -> Iterator[None]:
        with self._mode:
            yield
