"""Streams (IterableDatasets) cut into global batches in stream order, split over the ranks.

Global batch ``s`` holds the stream's items ``[s*B, (s+1)*B)``, and rank ``r`` takes its
``split_evenly`` share of it, as for map-style data: the sample stream does not depend on the
world size. Every rank (and every DataLoader worker) reads the stream from its start and keeps
only its own items; ``collate_fn`` (where decoding and tokenizing belong) runs on this rank's items
only. A stream that can skip cheaply (it has ``__len__``, and its iterator a ``skip(n)`` method,
say a seek in a file of records) is read only for this rank's items. With ``num_workers=k``,
worker ``w`` makes the batches of steps ``w, w+k, ...``, which the DataLoader hands out in order.

A resumed pass skips the items already trained on: through the stream's own
``load_state_dict`` when the checkpoint holds its ``state_dict`` (the torchdata convention, taken
with ``num_workers=0`` from a stream whose state restores its exact position), else by reading
and dropping them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info

from lockstep.errors import ConfigError, UsageError
from lockstep.runtime._torch_compat import hide_worker_info
from lockstep.runtime.data.order import split_evenly
from lockstep.runtime.parallel.mesh import Membership
from lockstep.runtime.seed import seed_worker_batch


def is_stream(dataset: Any) -> bool:
    """An IterableDataset, or any other iterable with neither ``__getitem__`` nor ``__len__``."""
    return isinstance(dataset, IterableDataset) or (
        hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__") and not hasattr(dataset, "__len__"))


def restores_its_position(stream: Any) -> bool:
    """Whether the stream saves and restores its exact position (the torchdata convention:
    ``state_dict``/``load_state_dict``). A Hugging Face stream with a shuffle buffer does not: its
    state holds no buffer content, and a restored one refills the buffer from later items,
    losing some and repeating others. Such a stream is read from its start and the items already
    trained on dropped, which is exact."""
    if not (callable(getattr(stream, "state_dict", None)) and callable(getattr(stream, "load_state_dict", None))):
        return False
    pending, seen = [getattr(stream, "_ex_iterable", None)], 0
    while pending and seen < 1000:  # Hugging Face's chain of example iterables
        node, seen = pending.pop(), seen + 1
        if node is None:
            continue
        if type(node).__name__ == "BufferShuffledExamplesIterable":
            return False
        pending.append(getattr(node, "ex_iterable", None))
        pending.extend(getattr(node, "ex_iterables", None) or [])
    return True


def stream_length(stream: Any) -> int | None:
    try:
        return len(stream)
    except TypeError:
        return None


class StreamBatches:
    """The global batches of a stream: ``batch_size`` items each, the last one shorter (or dropped)."""

    kind = "stream"

    def __init__(self, length: int | None, batch_size: int, drop_last: bool) -> None:
        self.length, self.batch_size, self.drop_last = length, batch_size, drop_last
        self.ended: dict[int, int] = {}  # a short last batch seen this epoch: step -> size

    def set_epoch(self, epoch: int) -> None:
        self.ended = {}

    def __len__(self) -> int:
        if self.length is None:
            raise UsageError("a stream without __len__ has no number of steps per epoch: give the Trainer "
                             "max_steps, or loop over the loader until it ends.")
        full, rest = divmod(self.length, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def size(self, step: int) -> int:
        if step in self.ended:
            return self.ended[step]
        if self.length is not None:
            return min(self.batch_size, self.length - step * self.batch_size)
        return self.batch_size

    def promised(self, step: int) -> int | None:
        """How many items batch ``step`` holds by the stream's ``__len__`` (0: none, the pass has ended; a
        short last batch under ``drop_last`` is none); None without ``__len__``."""
        if self.length is None:
            return None
        size = max(0, min(self.batch_size, self.length - step * self.batch_size))
        return 0 if self.drop_last and size < self.batch_size else size

    def indices(self, step: int, start: int, stop: int) -> list[int]:
        """Positions in the stream (this epoch's pass): a stream's dataset index is its position."""
        first = step * self.batch_size
        return list(range(first + start, first + min(stop, self.size(step))))


class _Reader:
    """Reads a stream with the DataLoader worker hidden from it. Passes over items with the
    iterator's own ``skip(n)`` (returning how many it passed over) when it has one, a cheap skip
    such as a seek in a file of records; else by reading them."""

    def __init__(self, stream: Any) -> None:
        with hide_worker_info():
            self.source = iter(stream)
        skip = getattr(self.source, "skip", None)
        self.skip = skip if callable(skip) else None

    def take(self, count: int) -> list[Any]:
        with hide_worker_info():
            return list(itertools.islice(self.source, count))

    def drop(self, count: int) -> int:
        """Pass over up to ``count`` items; returns how many there were."""
        if count <= 0:
            return 0
        if self.skip is not None:
            with hide_worker_info():
                return int(self.skip(count))
        dropped = 0
        while dropped < count:
            read = len(self.take(min(count - dropped, 1024)))
            if not read:
                break
            dropped += read
        return dropped


class _StreamInWorker:
    """The user's stream as a DataLoader worker's ``worker_init_fn`` sees it. lockstep splits a stream over the
    ranks and the workers itself: each worker reads it whole and keeps its own batches. torch's recipe of
    narrowing each worker's copy in ``worker_init_fn`` (``dataset.start = ...``) would then drop the batches
    outside a worker's range without a word: setting an attribute is refused, naming that."""

    def __init__(self, stream: Any) -> None:
        object.__setattr__(self, "_stream", stream)

    def __getattr__(self, name: str) -> Any:
        return getattr(object.__getattribute__(self, "_stream"), name)

    def __setattr__(self, name: str, value: Any) -> None:
        stream = type(object.__getattribute__(self, "_stream")).__name__
        raise UsageError(f"worker_init_fn set {name!r} on the stream ({stream}) through get_worker_info().dataset: "
                         "lockstep splits a stream over the ranks and DataLoader workers itself (each worker reads it "
                         "whole and keeps its own batches), so a worker's copy narrowed to a range of its own would "
                         "drop data. Leave the split to lockstep; open per-worker resources in the stream's __iter__.")


class StreamShard(IterableDataset[Any]):
    """Yields ``(step, global batch size, this rank's collated share)`` for this worker's steps.

    A stream with ``__len__`` whose iterator can ``skip`` is read only for this rank's items; any
    other is read whole. ``pad_empty`` (evaluation): a rank whose share of a short last batch is
    empty still gets a batch, of zero rows; in training that is an error (such a rank has no
    loss), raised by the loader. In a DataLoader worker, the random generators are seeded before each
    batch's ``collate_fn`` from (``seed``, rank, epoch, step): augmentations there do not depend on the
    number of workers, and a resumed pass draws what the uninterrupted one drew."""

    def __init__(self, stream: Any, length: int | None, batch_size: int, membership: Membership,
                 drop_last: bool, collate_fn: Callable[[list[Any]], Any], pad_empty: bool, seed: int = 0) -> None:
        self.stream, self.length, self.batch_size = stream, length, batch_size
        self.membership = membership  # read per batch: in DataLoader workers, as it was when the pass began
        self.drop_last, self.collate_fn, self.pad_empty = drop_last, collate_fn, pad_empty
        self.start_step, self.skip = 0, 0  # set by the loader before each pass
        self.epoch = 0  # the next pass's; a persistent worker's copy counts its own passes on from where it began
        self.seed, self._pass_epoch = seed, 0

    def users_dataset(self) -> Any:
        """What a DataLoader worker's ``get_worker_info().dataset`` shows: the user's stream, whose attributes
        a ``worker_init_fn`` may read but not set (``WorkerSeesUsersData``)."""
        return _StreamInWorker(self.stream)

    def _collate(self, items: list[Any], empty: bool, step: int) -> Any:
        """This rank's share of batch ``step`` collated. An empty share brings the batch's first item instead:
        collated, the loader cuts it to zero rows (evaluation); or None, which the loader refuses once every
        rank knows (training)."""
        if empty and not self.pad_empty:
            return None
        seed_worker_batch(self.seed, self.membership.rank, self._pass_epoch, step)
        return self.collate_fn(items)

    def __iter__(self) -> Iterator[tuple[int, int, Any]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch, self.epoch = self.epoch, self.epoch + 1
        self._pass_epoch = epoch
        if info is not None and callable(getattr(self.stream, "set_epoch", None)):  # a worker's own copy (the
            self.stream.set_epoch(epoch)  # loader sets the main process's before loading a saved position)
        reader = _Reader(self.stream)
        # A position applies to one pass: persistent workers iterate this same copy again next epoch.
        first, skip = self.start_step, self.skip
        self.start_step = self.skip = 0
        reader.drop(skip)  # what was trained on
        steps = itertools.count(first)
        # the DataLoader asks worker 0 first at every pass, then each in turn: worker w makes the pass's
        # batches w, w + k, ... (from where the pass starts, a resumed one too)
        def turn(step: int) -> bool:
            return (step - first) % workers == worker

        if reader.skip is not None and self.length is not None:
            return self._skipping(reader, steps, turn)
        return self._reading(reader, steps, turn)

    def _reading(self, reader: _Reader, steps: Iterator[int], turn: Callable[[int], bool]
                 ) -> Iterator[tuple[int, int, Any]]:
        """Read every item; keep this rank's share of this worker's batches."""
        for step in steps:
            items = reader.take(self.batch_size)
            if not items or (self.drop_last and len(items) < self.batch_size):
                return
            if turn(step):
                start, stop = split_evenly(len(items), self.membership.size, self.membership.rank)
                yield step, len(items), self._collate(items[start:stop] or items[:1], start == stop, step)
            if len(items) < self.batch_size:
                return

    def _skipping(self, reader: _Reader, steps: Iterator[int], turn: Callable[[int], bool]
                  ) -> Iterator[tuple[int, int, Any]]:
        """Read this rank's items of this worker's batches, skip the rest (sizes follow from ``__len__``)."""
        assert self.length is not None
        for step in steps:
            size = min(self.batch_size, self.length - step * self.batch_size)
            if size <= 0 or (self.drop_last and size < self.batch_size):
                # the stream must end where __len__ says (read as the loader reads a stream without skip)
                if reader.drop(max(size, 0)) < max(size, 0):
                    raise self._ended_early(step)
                if reader.take(1):  # read, not skipped: a seek's skip may pass over items that are not there
                    raise ConfigError(f"{type(self.stream).__name__} yields more items than the {self.length} its "
                                      "__len__ promises: make __len__ the number of items it yields, or drop "
                                      "__len__ (a stream without it is read to its end).")
                return
            if not turn(step):
                if reader.drop(size) < size:
                    raise self._ended_early(step)
                continue
            start, stop = split_evenly(size, self.membership.size, self.membership.rank)
            # An empty share reads the batch's first item, to give its zero rows their shape.
            at, wanted = (start, stop - start) if start < stop else (0, int(self.pad_empty))
            before, items = reader.drop(at), reader.take(wanted)
            if before + len(items) + reader.drop(size - at - len(items)) < size:
                raise self._ended_early(step)
            yield step, size, self._collate(items, start == stop, step)

    def _ended_early(self, step: int) -> ValueError:
        return ConfigError(f"{type(self.stream).__name__} ended inside global batch {step}, before the "
                           f"{self.length} items its __len__ promises.")
