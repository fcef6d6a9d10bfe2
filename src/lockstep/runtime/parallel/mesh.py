"""The job's ranks on a device mesh: pipeline × data parallel (replicated × sharded) × tensor parallel.

Rank ``r`` sits at ``(pp, replicate, shard, tp)`` coordinates in row-major order, the tensor-parallel
dimension innermost: the ranks of one tensor-parallel group are consecutive, so on one node they
share the fastest links; the pipeline dimension is outermost, as its point-to-point sends are the
cheapest traffic to put across nodes. The data-parallel rank of ``r`` is
``(r // tp) % (replicate × shard)``; the ``tp × pp`` ranks that share it see the same batches.

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

DIMENSIONS = ("pp", "replicate", "shard", "tp")


@dataclass(frozen=True)
class MeshLayout:
    """Degrees of each dimension; their product is the world size."""

    replicate: int
    shard: int
    tp: int
    pp: int = 1

    @classmethod
    def for_world(cls, world_size: int, replicate: int = 1, tp: int = 1, owner: str = "FSDP",
                  pp: int = 1) -> MeshLayout:
        """The layout with the given replicate, tensor-parallel and pipeline degrees; the sharded degree is
        the rest. ``owner``: the configuration the degrees come from, as errors name it."""
        for name, degree in (("replicate", replicate), ("tp", tp), ("pp", pp)):
            if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
                raise ConfigError(f"{owner}({name}={degree!r}): a degree is a whole number of at least 1.")
        fixed = replicate * tp * pp
        if world_size % fixed:
            raise ConfigError(
                f"{owner}(replicate={replicate}, tp={tp}, pp={pp}) needs a world size divisible by {fixed}, but the "
                f"job has {world_size} process(es): launch a multiple of {fixed}, or change the degrees "
                "(the sharded data-parallel degree is the world size divided by replicate × tp × pp).")
        return cls(replicate, world_size // fixed, tp, pp)

    @property
    def world_size(self) -> int:
        return self.pp * self.replicate * self.shard * self.tp

    @property
    def batch_peers(self) -> int:
        """How many ranks see the same batches: the tensor-parallel peers of each pipeline stage."""
        return self.tp * self.pp

    @property
    def data_parallel_size(self) -> int:
        """How many different batches one step sees: the ranks that are not tensor-parallel peers."""
        return self.replicate * self.shard

    def data_parallel_rank(self, rank: int) -> int:
        return (rank // self.tp) % self.data_parallel_size

    def pipeline_rank(self, rank: int) -> int:
        """Which of the ``pp`` pipeline ranks ``rank`` is (the stages it holds follow from it)."""
        return rank // (self.data_parallel_size * self.tp)

    @property
    def trivial(self) -> bool:
        """One data-parallel dimension and nothing else: plain DDP or FSDP over every rank."""
        return self.tp == 1 and self.replicate == 1 and self.pp == 1


class Mesh:
    """A Runtime's ranks on the device mesh: its degrees, the ``DeviceMesh`` (built once, when a
    setup first needs it; never for plain DDP) and this rank's data-parallel ``membership``."""

    def __init__(self, layout: MeshLayout, rank: int, device_type: str) -> None:
        self.layout, self.device_type = layout, device_type
        self.membership = Membership(layout.data_parallel_rank(rank), layout.data_parallel_size)
        self._built: Any = None
        self._stage_group: Any = None

    @property
    def tp(self) -> int:
        """How many ranks share one batch, each computing part of every layer."""
        return self.layout.tp

    @property
    def pp(self) -> int:
        """How many pipeline ranks hold the stages of the model, one after another."""
        return self.layout.pp

    def device_mesh(self) -> Any:
        """The ``DeviceMesh`` over every rank, its dimensions named ``pp``, ``replicate``, ``shard``, ``tp``
        (a trivial layout: one unnamed dimension)."""
        if self._built is None:
            from torch.distributed.device_mesh import init_device_mesh

            layout = self.layout
            self._built = (init_device_mesh(self.device_type, (layout.world_size,)) if layout.trivial else
                           init_device_mesh(self.device_type, (layout.pp, layout.replicate, layout.shard, layout.tp),
                                            mesh_dim_names=DIMENSIONS))
        return self._built

    def stage_group(self) -> Any:
        """The process group of the ranks that hold this rank's pipeline stages (its data-parallel and
        tensor-parallel peers), made at the first call, which every rank must make."""
        if self._stage_group is None:
            import torch.distributed as dist

            size = self.layout.world_size // self.layout.pp
            self._stage_group, _ = dist.new_subgroups_by_enumeration(
                [list(range(p * size, (p + 1) * size)) for p in range(self.layout.pp)])
        return self._stage_group

    def pp_group(self) -> Any:
        """The process group of this rank's pipeline: the ``pp`` ranks that hold the stages of its copy."""
        return self.device_mesh()["pp"].get_group()

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
