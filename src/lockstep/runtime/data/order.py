"""The global order: which dataset indices each global batch of an epoch holds.

Every rank builds the same order from (seed, epoch), whatever the world size; the loader then
splits each global batch over the ranks. An order is one of:

- ``FixedBatches`` over an index sequence cut into batches of ``batch_size``: the dataset in order,
  a seeded shuffle, or the indices a user's sampler yields;
- ``SamplerBatches``: the batches a user's batch sampler yields.

The shuffle is ``torch.randperm`` up to ``RANDPERM_MAX`` samples and a keyed Feistel permutation
above, evaluated lazily for the positions a batch needs: starting or resuming an epoch of 10^9
samples costs no time or memory that grows with n. Which one a given n uses is part of the
checkpoint format (the loader's state names it), so it stays fixed from release to release.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
import torch

from lockstep.errors import ConfigError, UsageError
from lockstep.runtime.seed import forked_generators, mix_seed

RANDPERM_MAX = 2**24  # the largest n shuffled with randperm (format "randperm"); above: "feistel-1"
_ROUNDS = 8
_M32 = 0xFFFFFFFF
# Odd multipliers below 2**31: a 32-bit value times one stays below 2**63, so int64 never overflows.
_MUL = (0x2C1B3C6D, 0x297A2D39)


def split_evenly(total: int, parts: int, part: int) -> tuple[int, int]:
    """``[start, stop)`` of ``part`` when ``total`` items are cut into ``parts`` near-equal runs."""
    base, extra = divmod(total, parts)
    start = part * base + min(part, extra)
    return start, start + base + (1 if part < extra else 0)


class FeistelPermutation:
    """A keyed bijection of [0, n), evaluated element-wise: a balanced Feistel network on the
    smallest even number of bits that holds n, with cycle-walking (a value that lands at n or
    above is encrypted again until it falls below n; the domain is at most 4n, so this takes
    fewer than 4 rounds of the network on average). Black and Rogaway, "Ciphers with Arbitrary
    Finite Domains" (CT-RSA 2002)."""

    def __init__(self, n: int, seed: int) -> None:
        if n < 1:
            raise ConfigError(f"a permutation of [0, {n}) is empty")
        bits = max(2, (n - 1).bit_length())
        self.n, self.half = n, (bits + 1) // 2
        self.mask = (1 << self.half) - 1
        self.keys = [mix_seed(seed, round_) & _M32 for round_ in range(_ROUNDS)]

    def _round(self, right: torch.Tensor, key: int) -> torch.Tensor:
        x = right ^ key
        x = (x * _MUL[0]) & _M32
        x = x ^ (x >> 15)
        x = (x * _MUL[1]) & _M32
        x = x ^ (x >> 13)
        return x & self.mask

    def _encrypt(self, x: torch.Tensor) -> torch.Tensor:
        left, right = x >> self.half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ self._round(right, key)
        return (left << self.half) | right

    def __call__(self, positions: torch.Tensor) -> torch.Tensor:
        """The images of ``positions`` (int64, each in [0, n))."""
        out = self._encrypt(positions.to(torch.int64))
        outside = out >= self.n
        while bool(outside.any()):
            out[outside] = self._encrypt(out[outside])
            outside = out >= self.n
        return out


class IndexSequence(Protocol):
    """An epoch's global index sequence, read by slices."""

    @property
    def kind(self) -> str: ...

    def set_epoch(self, epoch: int) -> None: ...
    def __len__(self) -> int: ...
    def take(self, start: int, stop: int) -> list[int]: ...


class Arange:
    kind = "sequential"

    def __init__(self, n: int) -> None:
        self.n = n

    def set_epoch(self, epoch: int) -> None:
        pass

    def __len__(self) -> int:
        return self.n

    def take(self, start: int, stop: int) -> list[int]:
        return list(range(start, min(stop, self.n)))


class Shuffled:
    """A permutation of [0, n) seeded by (seed, epoch): randperm for small n, Feistel above."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed = n, seed
        self.kind = "randperm" if n <= RANDPERM_MAX else "feistel-1"
        self._epoch: int | None = None
        self._perm: np.ndarray | FeistelPermutation | None = None  # numpy: slices become lists fastest

    def set_epoch(self, epoch: int) -> None:
        if epoch == self._epoch:
            return
        seed = mix_seed(self.seed, epoch)
        if self.kind == "randperm":
            self._perm = torch.randperm(self.n, generator=torch.Generator().manual_seed(seed)).numpy()
        else:
            self._perm = FeistelPermutation(self.n, seed)
        self._epoch = epoch

    def __len__(self) -> int:
        return self.n

    def take(self, start: int, stop: int) -> list[int]:
        stop = min(stop, self.n)
        if isinstance(self._perm, np.ndarray):
            return self._perm[start:stop].tolist()
        assert self._perm is not None, "set_epoch first"
        return self._perm(torch.arange(start, stop, dtype=torch.int64)).numpy().tolist()


@contextlib.contextmanager
def seeded(sampler: Any, seed: int, epoch: int) -> Iterator[None]:
    """Iterate a user's sampler (or batch sampler) the same way on every rank: its ``generator``
    (and its inner sampler's) and torch's, python's and numpy's global generators are seeded from
    ``seed`` for the block, and ``set_epoch(epoch)`` is called where the sampler has it."""
    both = [s for s in (sampler, getattr(sampler, "sampler", None)) if s is not None]
    holders = [s for s in both if hasattr(s, "generator")]
    saved = [s.generator for s in holders]
    for s in both:
        if callable(getattr(s, "set_epoch", None)):
            s.set_epoch(epoch)
    with forked_generators(seed):
        for s in holders:
            s.generator = torch.Generator().manual_seed(seed)
        try:
            yield
        finally:
            for s, generator in zip(holders, saved, strict=True):
                s.generator = generator


def _check_index(index: Any, what: str) -> int:
    if isinstance(index, torch.Tensor) and index.numel() == 1:
        index = index.item()
    if isinstance(index, (bool, torch.Tensor)) or not hasattr(type(index), "__index__"):
        raise UsageError(f"the {what} yielded {index!r}: lockstep expects dataset indices (ints).")
    return operator.index(index)  # an int, or numpy's (a sampler over np.arange)


class FromSampler:
    """The indices a user's sampler yields this epoch, drawn the same on every rank."""

    kind = "sampler"

    def __init__(self, sampler: Any, seed: int) -> None:
        self.sampler, self.seed = sampler, seed
        self._epoch: int | None = None
        self._indices: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        if epoch != self._epoch:
            with seeded(self.sampler, mix_seed(self.seed, epoch), epoch):
                self._indices = [_check_index(i, "sampler") for i in self.sampler]
            self._epoch = epoch

    def __len__(self) -> int:
        return len(self._indices) if self._epoch is not None else len(self.sampler)

    def take(self, start: int, stop: int) -> list[int]:
        return self._indices[start:stop]


class Batches(Protocol):
    """An epoch's global batches."""

    @property
    def kind(self) -> str: ...

    def set_epoch(self, epoch: int) -> None: ...
    def __len__(self) -> int: ...
    def size(self, step: int) -> int: ...
    def indices(self, step: int, start: int, stop: int) -> list[int]: ...


class FixedBatches:
    """An index sequence cut into global batches of ``batch_size`` (the last one shorter, or dropped)."""

    def __init__(self, sequence: IndexSequence, batch_size: int, drop_last: bool) -> None:
        self.sequence, self.batch_size, self.drop_last = sequence, batch_size, drop_last

    @property
    def kind(self) -> str:
        return self.sequence.kind

    def set_epoch(self, epoch: int) -> None:
        self.sequence.set_epoch(epoch)

    def __len__(self) -> int:
        full, rest = divmod(len(self.sequence), self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def size(self, step: int) -> int:
        return min(self.batch_size, len(self.sequence) - step * self.batch_size)

    def indices(self, step: int, start: int, stop: int) -> list[int]:
        first = step * self.batch_size
        return self.sequence.take(first + start, first + stop)


class SamplerBatches:
    """The global batches a user's batch sampler yields this epoch, drawn the same on every rank."""

    kind = "batch_sampler"

    def __init__(self, batch_sampler: Any, seed: int) -> None:
        self.batch_sampler, self.seed = batch_sampler, seed
        self._epoch: int | None = None
        self._batches: list[list[int]] = []

    def set_epoch(self, epoch: int) -> None:
        if epoch == self._epoch:
            return
        with seeded(self.batch_sampler, mix_seed(self.seed, epoch), epoch):
            self._batches = [[_check_index(i, "batch_sampler") for i in batch] for batch in self.batch_sampler]
        if any(not batch for batch in self._batches):
            raise ConfigError("the batch_sampler yielded an empty batch: every global batch needs samples.")
        self._epoch = epoch

    def __len__(self) -> int:
        if self._epoch is None:
            try:
                return len(self.batch_sampler)
            except TypeError:  # no __len__: draw epoch 0 to count
                self.set_epoch(0)
        return len(self._batches)

    def size(self, step: int) -> int:
        return len(self._batches[step])

    def indices(self, step: int, start: int, stop: int) -> list[int]:
        return self._batches[step][start:stop]
