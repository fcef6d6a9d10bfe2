"""The layout of a job's ranks on a device mesh: data parallel (replicated × sharded) × tensor parallel.

Rank ``r`` sits at ``(replicate, shard, tp)`` coordinates in row-major order, the tensor-parallel
dimension innermost: the ranks of one tensor-parallel group are consecutive, so on one node they
share the fastest links. The data-parallel rank of ``r`` is ``r // tp``; the ``tp`` ranks of a
group see the same batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lockstep.errors import ConfigError

DIMENSIONS = ("replicate", "shard", "tp")


@dataclass(frozen=True)
class MeshLayout:
    """Degrees of each dimension; their product is the world size."""

    replicate: int
    shard: int
    tp: int

    @classmethod
    def for_world(cls, world_size: int, replicate: int = 1, tp: int = 1) -> MeshLayout:
        """The layout with the given replicate and tensor-parallel degrees; the sharded degree is the rest."""
        for name, degree in (("replicate", replicate), ("tp", tp)):
            if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
                raise ConfigError(f"FSDP({name}={degree!r}): a degree is a whole number of at least 1.")
        if world_size % (replicate * tp):
            raise ConfigError(
                f"FSDP(replicate={replicate}, tp={tp}) needs a world size divisible by {replicate * tp}, but the "
                f"job has {world_size} process(es): launch a multiple of {replicate * tp}, or change the degrees "
                "(the sharded data-parallel degree is the world size divided by replicate × tp).")
        return cls(replicate, world_size // (replicate * tp), tp)

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard * self.tp

    @property
    def data_parallel_size(self) -> int:
        """How many different batches one step sees: the ranks that are not tensor-parallel peers."""
        return self.replicate * self.shard

    def data_parallel_rank(self, rank: int) -> int:
        return rank // self.tp

    def build(self, device_type: str) -> Any:
        """The ``DeviceMesh`` over every rank, its dimensions named ``replicate``, ``shard``, ``tp``."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.replicate, self.shard, self.tp), mesh_dim_names=DIMENSIONS)


class Membership:
    """The data-parallel membership: this rank's place among the replicas that see different batches
    (``rank``), and their count (``size``). One object for a Runtime's life, read at every step by
    the training loaders, the item normaliser (``num_items``) and the gather, so that ``change``
    between two steps (a replica left or joined) re-splits the next global batch over the new
    members without rebuilding the Runtime or its loaders. The global batch of a step never changes:
    only who holds which share of it.
    """

    __slots__ = ("rank", "size")

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = 0, 1
        self.change(rank, size)

    def change(self, rank: int, size: int) -> None:
        """This rank is now member ``rank`` of ``size``; takes effect at the next batch drawn. DataLoader
        workers draw ``prefetch_factor × num_workers`` batches ahead: re-position such a loader
        (``load_state_dict`` of its position, then a new pass) to apply a change at once."""
        if not (isinstance(size, int) and isinstance(rank, int) and size >= 1 and 0 <= rank < size):
            raise ConfigError(f"data-parallel membership rank={rank!r}, size={size!r}: the rank is a whole number "
                              "from 0 to size - 1, and size is at least 1.")
        self.rank, self.size = rank, size

    def __repr__(self) -> str:
        return f"Membership(rank={self.rank}, size={self.size})"
