"""Which dataset indices each rank takes at each step: its share of the global batch (training),
or its contiguous shard (evaluation). Both yield one ``Indices`` batch at a time."""

from __future__ import annotations

from collections.abc import Iterator

from torch.utils.data import Sampler

from lockstep.errors import ConfigError
from lockstep.runtime.data.order import Batches, split_evenly
from lockstep.runtime.parallel.mesh import Membership


class Indices(list[int]):
    """One batch's dataset indices, with their epoch and the batch's step in it (a worker seeds its random
    generators per batch from them)."""

    def __init__(self, indices: list[int], epoch: int, step: int = 0) -> None:
        super().__init__(indices)
        self.epoch, self.step = epoch, step



class GlobalBatchSampler(Sampler[Indices]):
    """Yields this rank's share of each global batch of ``batches`` (see the module docstring). The
    share follows ``membership`` as it is when each batch is drawn: a change between two steps
    re-splits the next global batch over the new members."""

    def __init__(self, batches: Batches, membership: Membership) -> None:
        self.batches, self.membership = batches, membership
        self.epoch, self.start_step = 0, 0
        self._last_share: tuple[tuple[int, int, int], tuple[int, int], int] = ((-1, 0, 0), (0, 0), 0)

    @property
    def rank(self) -> int:
        return self.membership.rank

    @property
    def world_size(self) -> int:
        return self.membership.size

    @property
    def batch_size(self) -> int | None:
        """The global batch size (None when a batch sampler chooses the batches)."""
        return getattr(self.batches, "batch_size", None)

    def place(self, epoch: int, start_step: int) -> None:
        """The pass of ``epoch`` from step ``start_step`` (the loader's call at each pass)."""
        self.epoch, self.start_step = epoch, start_step
        self.batches.set_epoch(epoch)
        self._last_share = ((-1, 0, 0), (0, 0), 0)  # a batch sampler's sizes change with the epoch

    def set_epoch(self, epoch: int) -> None:
        """Nothing to do: each pass of the loader is the next epoch, its order seeded by (seed, epoch), and a
        checkpoint keeps where the loader stands. Kept so that a ported ``DistributedSampler`` line
        (``loader.sampler.set_epoch(epoch)``) is harmless."""

    def steps_per_epoch(self) -> int:
        return len(self.batches)

    def __len__(self) -> int:
        return self.steps_per_epoch() - self.start_step

    def global_size(self, step: int) -> int:
        return self.batches.size(step)

    def _share(self, step: int) -> tuple[int, int]:
        return self._sizes(step)[1]

    def _sizes(self, step: int) -> tuple[tuple[int, int, int], tuple[int, int], int]:
        """Batch ``step``'s key, this rank's ``[start, stop)`` of it and its global size; asked several
        times per batch (the loader, the loss weight, the Trainer): the latest is remembered."""
        member = self.membership
        key = (step, member.rank, member.size)
        if self._last_share[0] != key:
            size = self.global_size(step)
            self._last_share = (key, split_evenly(size, member.size, member.rank), size)
        return self._last_share

    def local_size(self, step: int) -> int:
        start, stop = self._share(step)
        return stop - start

    def sizes(self, step: int) -> tuple[int, int]:
        """This rank's samples of batch ``step``, and the global batch's."""
        _, (start, stop), size = self._sizes(step)
        return stop - start, size

    def local_indices(self, step: int) -> list[int]:
        """The dataset indices of this rank's share of global batch ``step``."""
        return self.batches.indices(step, *self._share(step))

    def local_places(self, step: int) -> list[int]:
        """Where each row of ``local_indices(step)`` stands in the pass's global order (the step, then the row
        in its global batch), the same on any number of ranks."""
        start, stop = self._share(step)
        return [(step << 32) + row for row in range(start, stop)]

    def __iter__(self) -> Iterator[Indices]:
        batches, member = self.batches, self.membership
        for step in range(self.start_step, self.steps_per_epoch()):
            _, (start, stop), size = self._sizes(step)
            if size < member.size:  # every rank says so (a batch sampler's batch: a sampler's batches are checked
                # when the loader is made)
                raise ConfigError(f"global batch {step} of the batch sampler holds {size} sample(s) for "
                                  f"{member.size} data-parallel ranks: a rank would get none to train on. Make it "
                                  f"yield batches of at least {member.size} samples (drop or merge a short last one).")
            yield Indices(batches.indices(step, start, stop), self.epoch, step)


class ShardSampler(Sampler[Indices]):
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

    def place(self, epoch: int, start_step: int) -> None:
        self.epoch, self.start_step = epoch, start_step

    def set_epoch(self, epoch: int) -> None:
        """Nothing to do: an evaluation pass covers the same shard whatever the epoch (as
        ``GlobalBatchSampler.set_epoch``)."""

    def local_size(self, step: int) -> int:
        return max(0, min(self.batch_size, self.stop - self.start - step * self.batch_size))

    def local_indices(self, step: int) -> list[int]:
        first = self.start + step * self.batch_size
        return list(range(first, first + self.local_size(step)))

    def __iter__(self) -> Iterator[Indices]:
        for step in range(self.start_step, self.steps_per_epoch()):
            yield Indices(self.local_indices(step) or [0], self.epoch, step)  # [0]: a zero-row padding batch
