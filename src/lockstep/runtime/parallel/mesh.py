"""The job's ranks on a device mesh: data parallel (replicated × sharded) × tensor parallel.

Rank ``r`` sits at ``(replicate, shard, tp)`` coordinates in row-major order, the tensor-parallel
dimension innermost: the ranks of one tensor-parallel group are consecutive, so on one node they
share the fastest links. The data-parallel rank of ``r`` is ``r // tp``; the ``tp`` ranks of a
group see the same batches.

``MeshLayout`` holds the degrees (a value: strategies compute it from their configuration);
``Mesh`` is the one built object of a Runtime: the layout, its ``DeviceMesh`` (made once, at the
first setup that needs it) and this rank's data-parallel ``Membership``. A new dimension (pipeline
or context parallel) is one more degree here, outside the data-parallel and tensor-parallel ones
that the loaders, ``num_items``, ``gather`` and the FLOP count read.
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
    def for_world(cls, world_size: int, replicate: int = 1, tp: int = 1, owner: str = "FSDP") -> MeshLayout:
        """The layout with the given replicate and tensor-parallel degrees; the sharded degree is the rest.
        ``owner``: the configuration the degrees come from, as errors name it."""
        for name, degree in (("replicate", replicate), ("tp", tp)):
            if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
                raise ConfigError(f"{owner}({name}={degree!r}): a degree is a whole number of at least 1.")
        if world_size % (replicate * tp):
            raise ConfigError(
                f"{owner}(replicate={replicate}, tp={tp}) needs a world size divisible by {replicate * tp}, but the "
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

    @property
    def trivial(self) -> bool:
        """One data-parallel dimension and nothing else: plain DDP or FSDP over every rank."""
        return self.tp == 1 and self.replicate == 1


class Mesh:
    """A Runtime's ranks on the device mesh: its degrees, the ``DeviceMesh`` (built once, when a
    setup first needs it; never for plain DDP) and this rank's data-parallel ``membership``."""

    def __init__(self, layout: MeshLayout, rank: int, device_type: str) -> None:
        self.layout, self.device_type = layout, device_type
        self.membership = Membership(layout.data_parallel_rank(rank), layout.data_parallel_size)
        self._built: Any = None

    @property
    def tp(self) -> int:
        """How many ranks share one batch, each computing part of every layer."""
        return self.layout.tp

    def device_mesh(self) -> Any:
        """The ``DeviceMesh`` over every rank, its dimensions named ``replicate``, ``shard``, ``tp``
        (a trivial layout: one unnamed dimension)."""
        if self._built is None:
            from torch.distributed.device_mesh import init_device_mesh

            layout = self.layout
            self._built = (init_device_mesh(self.device_type, (layout.world_size,)) if layout.trivial else
                           init_device_mesh(self.device_type, (layout.replicate, layout.shard, layout.tp),
                                            mesh_dim_names=DIMENSIONS))
        return self._built

    def tp_mesh(self) -> Any:
        """The tensor-parallel dimension (this rank's group of ``tp`` peers)."""
        return self.device_mesh()["tp"]

    def data_mesh(self) -> Any:
        """What FSDP shards (and replicates) over: ``(replicate, shard)`` with ``replicate > 1``, else ``shard``."""
        mesh = self.device_mesh()
        if self.layout.trivial:
            return mesh
        return mesh["replicate", "shard"] if self.layout.replicate > 1 else mesh["shard"]


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
        """This rank is now member ``rank`` of ``size``, from the next batch a training loader hands out
        (one whose DataLoader workers drew batches ahead drops them and draws again). A stream's
        loader applies it from the next pass: re-position it (``load_state_dict`` of its position)."""
        if not (isinstance(size, int) and isinstance(rank, int) and size >= 1 and 0 <= rank < size):
            raise ConfigError(f"data-parallel membership rank={rank!r}, size={size!r}: the rank is a whole number "
                              "from 0 to size - 1, and size is at least 1.")
        self.rank, self.size = rank, size

    def __repr__(self) -> str:
        return f"Membership(rank={self.rank}, size={self.size})"
