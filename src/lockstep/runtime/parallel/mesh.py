"""The layout of a job's ranks on a device mesh: data parallel (replicated × sharded) × tensor parallel.

Rank ``r`` sits at ``(replicate, shard, tp)`` coordinates in row-major order, the tensor-parallel
dimension innermost: the ranks of one tensor-parallel group are consecutive, so on one node they
share the fastest links. The data-parallel rank of ``r`` is ``r // tp``; the ``tp`` ranks of a
group see the same batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
                raise ValueError(f"FSDP({name}={degree!r}): a degree is a whole number of at least 1.")
        if world_size % (replicate * tp):
            raise ValueError(
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
