"""Sharded data loading whose sample stream does not depend on the number of processes.

Training: one permutation per epoch (seeded by ``seed`` and the epoch); step ``s`` takes the
contiguous slice ``[s*B, (s+1)*B)`` of it as the global batch and splits it over the ranks, as
evenly as possible. Every rank has the same number of steps. Evaluation: rank ``r`` takes the
``r``-th contiguous shard of the dataset, so rank-ordered concatenation is dataset order.
"""

from __future__ import annotations

import itertools
import os
import random
import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    get_worker_info,
)

from lockstep.runtime.seed import mix_seed
from lockstep.runtime.tree import empty_rows, to_device

Key = tuple[int, int]  # (epoch, dataset index): the epoch lets workers re-seed per epoch

# The DataLoader's own generator only seeds its workers' base seed (lockstep re-seeds them per
# epoch). Its stream id keeps mix_seed(seed, rank, stream) apart from mix_seed(seed, epoch).
_WORKER_BASE_STREAM = 7
_END = object()


class BatchObserver(Protocol):
    """Told when a loader hands out batch ``step``, and when its pass ends (its last batch is then
    no longer current). A batch stays current until the next one replaces it: the window in which
    ``rt.backward`` applies its loss weight.
    """

    def batch_started(self, loader: DistributedLoader, step: int) -> None: ...
    def batch_ended(self, loader: DistributedLoader) -> None: ...


def split_evenly(total: int, parts: int, part: int) -> tuple[int, int]:
    """``[start, stop)`` of ``part`` when ``total`` items are cut into ``parts`` near-equal runs."""
    base, extra = divmod(total, parts)
    start = part * base + min(part, extra)
    return start, start + base + (1 if part < extra else 0)


def _seed_generators(seed: int, cpu_only: bool = False) -> None:
    """Seed torch, python and numpy; ``cpu_only`` leaves torch's accelerator generators alone (100x faster)."""
    if cpu_only:
        torch.default_generator.manual_seed(seed)
    else:
        torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % 2**32)
    except ImportError:
        pass


def _numpy_state() -> Any:
    try:
        import numpy as np
    except ImportError:
        return None
    return np.random.get_state()


def _set_numpy_state(state: Any) -> None:
    if state is not None:
        import numpy as np

        np.random.set_state(state)


class GlobalBatchSampler(Sampler[list[Key]]):
    """Yields this rank's share of each global batch (see the module docstring)."""

    def __init__(
        self, num_samples: int, batch_size: int, rank: int, world_size: int,
        shuffle: bool, seed: int, drop_last: bool,
    ) -> None:
        self.num_samples, self.batch_size = num_samples, batch_size
        self.rank, self.world_size = rank, world_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.epoch, self.start_step = 0, 0

    def steps_per_epoch(self) -> int:
        full, rest = divmod(self.num_samples, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def __len__(self) -> int:
        return self.steps_per_epoch() - self.start_step

    def global_size(self, step: int) -> int:
        return min(self.batch_size, self.num_samples - step * self.batch_size)

    def local_size(self, step: int) -> int:
        start, stop = split_evenly(self.global_size(step), self.world_size, self.rank)
        return stop - start

    def order(self) -> torch.Tensor:
        if not self.shuffle:
            return torch.arange(self.num_samples)
        generator = torch.Generator().manual_seed(mix_seed(self.seed, self.epoch))
        return torch.randperm(self.num_samples, generator=generator)

    def __iter__(self) -> Iterator[list[Key]]:
        order = self.order().tolist()
        for step in range(self.start_step, self.steps_per_epoch()):
            first = step * self.batch_size
            start, stop = split_evenly(self.global_size(step), self.world_size, self.rank)
            yield [(self.epoch, i) for i in order[first + start : first + stop]]


class ShardSampler(Sampler[list[Key]]):
    """Evaluation: this rank's contiguous shard, in batches of ``batch_size`` (per rank).

    ``equal_steps`` (for a forward that is a collective, FSDP's): every rank runs as many steps as
    the rank with the most; past its shard's end a rank's batches have zero rows (``local_size``
    0), made from the dataset's first sample (the loader cuts them to zero rows).
    """

    def __init__(self, num_samples: int, batch_size: int, rank: int, world_size: int,
                 equal_steps: bool = False) -> None:
        self.start, self.stop = split_evenly(num_samples, world_size, rank)
        self.batch_size = batch_size
        self.epoch, self.start_step = 0, 0
        longest = -(-(split_evenly(num_samples, world_size, 0)[1]) // batch_size)  # rank 0's shard is the largest
        self._steps = longest if equal_steps else -(-(self.stop - self.start) // self.batch_size)

    def steps_per_epoch(self) -> int:
        return self._steps

    def __len__(self) -> int:
        return self.steps_per_epoch() - self.start_step

    def local_size(self, step: int) -> int:
        return max(0, min(self.batch_size, self.stop - self.start - step * self.batch_size))

    def __iter__(self) -> Iterator[list[Key]]:
        for step in range(self.start_step, self.steps_per_epoch()):
            first = self.start + step * self.batch_size
            size = self.local_size(step)
            yield [(self.epoch, i) for i in range(first, first + size)] if size else [(self.epoch, 0)]


class EpochSeededDataset(Dataset[Any]):
    """Seeds the random generators that a dataset's ``__getitem__`` draws from (augmentations).

    Default: a DataLoader worker is re-seeded from (seed, rank, worker id, epoch) at its first item
    of an epoch, so augmentations differ across ranks, workers and epochs, repeat from run to run,
    and stay right with persistent workers; in the main process (``num_workers=0``) the global
    RNG, which checkpoints save, is left alone. The draws then depend on which rank and worker
    fetched a sample, hence on the world size.

    ``per_sample``: every item is fetched with torch's CPU generator, python's and numpy's seeded
    from (seed, epoch, dataset index) alone, so a sample's augmentation is the same on any number
    of processes and workers. In the main process the global generators are restored after each
    item (which costs more: numpy's state is slow to save).
    """

    def __init__(self, dataset: Any, seed: int, rank: int, per_sample: bool = False) -> None:
        self.dataset, self.seed, self.rank, self.per_sample = dataset, seed, rank, per_sample
        self._seeded_epoch: int | None = None

    def __len__(self) -> int:
        return len(self.dataset)

    def _reseed(self, epoch: int) -> None:
        info = get_worker_info()
        if info is None or epoch == self._seeded_epoch:
            return
        _seed_generators(mix_seed(self.seed, self.rank, info.id, epoch))
        self._seeded_epoch = epoch

    def _seeded_item(self, epoch: int, index: int) -> Any:
        seed = mix_seed(self.seed, -1, epoch, index)  # -1: apart from (seed, rank, worker, epoch)
        if get_worker_info() is not None:  # a worker's generators serve nothing else
            _seed_generators(seed, cpu_only=True)
            return self.dataset[index]
        saved = random.getstate(), _numpy_state()
        with torch.random.fork_rng(devices=[]):
            _seed_generators(seed, cpu_only=True)
            try:
                return self.dataset[index]
            finally:
                random.setstate(saved[0])
                _set_numpy_state(saved[1])

    def __getitem__(self, key: Key) -> Any:
        if self.per_sample:
            return self._seeded_item(*key)
        self._reseed(key[0])
        return self.dataset[key[1]]

    def __getitems__(self, keys: list[Key]) -> list[Any]:
        if not keys:
            return []
        if self.per_sample:  # item by item: each is seeded by its own index
            return [self._seeded_item(*key) for key in keys]
        self._reseed(keys[0][0])
        indices = [index for _, index in keys]
        if callable(getattr(self.dataset, "__getitems__", None)):
            return list(self.dataset.__getitems__(indices))
        return [self.dataset[i] for i in indices]


def default_num_workers(local_world_size: int) -> int:
    """Leave one CPU per process for the training loop; cap at 8 workers per process."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return max(0, min(8, cpus // max(1, local_world_size) - 1))


_KEPT_OPTIONS = ("collate_fn", "num_workers", "pin_memory", "timeout", "worker_init_fn",
                 "multiprocessing_context", "prefetch_factor", "persistent_workers", "drop_last")


def options_of(loader: DataLoader[Any]) -> tuple[Any, dict[str, Any]]:
    """The dataset, shuffle flag, batch size and options of an existing DataLoader, to re-create it."""
    if isinstance(loader.dataset, IterableDataset):
        raise ValueError(
            "lockstep cannot shard an IterableDataset: shard it yourself by rank inside __iter__, "
            "or give a map-style dataset (with __len__ and __getitem__)."
        )
    if not isinstance(loader.sampler, (RandomSampler, SequentialSampler)):
        raise ValueError(
            f"the DataLoader uses a custom sampler ({type(loader.sampler).__name__}), which "
            "lockstep cannot re-shard exactly: pass the dataset itself to rt.loader, or keep your "
            "own DataLoader with a DistributedSampler and do not pass it through rt.loader."
        )
    if loader.batch_size is None:
        raise ValueError("the DataLoader has no batch_size (custom batch_sampler): give batch_size.")
    options = {name: getattr(loader, name) for name in _KEPT_OPTIONS}
    if options["num_workers"] == 0:
        options.pop("prefetch_factor")
        options.pop("persistent_workers")
    options["shuffle"] = isinstance(loader.sampler, RandomSampler)
    options["batch_size"] = loader.batch_size
    return loader.dataset, options


class DistributedLoader:
    """Iterates this rank's batches, already on the device; each pass is the next epoch.

    ``wait_s`` adds up the seconds the loop waited for batches: a large share of the step time
    means the workers cannot keep up (raise ``num_workers``, make ``__getitem__`` cheaper).

    ``state_dict``/``load_state_dict`` save and restore the position (epoch, batches done), so a
    resumed run continues the same sample stream, also on a different number of processes.
    """

    def __init__(
        self, dataset: Any, sampler: GlobalBatchSampler | ShardSampler, options: dict[str, Any],
        device: torch.device, seed: int, rank: int, observer: BatchObserver | None = None,
        per_sample_rng: bool = False,
    ) -> None:
        self.dataset = dataset
        self.sampler = sampler
        self.device = device
        self._observer = observer
        self._epoch, self._batches_done, self._started = 0, 0, False
        self.wait_s = 0.0  # time spent waiting for batches (data loading not hidden behind compute)
        self._pending: tuple[int, int] | None = None  # a position loaded from a checkpoint
        self._non_blocking = bool(options.get("pin_memory")) and device.type == "cuda"
        self.loader: DataLoader[Any] = DataLoader(
            EpochSeededDataset(dataset, seed, rank, per_sample_rng),
            batch_sampler=sampler,
            generator=torch.Generator().manual_seed(mix_seed(seed, rank, _WORKER_BASE_STREAM)),
            **options,
        )

    def __len__(self) -> int:
        return self.sampler.steps_per_epoch()

    @property
    def epoch(self) -> int:
        """The epoch of the current (or last) pass."""
        return self._epoch

    @property
    def training(self) -> bool:
        """True for a training loader (global batches), False for an evaluation loader (shards)."""
        return isinstance(self.sampler, GlobalBatchSampler)

    def global_batch_size(self, step: int) -> int:
        """How many samples batch ``step`` holds over all ranks (less than batch_size when short).

        For an evaluation loader, this rank's share of the shard is all that is known: its size.
        """
        if isinstance(self.sampler, GlobalBatchSampler):
            return self.sampler.global_size(step)
        return self.local_batch_size(step)

    def local_batch_size(self, step: int) -> int:
        """How many samples of batch ``step`` this rank holds."""
        return self.sampler.local_size(step)

    def loss_weight(self, step: int) -> float:
        """What this rank's mean loss over batch ``step`` is multiplied by for the gradient of the
        global batch's mean loss, once DDP averages over the ranks (1.0 for evaluation batches)."""
        sampler = self.sampler
        if not isinstance(sampler, GlobalBatchSampler):
            return 1.0
        return sampler.local_size(step) * sampler.world_size / sampler.global_size(step)

    def __iter__(self) -> Iterator[Any]:
        if self._pending is not None:
            (epoch, start), self._pending = self._pending, None
        else:
            epoch, start = (self._epoch + 1 if self._started else 0), 0
        self._epoch, self._batches_done, self._started = epoch, start, True
        self.sampler.epoch, self.sampler.start_step = epoch, start
        observer, batches = self._observer, iter(self.loader)
        try:
            for step in itertools.count(start):
                waited = time.perf_counter()
                batch = next(batches, _END)
                self.wait_s += time.perf_counter() - waited
                if batch is _END:
                    return
                self._batches_done = step + 1
                if observer is not None:
                    observer.batch_started(self, step)
                if self.sampler.local_size(step) == 0:  # a padding step (FSDP evaluation): no rows
                    batch = empty_rows(batch)
                # The DataLoader hands out CPU tensors: on the CPU there is nothing to move.
                yield batch if self.device.type == "cpu" else to_device(batch, self.device, self._non_blocking)
        finally:  # the pass ended, or the loop was left (break, an exception): no batch is current
            if observer is not None:
                observer.batch_ended(self)

    def state_dict(self) -> dict[str, Any]:
        """The position: ``batches_done`` batches of epoch ``epoch`` have been handed out."""
        if self._pending is not None:
            epoch, done = self._pending
        else:
            epoch, done = self._epoch, self._batches_done
        return {"epoch": epoch, "batches_done": done,
                "batch_size": getattr(self.sampler, "batch_size", None)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``'s position at the next ``iter()``."""
        saved = state.get("batch_size")
        if isinstance(self.sampler, GlobalBatchSampler) and saved not in (None, self.sampler.batch_size):
            raise ValueError(
                f"the checkpoint was written with global batch_size={saved}, this loader has "
                f"{self.sampler.batch_size}: resume with the same global batch size."
            )
        epoch, done = int(state["epoch"]), int(state["batches_done"])
        if done >= self.sampler.steps_per_epoch():
            epoch, done = epoch + 1, 0
        self._pending = (epoch, done)


def check_batch_size(batch_size: int, world_size: int) -> int:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r}: give the global batch size, a positive integer.")
    if batch_size % world_size:
        lower = batch_size - batch_size % world_size
        suggestion = f"{lower} or {lower + world_size}" if lower else f"{world_size}"
        raise ValueError(
            f"global batch_size={batch_size} is not divisible by the world size {world_size}: "
            f"each rank takes batch_size/world_size samples per step. Use a multiple of "
            f"{world_size} (e.g. {suggestion})."
        )
    return batch_size


def resolve_loader_options(
    data: Any, batch_size: int | None, options: dict[str, Any], world_size: int, local_world_size: int,
    device: torch.device,
) -> tuple[Any, dict[str, Any]]:
    """The dataset and DataLoader options of a lockstep loader over ``data`` (a dataset, or a DataLoader
    re-created with its own options): ``options`` override, ``batch_size`` is the global batch, and
    workers, ``pin_memory`` and ``persistent_workers`` get lockstep's defaults where unset."""
    if isinstance(data, DataLoader):
        dataset, opts = options_of(data)
    else:
        dataset, opts = data, {}
        if batch_size is None:
            raise ValueError("give batch_size (the global batch size) with a dataset.")
    for chooser in ("sampler", "batch_sampler"):
        if chooser in options:
            raise ValueError(
                f"{chooser}= cannot be passed to rt.loader: lockstep chooses each global batch from a seeded "
                "permutation and splits it over the ranks. Pass shuffle=True/False, or keep your own "
                "DataLoader with that sampler and a DistributedSampler-style split, outside rt.loader."
            )
    opts.update(options)
    if batch_size is not None:
        opts["batch_size"] = batch_size
    check_batch_size(opts["batch_size"], world_size)
    if "num_workers" not in opts:
        opts["num_workers"] = default_num_workers(local_world_size)
    opts.setdefault("pin_memory", device.type == "cuda")
    if opts["num_workers"] > 0:
        opts.setdefault("persistent_workers", True)
    return dataset, opts


def dataset_length(dataset: Sequence[Any] | Dataset[Any]) -> int:
    if isinstance(dataset, IterableDataset):
        raise ValueError(
            f"{type(dataset).__name__} is an IterableDataset (a stream): rt.loader and the Trainer shard "
            "map-style datasets only. Give a dataset with __len__ and __getitem__, or keep your own "
            "DataLoader over the stream, shard it by rank inside __iter__, and loop over it yourself."
        )
    try:
        return len(dataset)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(
            f"{type(dataset).__name__} has no __len__: lockstep shards map-style datasets "
            "(with __len__ and __getitem__)."
        ) from None
