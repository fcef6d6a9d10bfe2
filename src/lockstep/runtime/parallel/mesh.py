"""The job's ranks on a device mesh: pipeline × data parallel (replicated × sharded) × context parallel ×
tensor parallel.

Rank ``r`` sits at ``(pp, replicate, shard, cp, tp)`` coordinates in row-major order, the tensor-parallel
dimension innermost: the ranks of one tensor-parallel group are consecutive, so on one node they
share the fastest links; the context-parallel ring next; the pipeline dimension is outermost, as its
point-to-point sends are the cheapest traffic to put across nodes. The data-parallel rank of ``r`` is
``(r // (cp × tp)) % (replicate × shard)``; the ``cp × tp × pp`` ranks that share it see the same rows
(the cp ranks each take their part of every row's sequence).

``Parallel`` is what a user asks for (public: ``lockstep.Parallel(tp=2, pp=2)``), given once to the
Runtime or the Trainer; ``MeshLayout`` holds the degrees it resolves to on a world size (the sharded
degree is the rest), and answers the rank questions (which data-parallel rank, which pipeline rank,
which ranks hold a copy of the same rows); ``Mesh`` is the one built object of a Runtime: the layout,
its ``DeviceMesh`` (made once, at the first setup that needs it) and this rank's data-parallel
``Membership``. A new dimension (context parallel) is one more degree here, outside the data-parallel
and tensor-parallel ones that the loaders, ``num_items``, ``gather`` and the FLOP count read.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from lockstep.env import DistEnv
from lockstep.errors import ConfigError
from lockstep.runtime._torch_compat import flatten_mesh
from lockstep.runtime.parallel.context import ContextParallel
from lockstep.runtime.parallel.pipeline.stages import check_settings
from lockstep.runtime.parallel.tensor_parallel import Plan

DIMENSIONS = ("pp", "replicate", "shard", "cp", "tp")
#: what a strategy took before ``lockstep.Parallel`` held the degrees
MOVED = ("tp", "pp", "replicate", "cp", "tp_plan", "pp_schedule", "pp_microbatches", "pp_stages")
_Class = TypeVar("_Class", bound=type)


def refuses_degrees(cls: _Class) -> _Class:
    """A strategy whose constructor, given a degree, names where degrees go now (``lockstep.Parallel``)."""
    init: Callable[..., None] = cls.__init__  # type: ignore[misc]

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        moved = [name for name in kwargs if name in MOVED]
        if moved:
            given = ", ".join(f"{name}={kwargs[name]!r}" for name in moved)
            raise ConfigError(f"{cls.__name__}({given}): the degrees of the mesh are given once, as "
                              f"Runtime(parallel=lockstep.Parallel({given})) (or Trainer(parallel=...)); "
                              f"{cls.__name__} keeps only its own options.")
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[misc]
    return cls


def parallel_from_text(text: str) -> Parallel:
    """``Parallel`` from ``lockstep run --parallel`` (``LOCKSTEP_PARALLEL``): ``tp=2,pp=2,pp_schedule=GPipe``, the
    degrees, ``pp_schedule`` and ``pp_microbatches`` (a plan or named stages are the script's to give)."""
    given: dict[str, Any] = {}
    for part in filter(None, (piece.strip() for piece in text.split(","))):
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in ("tp", "pp", "replicate", "cp", "pp_schedule", "pp_microbatches") or not value:
            raise ConfigError(f"parallel {text!r}: give NAME=VALUE pairs separated by commas, NAME one of tp, pp, "
                              "replicate, cp, pp_schedule, pp_microbatches (e.g. tp=2,pp=2).")
        if name == "pp_schedule":
            given[name] = value.strip()
            continue
        try:
            given[name] = int(value)
        except ValueError:
            raise ConfigError(f"parallel {text!r}: {name}={value!r} is not a whole number.") from None
    return Parallel(**given)


def check_ranks_agree(strategy: str, precision: str, parallel: Parallel, all_gather: Callable[[Any], list[Any]],
                      env: DistEnv) -> None:
    """Every rank was given the same strategy, precision and layout; else each says so at once, before any
    collective of the layout's shapes (a rank with other degrees or another plan would meet the others in
    collectives of other shapes and wait out the timeout; one with another precision would train on, its
    gradients averaged with theirs)."""
    if env.world_size == 1:
        return
    mine = f"strategy {strategy!r}, precision {precision!r}, {parallel.signature()}, {env.num_nodes} node(s)"
    everyone = all_gather(mine)
    if any(theirs != mine for theirs in everyone):
        shown = "; ".join(f"rank {rank}: {theirs}" for rank, theirs in enumerate(everyone))
        raise ConfigError(f"the ranks were given different layouts ({shown}): give every rank the same strategy, "
                          "precision and Parallel (the same arguments to Runtime or Trainer, the same --precision "
                          "and --parallel on every node), and start every node with the same --nodes.")


@dataclass(frozen=True)
class Parallel:
    """How the job's ranks split the work besides data parallel: one frozen value, given as
    ``Runtime(parallel=...)`` or ``Trainer(parallel=...)``, with any strategy that runs one process per
    device (DDP, FSDP). The data-parallel degree is what is left: ``world_size / (tp × pp × cp)`` ranks see
    different batches (docs/parallelism.md).

    Args:
        tp: ranks that split each weight of ``tp_plan`` (tensor parallel; a Hugging Face model's own plan
            by default); they see the same batches.
        pp: ranks that each hold consecutive stages of the model (pipeline parallel), cut by layer or by
            module names per stage in ``pp_stages``, run by torch's schedule ``pp_schedule`` (``"1F1B"``,
            ``"GPipe"``, ``"Interleaved1F1B"``, ``"LoopedBFS"``, ``"InterleavedZeroBubble"``,
            ``"ZBVZeroBubble"``, ``"DualPipeV"``) over ``pp_microbatches`` micro-batches of each rank's
            batch (default: the number of stages). A step is ``rt.forward_backward(model, batch, loss_fn)``.
        replicate: with FSDP, groups that each hold a whole sharded copy (HSDP); the rest of the
            data-parallel ranks shard. With DDP every data-parallel rank holds a whole copy: leave it
            unset (another value than the data-parallel degree is refused).
        cp: ranks that each take a part of every row's sequence (context parallel): a training batch's
            sequence dimension is cut into ``2 × cp`` chunks, rank ``i`` of the ring taking chunks ``i`` and
            ``2 × cp - 1 - i`` (the load balance of causal attention), and causal attention runs as a ring
            over them (docs/parallelism.md, "Context parallel"). They see the same rows; gradients are
            averaged over the data-parallel and context-parallel ranks together.

    With DDP (or ``"auto"``), tensor or pipeline parallel means data parallel by replication on the mesh:
    FSDP2's ``fully_shard`` over a ``(replicate = data-parallel degree, shard = 1)`` mesh, which
    all-reduces gradients and shards nothing, so checkpoints reshard as FSDP's do
    (``DistributedDataParallel``'s own route to tensor parallel keeps no DTensors in its state_dict).
    On one process every degree is 1: the model runs unsplit, the mesh's one-process reference.
    """

    tp: int = 1
    pp: int = 1
    replicate: int | None = None
    cp: int = 1
    tp_plan: Plan | None = None
    pp_schedule: str = "1F1B"
    pp_microbatches: int | None = None
    pp_stages: Sequence[Sequence[str]] | None = None

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "replicate", "cp"):
            degree = getattr(self, name)
            if degree is None and name == "replicate":
                continue
            if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
                raise ConfigError(f"Parallel({name}={degree!r}): a degree is a whole number of at least 1.")
        if self.cp > 1 and self.pp > 1:
            raise ConfigError(f"Parallel(cp={self.cp}, pp={self.pp}): context parallel with pipeline parallel is not "
                              "supported (torch's pipeline schedules cut the batch's rows, the ring its sequence, and "
                              "neither knows the other): use cp with data and tensor parallel, or pp without cp.")
        check_settings(self.pp, self.pp_schedule, self.pp_microbatches, self.pp_stages, "Parallel")

    def __repr__(self) -> str:
        """The degrees and options given (those that differ from the defaults)."""
        given = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self) if getattr(self, f.name) != f.default]
        return f"Parallel({', '.join(given)})"

    def signature(self) -> str:
        """What every rank must have alike, as text that compares across processes: a plan function by its
        name, a style object by its class."""
        plan: Any = self.tp_plan
        if callable(plan) and not isinstance(plan, Mapping):
            plan = f"function {getattr(plan, '__qualname__', type(plan).__name__)}"
        elif plan is not None:
            plan = sorted((name, style if isinstance(style, str) else type(style).__name__)
                          for name, style in plan.items())
        return repr(Parallel(self.tp, self.pp, self.replicate, self.cp, plan, self.pp_schedule,  # type: ignore[arg-type]
                             self.pp_microbatches, self.pp_stages))

    @property
    def trivial(self) -> bool:
        """Nothing but data parallel: every rank holds the whole model and sees batches of its own."""
        return self.tp == 1 and self.pp == 1 and self.cp == 1 and self.replicate in (None, 1)

    def pipeline_settings(self) -> tuple[str, int]:
        """The pipeline schedule's own name and its number of micro-batches."""
        return check_settings(self.pp, self.pp_schedule, self.pp_microbatches, self.pp_stages, "Parallel")

    def layout(self, world_size: int, shards: bool) -> MeshLayout:
        """The degrees on ``world_size`` ranks. ``shards``: the data-parallel ranks shard (FSDP) beyond
        ``replicate``; else every data-parallel rank replicates (DDP)."""
        fixed = self.tp * self.pp * self.cp
        if world_size % fixed:
            raise ConfigError(
                f"{self!r} needs a world size divisible by tp × pp × cp = {fixed}, but the job has {world_size} "
                f"process(es): launch a multiple of {fixed}, or change the degrees.")
        data_parallel = world_size // fixed
        if shards:
            return MeshLayout.for_world(world_size, self.replicate or 1, self.tp, owner="Parallel", pp=self.pp,
                                        cp=self.cp)
        if self.replicate not in (None, data_parallel):
            raise ConfigError(
                f"Parallel(replicate={self.replicate}) with DDP: every data-parallel rank holds a whole copy, "
                f"{data_parallel} here (world size {world_size} / tp × pp × cp): leave replicate unset, or use "
                "strategy='fsdp' to shard within the replicas (HSDP).")
        return MeshLayout(data_parallel, 1, self.tp, self.pp, self.cp)


@dataclass(frozen=True)
class MeshLayout:
    """Degrees of each dimension; their product is the world size."""

    replicate: int
    shard: int
    tp: int
    pp: int = 1
    cp: int = 1

    @classmethod
    def for_world(cls, world_size: int, replicate: int = 1, tp: int = 1, owner: str = "FSDP",
                  pp: int = 1, cp: int = 1) -> MeshLayout:
        """The layout with the given replicate, tensor-parallel, pipeline and context-parallel degrees; the
        sharded degree is the rest. ``owner``: the configuration the degrees come from, as errors name it."""
        for name, degree in (("replicate", replicate), ("tp", tp), ("pp", pp), ("cp", cp)):
            if not isinstance(degree, int) or isinstance(degree, bool) or degree < 1:
                raise ConfigError(f"{owner}({name}={degree!r}): a degree is a whole number of at least 1.")
        fixed = replicate * tp * pp * cp
        if world_size % fixed:
            raise ConfigError(
                f"{owner}(replicate={replicate}, tp={tp}, pp={pp}, cp={cp}) needs a world size divisible by "
                f"{fixed}, but the job has {world_size} process(es): launch a multiple of {fixed}, or change the "
                "degrees (the sharded data-parallel degree is the world size divided by replicate × tp × pp × cp).")
        return cls(replicate, world_size // fixed, tp, pp, cp)

    @property
    def world_size(self) -> int:
        return self.pp * self.replicate * self.shard * self.cp * self.tp

    @property
    def batch_peers(self) -> int:
        """How many ranks see the same rows: the context- and tensor-parallel peers of each pipeline stage."""
        return self.cp * self.tp * self.pp

    @property
    def gradient_peers(self) -> int:
        """How many ranks each gradient is averaged over: the data-parallel and context-parallel ranks (the
        cp ranks hold the same weights and compute gradients of different tokens)."""
        return self.data_parallel_size * self.cp

    def context_rank(self, rank: int) -> int:
        """Which of the ``cp`` ranks of its ring ``rank`` is (the chunks of the sequence it takes)."""
        return (rank // self.tp) % self.cp

    @property
    def data_parallel_size(self) -> int:
        """How many different batches one step sees: the ranks that are not tensor-parallel peers."""
        return self.replicate * self.shard

    def data_parallel_rank(self, rank: int) -> int:
        return (rank // (self.tp * self.cp)) % self.data_parallel_size

    def pipeline_rank(self, rank: int) -> int:
        """Which of the ``pp`` pipeline ranks ``rank`` is (the stages it holds follow from it)."""
        return rank // (self.data_parallel_size * self.cp * self.tp)

    @property
    def trivial(self) -> bool:
        """One data-parallel dimension and nothing else: plain DDP or FSDP over every rank."""
        return self.tp == 1 and self.replicate == 1 and self.pp == 1 and self.cp == 1

    @property
    def stage_size(self) -> int:
        """How many ranks hold each pipeline stage (its data-parallel and tensor-parallel ranks)."""
        return self.world_size // self.pp

    @property
    def parameter_holders(self) -> int:
        """Under pipeline parallel, how many ranks hold each parameter (its stage's); 0 without: every rank
        holds every parameter (sharded or not)."""
        return self.stage_size if self.pp > 1 else 0

    def first_of_stage(self, rank: int) -> int:
        """The first rank that holds ``rank``'s pipeline stages."""
        return self.pipeline_rank(rank) * self.stage_size

    def keeps_rows(self, rank: int) -> bool:
        """Whether ``rank`` is the one of its batch peers (tensor- and context-parallel peers, later pipeline
        ranks) that keeps the rows they all hold: the first tp and cp rank of the first pipeline rank."""
        return rank % (self.tp * self.cp) == 0 and self.pipeline_rank(rank) == 0

    def speaks_for_stage(self, rank: int) -> bool:
        """Whether ``rank`` is the one rank that sends its pipeline stage's state (its first)."""
        return self.data_parallel_rank(rank) == 0 and rank % (self.tp * self.cp) == 0


class Mesh:
    """A Runtime's ranks on the device mesh: its degrees, the ``DeviceMesh`` (built once, when a
    setup first needs it; never for plain DDP) and this rank's data-parallel ``membership``."""

    def __init__(self, layout: MeshLayout, rank: int, device_type: str) -> None:
        self.layout, self.device_type = layout, device_type
        self.membership = Membership(layout.data_parallel_rank(rank), layout.data_parallel_size)
        self._built: Any = None
        self._stage_group: Any = None
        context = ContextParallel(layout.cp, layout.context_rank(rank), self.cp_group) if layout.cp > 1 else None
        #: context parallel: what a training loader makes of each batch (this rank's part of every row's
        #: sequence), and what a forward on such a batch runs in (attention as a ring); None without
        self.cut: Callable[[Any, Callable[[Any], Any]], Any] | None = context.cut if context is not None else None
        self.ring: Callable[[Any, Any, bool], contextlib.AbstractContextManager[None] | None] | None = (
            context.forward if context is not None else None)

    @property
    def tp(self) -> int:
        """How many ranks share one batch, each computing part of every layer."""
        return self.layout.tp

    @property
    def pp(self) -> int:
        """How many pipeline ranks hold the stages of the model, one after another."""
        return self.layout.pp

    def device_mesh(self) -> Any:
        """The ``DeviceMesh`` over every rank, its dimensions named ``pp``, ``replicate``, ``shard``, ``cp``,
        ``tp`` (a trivial layout: one unnamed dimension)."""
        if self._built is None:
            from torch.distributed.device_mesh import init_device_mesh

            layout = self.layout
            self._built = (init_device_mesh(self.device_type, (layout.world_size,)) if layout.trivial else
                           init_device_mesh(self.device_type, (layout.pp, layout.replicate, layout.shard, layout.cp,
                                                                layout.tp), mesh_dim_names=DIMENSIONS))
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
        """What FSDP shards (and replicates) over: ``(replicate, shard)`` with ``replicate > 1``, else ``shard``.
        Context-parallel ranks hold the same weights: they join the sharded dimension (``shard_cp``, as
        torchtitan's ``dp_shard_cp``), also where the data-parallel ranks replicate (DDP on the mesh)."""
        mesh, layout = self.device_mesh(), self.layout
        if layout.trivial:
            return mesh
        shard = "shard"
        if layout.cp > 1:
            with warnings.catch_warnings():  # torch's note on slicing a flattened dimension from the root mesh
                warnings.simplefilter("ignore", UserWarning)
                shard = flatten_mesh(mesh["shard", "cp"], "shard_cp").mesh_dim_names[0]
                return mesh["replicate", shard] if layout.replicate > 1 else mesh[shard]
        return mesh["replicate", shard] if layout.replicate > 1 else mesh[shard]

    def cp_group(self) -> Any:
        """The process group of this rank's context-parallel ring (its ``cp`` peers)."""
        return self.device_mesh()["cp"].get_group()


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
