"""How ``rt.loader`` and ``rt.eval_loader`` are assembled: the caller's options, then the global
order of the samples, then this rank's sampler over it, then the ``DistributedLoader``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lockstep.errors import ConfigError
from lockstep.runtime.data.current import BatchObserver
from lockstep.runtime.data.loader import DistributedLoader
from lockstep.runtime.data.options import dataset_length, resolve_loader_options
from lockstep.runtime.data.order import (
    Arange,
    Batches,
    FixedBatches,
    FromSampler,
    IndexSequence,
    SamplerBatches,
    Shuffled,
)
from lockstep.runtime.data.samplers import GlobalBatchSampler, ShardSampler
from lockstep.runtime.data.streams import StreamBatches, is_stream, stream_length
from lockstep.runtime.parallel.mesh import Membership


@dataclass(frozen=True)
class Loaders:
    """Makes the loaders of one job's rank. ``membership``: this rank's place among the data-parallel
    replicas, read per batch by training loaders (evaluation loaders take it at creation);
    ``count_ranks`` sums a flag over the ranks (None on one process); ``say`` prints once for the
    job; ``equal_steps``: every rank gets as many evaluation batches as the rank with the most (a
    forward that is a collective, FSDP's)."""

    membership: Membership
    local_world_size: int
    device: torch.device
    seed: int
    observer: BatchObserver
    per_sample_rng: bool
    equal_steps: bool
    count_ranks: Callable[[bool], int] | None
    say: Callable[[str], None]
    gate: Callable[[DistributedLoader, int], int] | None = None  # fault tolerance: the step to draw
    evaluation_membership: Membership | None = None  # fault tolerance: the group's own ranks
    every_rank: Callable[[Any], list[Any]] | None = None  # a value of each rank (an all-gather; None: one rank)
    cut: Callable[[Any, Callable[[Any], Any]], Any] | None = None  # context parallel: this rank's part of a batch

    def training(self, data: Any, batch_size: int | None, options: dict[str, Any]) -> DistributedLoader:
        """``rt.loader``: each global batch of the order split over the ranks."""
        dataset, opts = resolve_loader_options(data, batch_size, options, self.local_world_size, self.device)
        shuffle, drop_last = bool(opts.pop("shuffle", False)), bool(opts.pop("drop_last", False))
        if not is_stream(dataset) and hasattr(dataset, "__len__"):  # first: the checks below then agree on every rank
            self._check_whole(len(dataset), type(dataset).__name__,
                              settings=f"batch_size={opts.get('batch_size')}, shuffle={shuffle}, drop_last={drop_last}")
        batches = global_batches(dataset, opts, shuffle, drop_last, self.seed)
        size, ranks = getattr(batches, "batch_size", None), self.membership.size
        if size is not None and size < ranks:
            raise ConfigError(f"global batch_size={size} is smaller than the {ranks} data-parallel ranks: some ranks "
                              f"would get no rows in every step. Give a batch_size of at least {ranks}.")
        if isinstance(batches, FixedBatches):
            self._check_size(len(batches.sequence), batches.batch_size, drop_last, type(dataset).__name__)
            self._check_every_rank_has_rows(batches)
        if self.gate is not None and isinstance(batches, StreamBatches):
            raise ConfigError(f"{type(dataset).__name__} is a stream: a fault-tolerant job draws a step again when "
                              "it does not commit, which a stream cannot do. Give a map-style dataset.")
        return self._loader(dataset, GlobalBatchSampler(batches, self.membership), opts, training=True)

    def evaluation(self, data: Any, batch_size: int | None, options: dict[str, Any]) -> DistributedLoader:
        """``rt.eval_loader``: rank ``r`` takes the ``r``-th contiguous shard (a stream: global batches in
        stream order, split over the ranks)."""
        members = self.evaluation_membership or self.membership
        rank, world_size = members.rank, members.size
        dataset, opts = resolve_loader_options(data, batch_size, options, self.local_world_size,
                                              self.device, evaluation=True)
        for unused in ("shuffle", "drop_last"):
            opts.pop(unused, None)
        if is_stream(dataset):
            batches = global_batches(dataset, opts, shuffle=False, drop_last=False, seed=self.seed)
            return self._loader(dataset, GlobalBatchSampler(batches, members), opts, training=False)
        samples = dataset_length(dataset)
        if self.evaluation_membership is None:  # every rank makes it (``if rank == 0:`` would see its shard alone)
            self._check_whole(samples, type(dataset).__name__, "evaluation", f"batch_size={opts.get('batch_size')}")
        per_rank = -(-opts.pop("batch_size") // world_size)  # a global batch the ranks do not divide: rounded up
        sampler = ShardSampler(samples, per_rank, rank, world_size, equal_steps=self.equal_steps)
        return self._loader(dataset, sampler, opts, training=False)

    def _check_size(self, samples: int, batch_size: int, drop_last: bool, name: str) -> None:
        """No epoch of a training loader may be empty; one shorter than a batch is said once."""
        if samples == 0:
            raise ConfigError(f"the training data ({name}) holds no samples: an epoch would train nothing. Check "
                              "the dataset's path, filter or split.")
        if batch_size > samples and drop_last:
            raise ConfigError(f"batch_size={batch_size} is larger than the training data ({samples} samples) and "
                              "drop_last=True drops the only batch: lower batch_size, or pass drop_last=False.")
        if batch_size > samples:
            self.say(f"lockstep: batch_size={batch_size} is larger than the training data ({samples} samples): "
                     f"each epoch is one step of {samples} samples.")

    def _check_every_rank_has_rows(self, batches: FixedBatches) -> None:
        """A global batch with fewer rows than data-parallel ranks would leave a rank without rows, which many
        models cannot run on (and a per-rank mean over no rows is no number): refused before the first step."""
        ranks = self.membership.size
        smallest = min(batches.size(len(batches) - 1), batches.batch_size) if len(batches) else ranks
        if smallest < ranks:
            samples = len(batches.sequence)
            raise ConfigError(f"the last global batch of each epoch holds {smallest} sample(s) ({samples} samples in "
                              f"batches of {batches.batch_size}), fewer than the {ranks} data-parallel "
                              "ranks: some ranks would get none. Pass drop_last=True, or a batch size that leaves "
                              f"at least {ranks} samples in the last batch.")

    def _check_whole(self, samples: int, name: str, stage: str = "training", settings: str = "") -> None:
        """Every rank was given the whole dataset: lockstep splits it itself. Data already split by rank
        (``files[rank::world_size]``, a per-rank reader) would be split again (half the data per epoch, or
        ranks that disagree on the number of steps): refused where the ranks' lengths differ; so are other
        ``settings`` (a batch size, shuffle), with which each rank would draw batches of another order. One
        small all-gather, so every rank must make the loader: an evaluation loader made under ``if rank == 0:``
        stops there (a hang report names it) instead of evaluating rank 0's shard alone."""
        everyone = self.every_rank((samples, settings)) if self.every_rank is not None else [(samples, settings)]
        lengths = [int(length) for length, _ in everyone]
        if len(set(lengths)) > 1:
            shown = ", ".join(f"rank {rank}: {length}" for rank, length in enumerate(lengths))
            raise ConfigError(f"the {stage} data ({name}) holds a different number of samples on each rank ({shown}): "
                              "lockstep splits the data over the ranks itself, so give every rank the whole dataset "
                              "(no files[rank::world_size] or per-rank reader).")
        if any(theirs != settings for _, theirs in everyone):
            shown = "; ".join(f"rank {rank}: {theirs}" for rank, (_, theirs) in enumerate(everyone))
            raise ConfigError(f"the {stage} loader was made with other settings on each rank ({shown}): each rank "
                              "would draw its rows from other global batches. Give every rank the same arguments.")

    def _loader(self, dataset: Any, sampler: GlobalBatchSampler | ShardSampler, opts: dict[str, Any],
                training: bool) -> DistributedLoader:
        return DistributedLoader(dataset, sampler, opts, self.device, self.seed, self.membership.rank, self.observer,
                                 per_sample_rng=self.per_sample_rng, count_ranks=self.count_ranks, training=training,
                                 gate=self.gate, cut=self.cut)


def global_batches(dataset: Any, opts: dict[str, Any], shuffle: bool, drop_last: bool, seed: int) -> Batches:
    """The global order of a training loader; takes ``batch_size``/``sampler``/``batch_sampler`` out of ``opts``."""
    batch_sampler, sampler = opts.pop("batch_sampler", None), opts.pop("sampler", None)
    batch_size = opts.pop("batch_size", None)
    if is_stream(dataset):
        if shuffle or sampler is not None or batch_sampler is not None:
            raise ConfigError(
                f"{type(dataset).__name__} is a stream (an IterableDataset): lockstep reads it in order and "
                "cuts it into global batches, so it takes no shuffle=True, sampler= or batch_sampler=. Shuffle "
                "inside the stream (a shuffle buffer seeded the same on every rank, e.g. datasets' "
                "IterableDataset.shuffle(seed=...)), or give a map-style dataset.")
        return StreamBatches(stream_length(dataset), batch_size, drop_last)
    if batch_sampler is not None:
        return SamplerBatches(batch_sampler, seed)
    sequence: IndexSequence
    if sampler is not None:
        sequence = FromSampler(sampler, seed)
    elif shuffle:
        sequence = Shuffled(dataset_length(dataset), seed)
    else:
        sequence = Arange(dataset_length(dataset))
    return FixedBatches(sequence, batch_size, drop_last)
