"""Streams (IterableDatasets) cut into global batches in stream order, split over the ranks.

Global batch ``s`` holds the stream's items ``[s*B, (s+1)*B)``, and rank ``r`` takes its
``split_evenly`` share of it, as for map-style data: the sample stream does not depend on the
world size. Every rank (and every DataLoader worker) reads the stream from its start and keeps
only its own items: reading is repeated on each rank, while ``collate_fn`` (where decoding and
tokenizing belong) runs on this rank's items only. With ``num_workers=k``, worker ``w`` makes the
batches of steps ``w, w+k, ...``, which the DataLoader hands out in step order.

A resumed pass skips the items already trained on: through the stream's own
``load_state_dict`` when the checkpoint holds its ``state_dict`` (the torchdata convention, taken
with ``num_workers=0``), else by reading and dropping them.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import IterableDataset, get_worker_info
from torch.utils.data._utils import worker as _worker

from lockstep.runtime.order import split_evenly


def is_stream(dataset: Any) -> bool:
    """An IterableDataset, or an iterable without ``__getitem__`` (e.g. a generator object's owner)."""
    return isinstance(dataset, IterableDataset) or (
        hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__") and not hasattr(dataset, "__len__"))


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
            raise TypeError("a stream without __len__ has no number of steps per epoch: give the Trainer "
                            "max_steps, or loop over the loader until it ends.")
        full, rest = divmod(self.length, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def size(self, step: int) -> int:
        if step in self.ended:
            return self.ended[step]
        if self.length is not None:
            return min(self.batch_size, self.length - step * self.batch_size)
        return self.batch_size

    def indices(self, step: int, start: int, stop: int) -> list[int]:
        """Positions in the stream (this epoch's pass): a stream's dataset index is its position."""
        first = step * self.batch_size
        return list(range(first + start, first + min(stop, self.size(step))))


@contextlib.contextmanager
def _no_worker_info() -> Iterator[None]:
    """Hide the worker from the stream while it is read: a stream that splits itself over
    DataLoader workers (Hugging Face's does) must give every worker the whole stream here."""
    saved = _worker._worker_info
    _worker._worker_info = None
    try:
        yield
    finally:
        _worker._worker_info = saved


class StreamShard(IterableDataset[Any]):
    """Yields ``(step, global batch size, this rank's collated share)`` for this worker's steps.

    ``pad_empty`` (evaluation): a rank whose share of a short last batch is empty still gets a batch,
    of zero rows; in training that is an error (such a rank has no loss), raised by the loader."""

    def __init__(self, stream: Any, batch_size: int, rank: int, world_size: int, drop_last: bool,
                 collate_fn: Callable[[list[Any]], Any], pad_empty: bool) -> None:
        self.stream, self.batch_size, self.rank, self.world_size = stream, batch_size, rank, world_size
        self.drop_last, self.collate_fn, self.pad_empty = drop_last, collate_fn, pad_empty
        self.start_step, self.skip = 0, 0  # set by the loader before each pass

    def _read(self, source: Iterator[Any], count: int) -> list[Any]:
        with _no_worker_info():
            return list(itertools.islice(source, count))

    def __iter__(self) -> Iterator[tuple[int, int, Any]]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        with _no_worker_info():
            source = iter(self.stream)
        # A position applies to one pass: persistent workers iterate this same copy again next epoch.
        first, remaining = self.start_step, self.skip
        self.start_step = self.skip = 0
        while remaining > 0:  # drop what was trained on
            dropped = len(self._read(source, min(remaining, 1024)))
            if not dropped:
                break
            remaining -= dropped
        for step in itertools.count(first):
            items = self._read(source, self.batch_size)
            if not items or (self.drop_last and len(items) < self.batch_size):
                return
            if step % workers == worker:
                start, stop = split_evenly(len(items), self.world_size, self.rank)
                # A rank without items gets one collated item, which the loader cuts to zero rows
                # (evaluation), or None, which the loader refuses once every rank knows (training).
                share = items[start:stop] if start < stop else (items[:1] if self.pad_empty else None)
                yield step, len(items), None if share is None else self.collate_fn(share)
            if len(items) < self.batch_size:
                return
