"""Context parallel: each training row's sequence cut over the ``cp`` ranks of a ring, causal attention run
as a ring over them (docs/parallelism.md, "Context parallel").

``SequenceCut`` cuts a training batch as the loader hands it out: dimension 1 of every tensor whose first
two dimensions are the batch's rows and sequence is cut into ``2 × cp`` chunks, rank ``i`` of the ring
keeping chunks ``i`` and ``2 × cp - 1 - i``, which balances the work of causal attention. A Hugging Face
batch (a dict with ``input_ids``) also gets what a model needs to see the sequence as a whole:
``position_ids`` (the positions of the rank's tokens in the row, for rotary embeddings), ``shift_labels``
(``labels`` shifted by one token over the whole row before the cut, which Hugging Face's loss takes instead
of shifting within the rank's part) and an ``attention_mask`` of ones (which tells Hugging Face's mask
builder that the cut positions are one sequence, not packed ones). The cut remembers the tensors it made
for its last few batches: a forward is on a cut batch when it is given one of them.

``RingAttention`` runs, for a forward on a cut batch, every call of
``torch.nn.functional.scaled_dot_product_attention`` as torch's ring attention over the cp group: causal,
no mask, no dropout. What it cannot run is refused by name, as a full-attention answer on a part of the
sequence would be silently wrong: other attention, a forward on a cut batch that runs no SDPA, models whose
attention or positions depend on more than this (a sliding window shorter than the sequence, rotary
scaling read from the largest position, gradient checkpointing, whose recompute runs outside the ring), and
a training forward on a batch that was not cut. Evaluation batches are not cut: each cp rank runs the whole
sequence.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from lockstep.errors import ConfigError, UsageError
from lockstep.runtime._torch_compat import ring_attention, ring_attention_backward
from lockstep.runtime.tree import map_tensors, tensors

IGNORE_INDEX = -100
KEPT_BATCHES = 4  # cut batches remembered: a forward on any of them runs as the ring


class SequenceCut:
    """Rank ``rank`` of a ring of ``degree``: its head-tail part of each training batch's sequences."""

    def __init__(self, degree: int, rank: int) -> None:
        self.degree, self.rank = degree, rank
        # each recent cut batch: the ids of the parts made, its whole sequence length, the parts (kept alive)
        self._recent: collections.deque[tuple[set[int], int, list[torch.Tensor]]] = collections.deque(
            maxlen=KEPT_BATCHES)

    def __call__(self, batch: Any, move: Callable[[Any], Any] = lambda batch: batch) -> Any:
        """This rank's part of ``batch``, then moved by ``move`` (to the device)."""
        rows, length = self._rows_and_length(batch)
        chunks = 2 * self.degree
        if length % chunks:
            fit = -(-length // chunks) * chunks
            raise ConfigError(
                f"context parallel (cp={self.degree}) cuts each sequence into 2 × cp = {chunks} equal chunks, but "
                f"this batch's sequences hold {length} tokens: pad the rows to a multiple of {chunks} (e.g. "
                f"{fit}), with labels -100 on the padding and no attention mask.")
        if isinstance(batch, Mapping):
            batch = self._whole_sequence_inputs(batch, rows, length)
        cut = move(map_tensors(lambda t: self.part(t) if t.dim() >= 2 and t.shape[:2] == (rows, length) else t,
                               batch))
        parts = [t for t in tensors(cut) if t.dim() >= 2 and t.shape[:2] == (rows, length // self.degree)]
        self._recent.append(({id(t) for t in parts}, length, parts))
        return cut

    def part(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's chunks ``rank`` and ``2 × degree - 1 - rank`` of ``tensor``'s dimension 1."""
        pieces = tensor.chunk(2 * self.degree, dim=1)
        return torch.cat([pieces[self.rank], pieces[2 * self.degree - 1 - self.rank]], dim=1)

    def length_of(self, given: Any) -> int | None:
        """The whole sequence length of the recent cut batch that ``given`` (a forward's arguments) holds a
        part of; None when it holds none."""
        ids = {id(t) for t in tensors(given)}
        for parts, length, _ in reversed(self._recent):
            if parts & ids:
                return length
        return None

    @staticmethod
    def _rows_and_length(batch: Any) -> tuple[int, int]:
        """The batch's rows and sequence length: ``input_ids``' in a dict, else those of the tensors of two or
        more dimensions, which must agree (else which dimension is the sequence cannot be told)."""
        found = batch.get("input_ids") if isinstance(batch, Mapping) else None
        candidates = [found] if isinstance(found, torch.Tensor) else [t for t in tensors(batch) if t.dim() >= 2]
        if not candidates or candidates[0].dim() < 2:
            raise UsageError("context parallel cuts dimension 1 of a batch's tensors (rows × sequence × ...), but "
                             "this training batch holds no tensor of two dimensions or more.")
        shapes = {tuple(t.shape[:2]) for t in candidates}
        if len(shapes) > 1:
            raise ConfigError(
                f"context parallel cuts each batch's sequence dimension (dimension 1), but this batch's tensors of "
                f"two or more dimensions disagree on it (rows × length: {sorted(shapes)}): give a dict batch with "
                "input_ids (its length is the sequence's), or make every such tensor rows × sequence × ....")
        rows, length = shapes.pop()
        return rows, length

    def _whole_sequence_inputs(self, batch: Mapping[str, Any], rows: int, length: int) -> dict[str, Any]:
        """``position_ids``, ``shift_labels`` and a mask of ones, from the whole row (then cut with it)."""
        batch = dict(batch)
        ids = batch.get("input_ids")
        if not isinstance(ids, torch.Tensor):
            if "inputs_embeds" in batch or "labels" in batch:
                raise ConfigError("context parallel gives a Hugging Face batch its whole rows' positions and "
                                  "shifted labels from input_ids; this batch has none: give input_ids.")
            return batch
        mask = batch.get("attention_mask")
        if isinstance(mask, torch.Tensor) and not bool(mask.all()):
            raise ConfigError(
                "context parallel runs causal attention without a mask, but this batch's attention_mask hides "
                "tokens (padding): pad the rows at the end, with labels -100 on the padding, and leave "
                "attention_mask out (under causal attention, padding at the end changes no earlier token's "
                "output).")
        positions = batch.get("position_ids")
        whole = torch.arange(length, device=ids.device).expand(rows, length)
        if isinstance(positions, torch.Tensor) and not torch.equal(positions.expand_as(whole), whole):
            raise ConfigError(
                "context parallel: this batch's position_ids restart within a row (packed sequences), which needs "
                "a mask the ring cannot run: give one sequence per row, or leave position_ids out.")
        batch["position_ids"] = whole
        batch["attention_mask"] = torch.ones_like(ids)
        labels = batch.get("labels")
        if labels is not None and not (isinstance(labels, torch.Tensor) and labels.shape[:2] == (rows, length)):
            shape = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
            raise ConfigError(f"context parallel trains on a label per token (labels of rows × sequence, {rows} × "
                              f"{length} here); this batch's labels are {shape}: a label per row (classification) "
                              "needs the whole sequence on each rank: train without cp.")
        if labels is not None and "shift_labels" not in batch:
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
    """While active: ``scaled_dot_product_attention`` as the ring over ``group`` (the cp ranks' process group),
    for a cut batch whose sequences hold ``length`` positions."""

    def __init__(self, group: Callable[[], Any], degree: int) -> None:
        super().__init__()
        self._group_of, self._group, self.degree = group, None, degree
        self.length = 0  # the whole sequence length of the batch the current forward runs on
        self.calls = 0  # attentions run as the ring in the current forward

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
        if local * self.degree != self.length or key.size(-2) != local:
            raise UsageError(
                f"context parallel: an attention over {local} query and {key.size(-2)} key positions in a forward on "
                f"a cut batch whose rows hold {self.length} positions, {self.length // self.degree} on this rank: "
                "attend over the batch's positions as the loader cut them.")
        if key.size(-3) != query.size(-3):  # grouped-query attention: each key head serves several query heads
            key = key.repeat_interleave(query.size(-3) // key.size(-3), dim=-3)
            value = value.repeat_interleave(query.size(-3) // value.size(-3), dim=-3)
        if self._group is None:  # asked for at the first attention: the mesh is built by then
            self._group = self._group_of()
        self.calls += 1
        return _Ring.apply(query, key, value, self._group, scale)


class ContextParallel:
    """A Runtime's context parallel: the training loaders' ``cut``, and what a forward runs in (``forward``)."""

    def __init__(self, degree: int, rank: int, group: Callable[[], Any]) -> None:
        self.cut = SequenceCut(degree, rank)
        self._mode = RingAttention(group, degree)
        self._windows: dict[int, int | None] = {}  # per model (its id): the shortest sliding window, checked

    def forward(self, module: nn.Module, given: Any, training: bool) -> contextlib.AbstractContextManager[None] | None:
        """The ring for a forward of ``module`` on ``given`` (its arguments) that holds a part of a cut batch;
        None for a forward on an uncut batch without gradients (evaluation, each rank the whole sequence)."""
        length = self.cut.length_of(given)
        if length is None:
            if training:
                raise UsageError(
                    "context parallel: a training forward on a batch that the training loader did not cut (each "
                    "rank holds its part of every row's sequence): run the model on the batch's tensors as the "
                    "loader handed them out, or evaluate under torch.no_grad() (each rank then runs the whole "
                    "sequence).")
            return None
        window = self._windows[id(module)] if id(module) in self._windows else self._checked(module)
        if window is not None and length > window:
            raise ConfigError(
                f"context parallel: this model's attention slides over a window of {window} positions, shorter than "
                f"the batch's {length}; the ring runs whole causal attention: train without cp, or with sequences "
                "no longer than the window.")
        return self._ring(length)

    @contextlib.contextmanager
    def _ring(self, length: int) -> Iterator[None]:
        """A forward on the cut batch; one that ran no SDPA attention is refused: its attention (eager, flex, a
        kernel of its own) saw only this rank's part of each sequence."""
        mode = self._mode
        mode.length, mode.calls = length, 0
        with mode:
            yield
        if not mode.calls:
            raise ConfigError(
                "context parallel: this forward on a cut batch ran no torch.nn.functional.scaled_dot_product_"
                "attention, so its attention saw only this rank's part of each sequence: use SDPA attention (a "
                "Hugging Face model: attn_implementation='sdpa'; a module of your own: F.scaled_dot_product_"
                "attention(q, k, v, is_causal=True)), or train without cp.")

    def _checked(self, module: nn.Module) -> int | None:
        """Refuse what the ring would silently get wrong in ``module``'s (Hugging Face) models; their shortest
        sliding window (None: none), kept for the next forwards."""
        windows = []
        for inner in module.modules():
            config = getattr(inner, "config", None)
            if getattr(inner, "is_gradient_checkpointing", False):
                raise ConfigError(f"context parallel: {type(inner).__name__} recomputes its layers in the backward "
                                  "(gradient checkpointing), outside the ring: disable gradient checkpointing, or "
                                  "train without cp.")
            if config is None or not hasattr(config, "_attn_implementation"):
                continue
            if config._attn_implementation not in (None, "sdpa"):
                raise ConfigError(f"context parallel runs SDPA attention as a ring; {type(inner).__name__} uses "
                                  f"attn_implementation={config._attn_implementation!r}: load it with "
                                  "attn_implementation='sdpa'.")
            rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
            kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, Mapping) else None
            if kind in ("dynamic", "longrope"):
                raise ConfigError(f"context parallel: {type(inner).__name__}'s rotary scaling {kind!r} is chosen "
                                  "from the largest position each rank sees, which differs between the cp ranks: "
                                  "train without cp, or with another rope_type.")
            window = getattr(config, "sliding_window", None)
            types = getattr(config, "layer_types", None)
            if isinstance(window, int) and (types is None or "sliding_attention" in types):
                windows.append(window)
        self._windows[id(module)] = min(windows) if windows else None
        return self._windows[id(module)]
