"""The options of a lockstep loader: a dataset (or a DataLoader's dataset and options), and the
DataLoader options with lockstep's defaults (workers, ``pin_memory``, persistent workers)."""

from __future__ import annotations

import operator
import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeGuard

import numpy as np
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    SequentialSampler,
    Subset,
    default_convert,
    get_worker_info,
)

from lockstep.errors import ConfigError
from lockstep.runtime._torch_compat import is_plain_random_sampler
from lockstep.runtime.faults.lifetime import DieWithParent


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
    """The dataset, batch size, sample choice and options of an existing DataLoader, to re-create it.

    Its sampler becomes ``shuffle`` (RandomSampler without replacement, SequentialSampler, or a
    DistributedSampler, whose split lockstep does itself), else ``sampler``; a custom batch sampler
    (``batch_sampler=``, or ``batch_size=None`` with a sampler of batches) becomes ``batch_sampler``.
    """
    options = {name: getattr(loader, name) for name in _KEPT_OPTIONS}
    if options["num_workers"] == 0:
        options.pop("prefetch_factor")
        options.pop("persistent_workers")
    if options["collate_fn"] is default_convert:  # batch_size=None's: lockstep collates the items of its batches
        options.pop("collate_fn")
    of_batches = isinstance(loader.sampler, BatchSampler)  # batch_size=None with a sampler of batches
    if (loader.batch_sampler is not None or of_batches) and loader.batch_size is None and \
            not isinstance(loader.dataset, IterableDataset):
        options["batch_sampler"] = loader.batch_sampler if loader.batch_sampler is not None else loader.sampler
        options.pop("drop_last")
        if of_batches and "collate_fn" in options:
            raise ConfigError("a DataLoader with batch_size=None and a sampler that yields batches hands "
                              "dataset[indices] to its collate_fn, and lockstep fetches a batch's items one by "
                              "one: give DataLoader(dataset, batch_sampler=...) and a collate_fn that takes a "
                              "list of items.")
        return loader.dataset, options
    options["batch_size"] = loader.batch_size
    sampler = loader.sampler
    if isinstance(loader.dataset, IterableDataset):  # a stream is read in order: no sampler to keep
        return loader.dataset, options
    if is_plain_random_sampler(sampler):
        options["shuffle"] = True
    elif _ordered_as_torchs(sampler, SequentialSampler):
        options["shuffle"] = False
    else:  # a DistributedSampler too: resolve_loader_options makes it shuffle (training) or drops it (evaluation)
        options["sampler"] = sampler
    return loader.dataset, options


def evaluated_samples(dataset: Any, sampler: Any, batch_sampler: Any) -> Any:
    """The samples an evaluation DataLoader chose (its sampler, or its batch sampler's), each once, as the
    dataset an evaluation loader takes in order: all of them for a sampler that orders them
    (``SequentialSampler`` and ``RandomSampler`` with torch's own ``__iter__``, ``DistributedSampler`` and its
    subclasses: an evaluation split over the ranks, which lockstep's replaces);
    ``Subset(dataset, sampler.indices)`` for a subset's sampler (``SubsetRandomSampler``); anything else,
    which could choose, repeat or weigh samples, is refused by name rather than dropped."""
    if isinstance(batch_sampler, BatchSampler):
        sampler, batch_sampler = batch_sampler.sampler, None
    chooser = batch_sampler if batch_sampler is not None else sampler
    if chooser is None or isinstance(chooser, DistributedSampler) or _ordered_as_torchs(chooser, SequentialSampler) \
            or is_plain_random_sampler(chooser):
        return dataset  # every sample once (a DistributedSampler of any kind: over the ranks)
    indices = getattr(chooser, "indices", None) if batch_sampler is None else None
    if isinstance(indices, (Sequence, torch.Tensor, np.ndarray)) and not isinstance(indices, (str, bytes)):
        return Subset(dataset, [_index(i) for i in indices])  # the subset, in the order its indices are listed
    raise ConfigError(f"the evaluation DataLoader's {'batch sampler' if batch_sampler is not None else 'sampler'} "
                      f"({type(chooser).__name__}) chooses which samples to take, and an evaluation loader takes "
                      "every sample of its dataset once, in dataset order: give Subset(dataset, indices) for part "
                      "of it, or the dataset itself.")


def _index(value: Any) -> int:
    """One index of a subset's sampler: an int (numpy's, a tensor's element); else refused by name."""
    try:
        return operator.index(value)
    except TypeError:
        raise ConfigError(f"the evaluation DataLoader's sampler lists {value!r} among its indices: give dataset "
                          "indices (ints).") from None


def _ordered_as_torchs(sampler: Any, kind: type) -> bool:
    """A ``kind`` whose order is torch's own: a subclass with an ``__iter__`` of its own may choose, repeat or
    leave out samples, and is kept as the sampler it is (or refused where that cannot be)."""
    return isinstance(sampler, kind) and getattr(type(sampler), "__iter__", None) is getattr(kind, "__iter__", None)


def plain_distributed(sampler: Any) -> TypeGuard[DistributedSampler[Any]]:
    """A ``DistributedSampler`` (a DataLoader written for plain DDP): lockstep does its split, and keeps its
    ``shuffle``. A subclass with an ``__iter__`` of its own, which chooses this rank's samples its own way,
    is refused: lockstep splits a global order, which such a sampler does not give."""
    if not isinstance(sampler, DistributedSampler):
        return False
    if not _ordered_as_torchs(sampler, DistributedSampler):
        raise ConfigError(f"{type(sampler).__name__} is a DistributedSampler with its own __iter__: it chooses each "
                          "rank's samples itself, and lockstep splits one global order over the ranks. Give a sampler "
                          "of the global order (every rank's samples, e.g. WeightedRandomSampler) as sampler=.")
    return True


def _not_per_rank(batch_sampler: Any) -> None:
    """A batch sampler over a ``DistributedSampler`` of several replicas (a plain DDP script's) yields this
    rank's batches, and lockstep would split each again: refused, as every rank would train on part of its own."""
    inner = getattr(batch_sampler, "sampler", None)
    if isinstance(inner, DistributedSampler) and inner.num_replicas > 1:
        raise ConfigError(f"this batch_sampler ({type(batch_sampler).__name__}) draws from a DistributedSampler of "
                          f"{inner.num_replicas} replicas, which gives each rank its own samples; lockstep splits "
                          "each global batch over the ranks itself. Give it a sampler of the whole dataset "
                          "(BatchSampler(RandomSampler(dataset), global_batch, drop_last)), or pass "
                          "batch_size= (the global batch) and shuffle= instead.")


def _say_per_rank_batch(given: int | None, batch_size: int | None, replicas: int) -> None:
    """A torchrun script's DataLoader given as it is (no ``batch_size`` given to the call): its ``batch_size`` was
    each rank's, lockstep's is global."""
    if given is None and replicas > 1:
        warnings.warn(f"lockstep: this DataLoader's batch_size={batch_size} is taken as the global batch, split over "
                      f"the ranks; with its DistributedSampler of {replicas} replicas it was each rank's. For the same "
                      f"steps, pass batch_size={(batch_size or 1) * replicas} to rt.loader (the global batch).",
                      stacklevel=5)


def check_batch_size(batch_size: int) -> int:
    """A global batch size: any positive integer. The data-parallel ranks need not divide it: each global
    batch splits as evenly as possible (10 over 4 ranks: 3 + 3 + 2 + 2) and ``rt.backward`` weights each
    rank's loss by its share, as for a short last batch."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ConfigError(f"batch_size={batch_size!r}: give the global batch size, a positive integer.")
    return batch_size


def _one_dataset(data: Any) -> None:
    """Refuse several datasets given as one (Lightning's list or dict of loaders): read as one dataset, each
    of them would be a sample."""
    parts = list(data.values()) if isinstance(data, dict) else data if isinstance(data, (list, tuple)) else []
    if parts and all(isinstance(part, (Dataset, DataLoader)) for part in parts):
        raise ConfigError(f"a {type(data).__name__} of {len(parts)} datasets or DataLoaders was given where one is "
                          "taken: a loader reads one dataset. Evaluate each with its own call (trainer.validate / "
                          "test per dataset, or one rt.eval_loader each), or join them with "
                          "torch.utils.data.ConcatDataset.")


def resolve_loader_options(
    data: Any, batch_size: int | None, options: dict[str, Any], local_world_size: int,
    device: torch.device, evaluation: bool = False,
) -> tuple[Any, dict[str, Any]]:
    """The dataset and DataLoader options of a lockstep loader over ``data`` (a dataset, or a DataLoader
    re-created with its own options): ``options`` override, ``batch_size`` is the global batch, and
    workers, ``pin_memory`` and ``persistent_workers`` get lockstep's defaults where unset.

    ``evaluation``: every sample once, in dataset order; a DataLoader's choice of samples is kept
    as a ``Subset`` or refused (``evaluated_samples``), and none may be given."""
    _one_dataset(data)
    dataset, opts = options_of(data) if isinstance(data, DataLoader) else (data, {})
    if evaluation:
        for chooser in ("sampler", "batch_sampler"):
            if options.get(chooser) is not None:
                raise ConfigError(f"an evaluation loader takes every sample once, in dataset order: it has no "
                                  f"{chooser}=. Give a Subset of the dataset to evaluate part of it.")
        dataset = evaluated_samples(dataset, opts.pop("sampler", None), opts.pop("batch_sampler", None))
    if "batch_sampler" in options or "sampler" in options:  # the caller's choice replaces the DataLoader's
        for chosen in ("batch_sampler", "sampler", "shuffle"):
            opts.pop(chosen, None)
    opts.update(options)
    if batch_size is not None:
        opts["batch_size"] = batch_size
    if plain_distributed(opts.get("sampler")):
        sampler = opts.pop("sampler")
        opts["shuffle"] = sampler.shuffle
        _say_per_rank_batch(batch_size, opts.get("batch_size"), sampler.num_replicas)
    if opts.get("batch_sampler") is not None:
        _not_per_rank(opts["batch_sampler"])
        clashes = [name for name in ("batch_size", "sampler", "shuffle", "drop_last") if opts.get(name)]
        if clashes:
            raise ConfigError(f"batch_sampler= chooses the global batches itself: drop {', '.join(clashes)}=.")
    elif opts.get("batch_size") is None:
        raise ConfigError("give batch_size (the global batch size) with a dataset, or a batch_sampler=.")
    else:
        check_batch_size(opts["batch_size"])
    if opts.get("sampler") is not None and opts.get("shuffle"):
        raise ConfigError("sampler= and shuffle=True contradict each other: the sampler chooses the order.")
    return dataset, _with_workers(opts, local_world_size, device)


def _with_workers(opts: dict[str, Any], local_world_size: int, device: torch.device) -> dict[str, Any]:
    """The options' workers, ``pin_memory`` and persistent workers, lockstep's defaults where unset."""
    if "num_workers" not in opts:
        opts["num_workers"] = default_num_workers(local_world_size)
    opts.setdefault("pin_memory", device.type == "cuda")
    if opts.get("timeout") and opts["num_workers"] == 0:  # torch's own iterator asserted it; lockstep's fetch here
        raise ConfigError(f"timeout={opts['timeout']!r} is how long to wait for a worker's batch, and num_workers=0 "
                          "starts none: give num_workers, or drop timeout.")
    if opts["num_workers"] > 0:
        opts.setdefault("persistent_workers", True)
        # torch's worker watchdog watches the worker's parent, a forkserver under lockstep.launch
        # (or Python 3.14's default): this one watches the rank itself.
        opts["worker_init_fn"] = DieWithParent(os.getpid(), WorkerSeesUsersData(opts.get("worker_init_fn")))
    return opts


class WorkerSeesUsersData:
    """In a DataLoader worker, before the user's ``worker_init_fn``: ``get_worker_info().dataset`` becomes the
    user's dataset, as under a plain DataLoader, instead of lockstep's wrapper of it (torch's recipes open a
    file per worker on it). Picklable."""

    def __init__(self, then: Callable[[int], Any] | None) -> None:
        self.then = then

    def __call__(self, worker_id: int) -> None:
        info = get_worker_info()
        shown = getattr(info.dataset, "users_dataset", None) if info is not None else None
        if callable(shown):
            object.__setattr__(info, "dataset", shown())  # WorkerInfo refuses setattr once made
        if self.then is not None:
            self.then(worker_id)


def dataset_length(dataset: Sequence[Any] | Dataset[Any]) -> int:
    try:
        return len(dataset)  # type: ignore[arg-type]
    except TypeError:
        raise ConfigError(
            f"{type(dataset).__name__} has no __len__: give a map-style dataset (with __len__ and "
            "__getitem__) or a stream (a torch IterableDataset)."
        ) from None
