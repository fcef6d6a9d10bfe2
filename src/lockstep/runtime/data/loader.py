"""Sharded data loading whose sample stream does not depend on the number of processes.

Training: one permutation per epoch (seeded by ``seed`` and the epoch); step ``s`` takes the
contiguous slice ``[s*B, (s+1)*B)`` of it as the global batch and splits it over the ranks, as
evenly as possible. Every rank has the same number of steps. Evaluation: rank ``r`` takes the
``r``-th contiguous shard of the dataset, so rank-ordered concatenation is dataset order.
"""

from __future__ import annotations

import copy
import functools
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset, default_collate, get_worker_info

from lockstep.errors import CollectiveError, ConfigError
from lockstep.runtime._torch_compat import profiler_enabled, shutdown_workers
from lockstep.runtime.data.current import BatchObserver
from lockstep.runtime.data.samplers import GlobalBatchSampler, Indices, ShardSampler
from lockstep.runtime.data.streams import StreamBatches, StreamShard, restores_its_position
from lockstep.runtime.seed import forked_generators, mix_seed, seed_generators, seed_worker_batch
from lockstep.runtime.tree import empty_rows, tensors, to_device

# The DataLoader's own generator only seeds its workers' base seed (lockstep re-seeds them per
# epoch). Its stream id keeps mix_seed(seed, rank, stream) apart from mix_seed(seed, epoch).
_WORKER_BASE_STREAM = 7
_END = object()


def _as_is(batch: Any) -> Any:
    return batch


class EpochSeededDataset(Dataset[Any]):
    """Seeds the random generators that a dataset's ``__getitem__`` draws from (augmentations).

    Default: a DataLoader worker seeds torch's CPU generator, python's and numpy's from (seed, rank,
    epoch, step) before each batch it fetches, so augmentations differ across ranks, batches and
    epochs, repeat from run to run, do not depend on the number of workers or on which worker fetched
    a batch, and a resumed pass draws what the uninterrupted one drew; in the main process
    (``num_workers=0``) the global RNG, which checkpoints save, is left alone. The draws depend on
    which rank fetched a sample, hence on the world size.

    ``per_sample``: every item is fetched with torch's CPU generator, python's and numpy's seeded
    from (seed, epoch, dataset index) alone, so a sample's augmentation is the same on any number
    of processes and workers. In the main process the global generators are restored after each
    item (which costs more: numpy's state is slow to save).
    """

    def __init__(self, dataset: Any, seed: int, rank: int, per_sample: bool = False) -> None:
        self.dataset, self.seed, self.rank, self.per_sample = dataset, seed, rank, per_sample

    def users_dataset(self) -> Any:
        """What a DataLoader worker's ``get_worker_info().dataset`` shows (``WorkerSeesUsersData``)."""
        return self.dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def _seeded_item(self, epoch: int, index: int) -> Any:
        seed = mix_seed(self.seed, -1, epoch, index)  # -1: apart from the per-batch seeds
        if get_worker_info() is not None:  # a worker's generators serve nothing else
            seed_generators(seed, cpu_only=True)
            return self.dataset[index]
        with forked_generators(seed):
            return self.dataset[index]

    def __getitem__(self, index: int) -> Any:  # lockstep's samplers give batches: see __getitems__
        return self.__getitems__(Indices([index], 0))[0]

    def __getitems__(self, indices: Indices) -> list[Any]:
        if not indices:
            return []
        if self.per_sample:  # item by item: each is seeded by its own index
            return [self._seeded_item(indices.epoch, i) for i in indices]
        seed_worker_batch(self.seed, self.rank, indices.epoch, indices.step)
        if callable(getattr(self.dataset, "__getitems__", None)):
            return list(self.dataset.__getitems__(list(indices)))
        return [self.dataset[i] for i in indices]


class TensorRows(Dataset[Any]):
    """A ``TensorDataset``'s batches fetched by one index of each tensor: the rows, values and
    dtypes that ``default_collate`` would stack from the items one by one (a list of the batched
    tensors), without a Python call per item (a batch of 32 small rows: about a tenth of the time).
    Only for a plain ``TensorDataset`` under the default collate; it draws no random numbers."""

    def __init__(self, dataset: TensorDataset) -> None:
        self.tensors, self._dataset = dataset.tensors, dataset

    def users_dataset(self) -> TensorDataset:
        return self._dataset

    @staticmethod
    def fits(dataset: Any) -> bool:
        """A ``TensorDataset`` whose class reads its rows as ``TensorDataset`` does (a subclass's own
        ``__getitem__``, ``__getitems__`` or ``__len__`` is used as it is)."""
        own = type(dataset)
        return isinstance(dataset, TensorDataset) and all(
            getattr(own, name, None) is getattr(TensorDataset, name, None)
            for name in ("__getitem__", "__getitems__", "__len__"))

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:  # an item, as TensorDataset's
        return tuple(tensor[index] for tensor in self.tensors)

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        rows = torch.as_tensor(indices, dtype=torch.int64)
        return [tensor.index_select(0, rows) for tensor in self.tensors]  # a little faster than tensor[rows]


class HandedRows(NamedTuple):
    """The rows a loader pass handed this rank, in order: their dataset indices (for a stream, positions in it);
    where each stands in the pass's global order (what puts the rows of an index handed out more than once, by
    a sampler that draws with replacement, in the order one process reads them; None where an index comes once
    per pass: evaluation shards, streams); and each batch's number of rows."""

    indices: torch.Tensor
    places: torch.Tensor | None
    sizes: list[int]


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
        per_sample_rng: bool = False, count_ranks: Callable[[bool], int] | None = None, training: bool = True,
        gate: Callable[[DistributedLoader, int], int] | None = None,
        cut: Callable[[Any, Callable[[Any], Any]], Any] | None = None,
    ) -> None:
        self.dataset = dataset
        self.training = training  # global batches to train on; else evaluation batches (no loss weight)
        self.sampler = sampler
        self.device = device
        self._observer = observer
        self._epoch, self._batches_done, self._started, self._pass_start = 0, 0, False, 0
        self._last = False  # a stream's: the batch handed out last ends the pass
        self._handed_state: Any = None  # a stream's own state after the batch handed out last (one is drawn ahead)
        self._workers_next_epoch = 0
        self.wait_s = 0.0  # time spent waiting for batches (data loading not hidden behind compute)
        self._pending: tuple[int, int] | None = None  # a position loaded from a checkpoint
        self._workers: weakref.finalize | None = None  # shuts down persistent workers: see __iter__
        self._stream_state: Any = None  # a stream's own state, loaded from a checkpoint
        self._non_blocking = bool(options.get("pin_memory")) and device.type == "cuda"
        generator = torch.Generator().manual_seed(mix_seed(seed, rank, _WORKER_BASE_STREAM))
        self._stream: StreamShard | None = None
        self._count_ranks = count_ranks  # how many ranks pass True (a collective), to agree on a stream's end
        # Asked before each batch which step to draw (fault tolerance: the quorum, and a step drawn again
        # when it did not commit; fault_tolerance/groups.py).
        self._gate = gate if training else None
        self._cut = cut if training else None  # context parallel: this rank's part of each row's sequence
        batches = getattr(sampler, "batches", None)
        if isinstance(batches, StreamBatches):
            assert isinstance(sampler, GlobalBatchSampler)
            collate = options.pop("collate_fn", None) or default_collate
            self._stream_batches = batches
            self._stream = stream = StreamShard(dataset, batches.length, batches.batch_size, sampler.membership,
                                                batches.drop_last, collate, pad_empty=not training, seed=seed)
            self._stream_loader = lambda: DataLoader(stream, batch_size=None, collate_fn=_as_is,
                                                     generator=generator, **options)
            self.loader: DataLoader[Any] = self._stream_loader()
        elif options.get("collate_fn") is None and TensorRows.fits(dataset):
            self.loader = DataLoader(TensorRows(dataset), batch_sampler=sampler, generator=generator,
                                     **{**options, "collate_fn": _as_is})
        else:
            self.loader = DataLoader(EpochSeededDataset(dataset, seed, rank, per_sample_rng), batch_sampler=sampler,
                                     generator=generator, **options)

    def __len__(self) -> int:
        return self.sampler.steps_per_epoch()

    @property
    def epoch(self) -> int:
        """The epoch of the current (or last) pass."""
        return self._epoch

    @property
    def batches_done(self) -> int:
        """How many batches of the current pass have been handed out: the last one is batch
        ``batches_done - 1`` (a step drawn again in a fault-tolerant job keeps its number)."""
        return self._batches_done

    @property
    def last_batch(self) -> bool:
        """Whether the batch handed out last is the pass's last (of a stream without ``__len__`` too: there, the
        next batch is drawn before this one is handed out)."""
        return self._last if self._stream is not None else self._batches_done >= len(self)

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

    def batch_sizes(self, step: int) -> tuple[int, int]:
        """``local_batch_size(step)`` and ``global_batch_size(step)``, in one call."""
        sampler = self.sampler
        if isinstance(sampler, GlobalBatchSampler):
            return sampler.sizes(step)
        local = sampler.local_size(step)
        return local, local

    def loss_weight(self, step: int) -> float:
        """What this rank's mean loss over batch ``step`` is multiplied by for the gradient of the
        global batch's mean loss, once DDP averages over the ranks (1.0 for evaluation batches)."""
        sampler = self.sampler
        if not self.training or not isinstance(sampler, GlobalBatchSampler):
            return 1.0
        local, size = sampler.sizes(step)
        return local * sampler.world_size / size

    def __iter__(self) -> Iterator[Any]:
        """One pass: each batch of this rank, on the device, the observer told which is current."""
        epoch, start = self._begin_pass()
        observer = self._observer
        pads = not self.training  # only an evaluation batch can have no rows (FSDP, a stream's end)
        on_cpu = self.device.type == "cpu"  # the DataLoader hands out CPU tensors: nothing to move
        move = None if on_cpu else functools.partial(to_device, device=self.device, non_blocking=self._non_blocking)
        cut = self._cut
        try:
            for step, batch in self._draws(epoch, start):
                self._batches_done = step + 1
                if observer is not None:
                    observer.batch_started(self, step)
                if cut is not None:  # before the move: only this rank's part moves, and no check waits for a device
                    batch = cut(batch, move or _unmoved)
                elif move is not None:  # a CPU loader's batch stays where the DataLoader made it
                    batch = move(batch)
                if pads and self.sampler.local_size(step) == 0:
                    real, batch = batch, empty_rows(batch)
                    if observer is not None:
                        observer.padded({id(cut): row for cut, row in zip(tensors(batch), tensors(real), strict=True)})
                if observer is not None:
                    observer.handed(self, batch)
                yield batch
        finally:  # the pass ended, or the loop was left (break, an exception): no batch is current
            if observer is not None:
                observer.batch_ended(self)

    def _begin_pass(self) -> tuple[int, int]:
        """The pass's epoch and first step (a loaded position, else the next epoch from its start), with
        the stream and the sampler placed there and the observer told."""
        if self._pending is not None:
            (epoch, start), self._pending = self._pending, None
        else:
            epoch, start = (self._epoch + 1 if self._started else 0), 0
        if self._stream is not None:
            self._start_stream(epoch, start, workers_started=self._started)
        self._epoch, self._batches_done, self._started, self._pass_start = epoch, start, True, start
        self.sampler.place(epoch, start)
        if self._observer is not None:
            self._observer.pass_started(self)
        return epoch, start

    def _draws(self, epoch: int, step: int) -> Iterator[tuple[int, Any]]:
        """The step source: each step of the pass and its batch as the DataLoader fetched it, drawn again
        from a step when the gate (fault tolerance) names another one, or when the data-parallel
        membership changed under DataLoader workers that drew ahead under the old one (what they drew is
        dropped); a stream's batches through its pass (``_stream_batch``)."""
        batches = self._fetches()
        if self.loader.persistent_workers and self._workers is None:
            # Persistent workers outlive the pass. Freed by the garbage collector (this loader in a
            # reference cycle, e.g. with its Runtime), the DataLoader would find its queues to them
            # closed already and wait 5 s for each: this shuts them down first, while they answer.
            self._workers = weakref.finalize(self, shutdown_workers, batches)
        if self._stream is not None:  # a stream has no fault tolerance (refused) and no membership change
            yield from self._stream_draws(batches, step)
            return
        gate, clock = self._gate, time.perf_counter
        member = getattr(self.sampler, "membership", None) if self.loader.num_workers else None
        drawn_for = (member.rank, member.size) if member is not None else None
        while True:
            again = False
            if gate is not None and ((wanted := gate(self, step)) != step or self._epoch != epoch):
                step, epoch, again = wanted, self._epoch, True  # a step drawn again, or where a peer's state put it
            if member is not None and (member.rank, member.size) != drawn_for:
                drawn_for, again = (member.rank, member.size), True
            if again:
                self.sampler.place(epoch, step)
                batches = self._fetches()
            waited = clock()
            batch = next(batches, _END)
            self.wait_s += clock() - waited
            if batch is _END:
                return
            yield step, batch
            step += 1

    def _fetches(self) -> Iterator[Any]:
        """The DataLoader's batches from where the sampler stands. Without workers or pinning, fetched here as
        its own fetcher does (each batch's indices, the dataset's ``__getitems__``, the collate), without its
        iterator's machinery around each batch: half the time of a small batch's fetch."""
        loader = self.loader
        if loader.num_workers or loader.pin_memory or loader.batch_sampler is None:  # workers, pinning, a stream
            return iter(loader)
        items: TensorRows | EpochSeededDataset = loader.dataset  # type: ignore[assignment]  # lockstep's own, made above
        return _fetched_here(items.__getitems__, loader.collate_fn, loader.batch_sampler)

    def _stream_draws(self, batches: Iterator[Any], step: int) -> Iterator[tuple[int, Any]]:
        """A stream's batches through its pass, each drawn one ahead of the one handed out: whether that one
        is the pass's last (``last_batch``) is then known before its backward, as a gradient accumulation
        that the stream's end cuts short needs (its last micro-batch synchronises the gradients)."""
        clock, keeps_state = time.perf_counter, self._saves_stream_state()
        self._handed_state, self._last = None, False

        def draw(at: int) -> Any:
            waited = clock()
            item = next(batches, _END)
            self.wait_s += clock() - waited
            return self._stream_batch(at, item)

        batch = draw(step)
        while batch is not _END:
            # what a checkpoint saves of a stream that keeps its own position: where it stood after this batch
            self._handed_state = copy.deepcopy(self.dataset.state_dict()) if keeps_state else None  # not live
            following = draw(step + 1)
            self._last = following is _END
            yield step, batch
            batch, step = following, step + 1

    def rewind(self, step: int) -> None:
        """The position is ``step`` batches into the current pass (a step drawn again is not done)."""
        self._batches_done = step

    def healed_position(self, step: int) -> int:
        """Where to go on after a live peer's state was loaded into this loader during its pass
        (``step`` when none was): the peer's position, in the peer's epoch, which becomes this pass's."""
        if self._pending is None:
            return step
        (self._epoch, self._batches_done), self._pending = self._pending, None
        return self._batches_done

    def _start_stream(self, epoch: int, start: int, workers_started: bool) -> None:
        assert self._stream is not None
        if workers_started and isinstance(self.dataset, Iterator):
            raise ConfigError(f"the stream ({type(self.dataset).__name__}) is a one-shot iterator (a generator, an "
                              f"open file): the first pass read it, and pass {epoch + 1} would find it empty. Give an "
                              "IterableDataset whose __iter__ starts the stream anew (opens the file, calls the "
                              "generator function) at each pass.")
        if callable(getattr(self.dataset, "set_epoch", None)):
            self.dataset.set_epoch(epoch)
        if (start or epoch != self._workers_next_epoch) and self.loader.persistent_workers and workers_started:
            # Persistent workers hold a copy of the stream made when they started, which counts the passes
            # (each its epoch's) on from there: a mid-epoch position, or another epoch, needs new workers.
            if self._workers is not None:
                self._workers()
                self._workers = None
            self.loader = self._stream_loader()
        self._stream.start_step, self._stream.skip, self._stream.epoch = start, start * self._stream.batch_size, epoch
        self._workers_next_epoch = epoch + 1  # where persistent workers' copies will be after this pass
        state, self._stream_state = self._stream_state, None
        if state is not None and start:
            self.dataset.load_state_dict(state)  # the stream continues where the checkpoint left it
            self._stream.skip = 0

    def _stream_batch(self, step: int, item: Any) -> Any:
        """This rank's batch out of the stream's ``(step, global size, batch)``; every rank agrees the stream ended."""
        assert self._stream is not None
        if self._count_ranks is not None:
            world, having = self._stream.membership.size, self._count_ranks(item is not _END)
            if having not in (0, world):
                raise CollectiveError(
                    f"the stream ended at step {step} on {world - having} of {world} ranks, not on the others: "
                    "every rank must read the same stream (lockstep splits it). A stream that splits itself "
                    "by rank or yields a different number of items on each rank cannot be split again.")
        got, size, batch = (step, 0, None) if item is _END else item
        promised = self._stream_batches.promised(step)
        if promised is not None and size != promised:  # the sizes (the loss weights) follow from __len__
            name = type(self._stream.stream).__name__
            raise ConfigError(f"{name} yielded {'no' if item is _END else size} item(s) for global batch {step} where "
                              f"its __len__ ({self._stream_batches.length}) promises {promised}: make __len__ the "
                              "number of items it yields, or drop __len__ (a stream without it is read to its end).")
        if item is _END:
            return _END
        assert got == step, f"stream batch {got} arrived at step {step}"
        if batch is None or (size < self._stream.membership.size and not self._stream.pad_empty):  # on every rank
            raise ConfigError(f"the stream's last global batch (step {step}) holds {size} items for "
                              f"{self._stream.membership.size} ranks: every rank needs one to train on. "
                              "Pass drop_last=True.")
        if size < self._stream_batches.batch_size:
            self._stream_batches.ended[step] = size
        return batch

    def handed_rows(self) -> HandedRows:
        """The rows this rank was handed in the current (or last) pass so far: what ``rt.gather`` orders by."""
        steps = range(self._pass_start, self._batches_done)
        per_step = [self.sampler.local_indices(step) for step in steps]
        places = getattr(self.sampler, "local_places", None)
        return HandedRows(torch.tensor([n for rows in per_step for n in rows], dtype=torch.int64),
                          None if places is None else torch.tensor([n for step in steps for n in places(step)],
                                                                   dtype=torch.int64),
                          [len(rows) for rows in per_step])

    def state_dict(self) -> dict[str, Any]:
        """The position: ``batches_done`` batches of epoch ``epoch`` have been handed out; with the
        global batch size and the kind of order (which the position only means something with)."""
        if self._pending is not None:
            epoch, done, ended = *self._pending, False
        else:  # ended: the pass's last batch was handed out (a stream's, or a batch sampler's of this epoch's count)
            epoch, done, ended = self._epoch, self._batches_done, self._started and self.last_batch
        batches = getattr(self.sampler, "batches", None)
        state = {"epoch": epoch, "batches_done": done, "batch_size": getattr(self.sampler, "batch_size", None),
                 "order": batches.kind if batches is not None else "shards", "ended": ended}
        if self._saves_stream_state():
            live = self._handed_state if self._handed_state is not None else self.dataset.state_dict()
            state["stream"] = live if self._pending is None else self._stream_state
        return state

    def _saves_stream_state(self) -> bool:
        """A stream read in this process (no workers) that restores its own exact position: a checkpoint keeps
        that position (else a resumed pass reads the stream from its start and drops what was trained on)."""
        return self._stream is not None and self.loader.num_workers == 0 and restores_its_position(self.dataset)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``'s position at the next ``iter()``."""
        if isinstance(self.sampler, GlobalBatchSampler):
            saved = state.get("batch_size")
            if saved not in (None, self.sampler.batch_size):
                raise ConfigError(
                    f"the checkpoint was written with global batch_size={saved}, this loader has "
                    f"{self.sampler.batch_size}: resume with the same global batch size."
                )
            # A checkpoint without "order" comes from a release that shuffled with randperm at every n.
            now = self.sampler.batches.kind
            order = state.get("order", "randperm" if now == "feistel-1" else None)
            if order is not None and order != now:
                raise ConfigError(
                    f"the checkpoint's data order is {order!r}, this loader's is {now!r}: its position would "
                    "point at other samples. Resume with the same dataset length, shuffle and sampler "
                    "(docs/data.md, 'Checkpoint format')."
                )
        epoch, done, ended = int(state["epoch"]), int(state["batches_done"]), state.get("ended")
        if ended is None:  # a checkpoint from before the flag: a pass of map-style data of that length ended there
            ended = self._stream is None and done >= self.sampler.steps_per_epoch()
        if self._stream is not None:
            self._stream_state = state.get("stream") if restores_its_position(self.dataset) else None
        if ended is True:  # the next pass starts (a stream, or a batch sampler whose count changes, cannot tell)
            epoch, done = epoch + 1, 0
        self._pending = (epoch, done)


def _fetched_here(fetch: Callable[[Any], Any], collate: Callable[[Any], Any], batches: Any) -> Iterator[Any]:
    for indices in batches:
        if profiler_enabled():  # a profile shows the fetch under one name, as the DataLoader's own
            with torch.profiler.record_function("lockstep.loader.fetch"):
                yield collate(fetch(indices))
        elif collate is _as_is:  # TensorRows: its batch as fetched
            yield fetch(indices)
        else:
            yield collate(fetch(indices))


def _unmoved(batch: Any) -> Any:
    """A CPU loader's batch: where the DataLoader made it."""
    return batch
