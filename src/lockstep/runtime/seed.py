"""Seeding and determinism switches for python, numpy and torch."""

from __future__ import annotations

import contextlib
import hashlib
import numbers
import os
import random
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from lockstep.errors import ConfigError


def seed_everything(seed: int) -> int:
    """Seed python's ``random``, numpy (when installed) and torch on CPU and every CUDA device.

    Every rank calling this with the same seed creates the same initial weights; DDP also
    broadcasts rank 0's weights when it wraps the model, so they agree either way.
    """
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2**32:
        raise ConfigError(f"seed={seed!r}: give a whole number in [0, 2**32).")
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # numpy is optional
        pass
    torch.manual_seed(seed)  # also seeds every CUDA device
    return seed


def order_seed(seed: int, all_gather: Callable[[Any], list[Any]], world_size: int,
               say: Callable[[str], None]) -> int:
    """The seed of the data order, rank 0's: every rank must cut its share out of one order. A seed given
    per rank (``seed=42 + rank``, a habit of DDP scripts, where a sampler keeps a seed of its own) has
    seeded each rank's generators (dropout, augmentations) with its own; rank 0 says that the order follows
    its seed. One small all-gather, when the Runtime is made."""
    if world_size == 1:
        return seed
    seeds = [int(s) for s in all_gather(seed)]
    if len(set(seeds)) > 1:
        shown = ", ".join(f"rank {rank}: {s}" for rank, s in enumerate(seeds[:8])) + (", ..." if len(seeds) > 8 else "")
        say(f"lockstep: the ranks were given different seeds ({shown}): each rank's random generators are seeded "
            f"with its own; the data order follows rank 0's ({seeds[0]}), one order that every rank takes its share "
            "of.")
    return seeds[0]


def draw_fresh_seeds() -> None:
    """In a process forked from a server that imported torch (``lockstep run``'s fork server,
    ``lockstep.launch``'s forkserver): the seeds a new interpreter draws as it starts, drawn again. Each
    would otherwise keep the server's, and a script that seeds nothing would draw the same numbers on every
    rank. torch's CPU generator (the CUDA ones start from a fixed seed when CUDA starts, in the worker);
    numpy's global one where the server loaded ``numpy.random``; Python's ``random`` draws anew at every fork
    by itself. The string hash seed cannot be drawn again: it stays the server's, the same on every rank."""
    torch.default_generator.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()


def set_determinism(deterministic: bool, benchmark: bool | None) -> None:
    """``deterministic=True`` trades speed for bitwise repeatable kernels; ``benchmark`` autotunes cuDNN."""
    if deterministic:
        if benchmark:
            raise ConfigError("deterministic=True and benchmark=True contradict each other: pick one.")
        # cuBLAS needs a fixed workspace to be deterministic; it must be set before its first use.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    elif benchmark is not None:
        torch.backends.cudnn.benchmark = benchmark


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from several integers; different tuples give unrelated streams."""
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def seed_generators(seed: int, cpu_only: bool = False) -> None:
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


def seed_worker_batch(seed: int, rank: int, epoch: int, step: int) -> None:
    """In a DataLoader worker, before it makes batch ``step`` of ``epoch`` (of a dataset's or a stream's):
    torch's CPU generator, python's and numpy's seeded from (seed, rank, epoch, step) alone, whichever worker
    makes it (-2 keeps them apart from the per-sample seeds). Nothing in the main process, whose generators
    checkpoints save."""
    from torch.utils.data import get_worker_info

    if get_worker_info() is not None:
        seed_generators(mix_seed(seed, rank, -2, epoch, step), cpu_only=True)


def numpy_state() -> Any:
    try:
        import numpy as np
    except ImportError:
        return None
    return np.random.get_state()


def set_numpy_state(state: Any) -> None:
    if state is not None:
        import numpy as np

        np.random.set_state(state)


@contextlib.contextmanager
def forked_generators(seed: int) -> Iterator[None]:
    """Run a block with torch's CPU generator, python's and numpy's seeded from ``seed``; restore them after."""
    saved = random.getstate(), numpy_state()
    with torch.random.fork_rng(devices=[]):
        seed_generators(seed, cpu_only=True)
        try:
            yield
        finally:
            random.setstate(saved[0])
            set_numpy_state(saved[1])


def capture_rng() -> dict[str, Any]:
    """This process's random states (python, numpy, torch CPU and CUDA), in weights-only types."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(np.asarray(keys).astype(np.int64)), pos, has_gauss, cached]
    except ImportError:
        pass
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


class RandomStates:
    """Every rank's random states as one entry of a checkpoint's ``state``: ``rt.random_states()``.

    ``state_dict`` gathers every rank's (a collective: every rank saves); ``load_state_dict`` restores
    this rank's, on the same number of processes only (per-rank streams do not map from N ranks to M: the
    sample order still continues exactly). In a fault-tolerant job, a group that joins receives each
    rank's current states from the same rank of a live group instead.
    """

    def __init__(self, gather: Callable[[Any], list[Any]], rank: int, world_size: int,
                 say: Callable[[str], None]) -> None:
        self._gather, self._rank, self._world_size, self._say = gather, rank, world_size, say

    def state_dict(self) -> list[dict[str, Any]]:
        return self._gather(capture_rng())

    def load_state_dict(self, states: list[dict[str, Any]]) -> None:
        if len(states) == self._world_size:
            restore_rng(states[self._rank])
        else:
            self._say(f"lockstep: the checkpoint comes from {len(states)} processes, this run has "
                      f"{self._world_size}: random states are not restored (the sample order still is).")
