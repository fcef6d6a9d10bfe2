"""The Runtime's collectives: every rank must call them, in the same order. The transport (pytrees
of tensors and objects, the ordered gather) lives in ``comm/``; each call here is watched by the
Runtime's watchdog, so a rank that never arrives is named instead of hanging the others."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from lockstep.runtime.comm import collectives
from lockstep.runtime.parallel.wrappers import unwrap

if TYPE_CHECKING:
    from lockstep.runtime.data.loader import CurrentBatch, DistributedLoader
    from lockstep.runtime.faults.preemption import Preemption
    from lockstep.runtime.faults.watchdog import Watchdog


class CollectiveMethods:
    """Mixed into ``Runtime``: barrier, reductions, gathers, broadcasts and the agreed stop."""

    _watchdog: Watchdog
    _current: CurrentBatch
    preemption: Preemption | None

    if TYPE_CHECKING:  # given by Runtime
        @property
        def device(self) -> torch.device: ...
        @property
        def rank(self) -> int: ...
        @property
        def world_size(self) -> int: ...
        @property
        def data_parallel_rank(self) -> int: ...
        @property
        def tensor_parallel_size(self) -> int: ...
        @property
        def is_global_zero(self) -> bool: ...
        @property
        def is_local_zero(self) -> bool: ...

    def barrier(self) -> None:
        """Block until every rank arrives here."""
        with self._watchdog.watch("barrier"):
            collectives.barrier(self.device)

    def all_reduce(self, data: Any, op: str = "mean") -> Any:
        """Reduce the tensors and numbers in ``data`` (``sum``, ``mean``, ``max``, ``min``) over all ranks.

        Every rank gets the result.
        """
        with self._watchdog.watch(f"all_reduce({op})", data):
            return collectives.all_reduce(data, op, self.device)

    def all_gather(self, data: Any) -> list[Any]:
        """Every rank's ``data`` as a list indexed by rank, on every rank. Shapes may differ by rank."""
        with self._watchdog.watch("all_gather", data, exact_shapes=False):
            return collectives.all_gather(data, self.device)

    def gather(self, data: Any, loader: DistributedLoader | None = None, order: str = "dataset") -> Any:
        """Outputs of all ranks as one structure with one row per sample, in dataset order, on every rank.

        ``data`` holds this rank's outputs of one pass over a lockstep loader (``loader``, by default
        the loader whose pass started last), collected batch by batch: the loader knows
        which dataset index each row belongs to, so the rows come back sorted by it, whichever
        loader it was (training or evaluation, shuffled or not, any sampler). Outputs that do not
        match the samples the pass handed out on some rank raise an error naming the rank.
        ``order="rank"``, or no loader used yet: every rank's rows concatenated in rank order.

        Tensors concatenate along dim 0; a list of tensors is taken as chunks of rows (per-batch
        outputs) and joined first; a list of per-batch structures of tensors (dicts, ModelOutputs,
        namedtuples, dataclasses, tuples) is merged into one, each field joined; other lists
        concatenate; dicts and tuples are gathered per entry. A rank with no rows may pass ``[]``.
        On a mesh with tensor parallelism the ``tp`` peers hold the same rows: one copy is kept.
        """
        if order not in ("dataset", "rank"):
            raise ValueError(f"order={order!r}: use 'dataset' (the rows of a loader pass) or 'rank'.")
        source = (loader or self._current.last) if order == "dataset" else None
        indices = source.handed_out() if source is not None else None
        replica = self.rank != self.data_parallel_rank * self.tensor_parallel_size
        with self._watchdog.watch("gather", data, exact_shapes=False):
            return collectives.gather_rows(data, self.device, indices, replica=replica)

    def full_state_dict(self, model: nn.Module, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """The whole model's ``state_dict``, keyed as your module's own, as plain CPU tensors: shards
        (FSDP) are gathered, wrappers left out; buffers are rank 0's. For ``torch.save``,
        ``save_pretrained`` or an export. Every rank must call it. ``rank0_only=True``: rank 0 gets
        it and the other ranks an empty dict (one full copy in host memory, not one per rank).
        """
        module = unwrap(model)
        if self.world_size == 1:
            return {name: value.detach().cpu() for name, value in module.state_dict().items()}
        from lockstep.runtime.checkpoint.parts import full_state_dict

        self.sync_buffers(module)
        with self._watchdog.watch("full_state_dict"):
            return full_state_dict(module, rank0_only)

    def sync_buffers(self, model: nn.Module, src: int = 0) -> None:
        """Give every rank rank ``src``'s buffers of ``model`` (BatchNorm's running statistics, say).

        Each rank updates such statistics from its own share of the batch, so after training the
        ranks hold different ones (DDP hands rank 0's to all at the start of each training forward;
        FSDP never). Call it before evaluating, predicting or saving from every rank, so that all
        ranks compute with, and save, the same model. ``rt.save`` and the Trainer (before
        evaluation, prediction and checkpoints) call it for you. Every rank must call it.
        """
        buffers = [b for b in unwrap(model).buffers() if not b.is_meta]
        if buffers and self.world_size > 1:
            with self._watchdog.watch("sync_buffers"):
                collectives.broadcast_in_place(buffers, src)

    def broadcast(self, data: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``data`` on every rank."""
        with self._watchdog.watch(f"broadcast(src={src})"):
            return collectives.broadcast(data, src, self.device)

    def should_stop(self) -> bool:
        """True on every rank when any rank received the preemption signal (USR1 or TERM).

        Every rank must call it at the same points (e.g. each step boundary); it is one small
        all-reduce under SLURM and free elsewhere (always False). On True: save a checkpoint, call
        ``rt.requeue()``, and exit; the requeued job resumes from the checkpoint. A process that
        has never called it when the signal comes has 5 seconds to do so; after that the signal
        ends it as it would without lockstep.
        """
        if self.preemption is None:
            return False
        self.preemption.poll()
        return bool(self.all_reduce(self.preemption.local_flag, op="max"))

    def requeue(self) -> str:
        """After ``should_stop``: rank 0 requeues the SLURM job when USR1 came and the job script
        asked for it (``lockstep slurm --requeue``). Returns what happened."""
        return "not under SLURM" if self.preemption is None else self.preemption.requeue(self.rank)

    @contextlib.contextmanager
    def rank_zero_first(self, local: bool = False) -> Iterator[None]:
        """Rank 0 (``local=True``: each node's local rank 0) runs the block first; the others wait.

        For work such as downloading or preprocessing a dataset once. Every rank must enter it.
        """
        first = self.is_local_zero if local else self.is_global_zero
        if not first:
            self.barrier()
        yield
        if first:
            self.barrier()
