"""The launcher <-> worker contract: one frozen value describing where this process sits.

This module is the only place in lockstep that reads rank information from ``os.environ``.
It knows nothing of ``torch.distributed``.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from lockstep.env.launchers import Capabilities, capabilities_of
from lockstep.env.nodelist import expand_nodelist, expand_tasks_per_node
from lockstep.errors import EnvError

DEFAULT_MASTER_ADDR = "127.0.0.1"
SLURM_PORT_BASE = 10000
SLURM_PORT_SPAN = 20000




@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job.

    ``launcher`` names what started the process: ``"none"`` (a plain ``python train.py``),
    ``"torchrun"`` (torch elastic, also ``lockstep run``; ``"torchrun-slurm"`` inside a SLURM job), ``"ray"``
    (a Ray Train worker),
    ``"kubernetes"`` (torch elastic in a Kubernetes pod, e.g. a Kubeflow TrainJob), ``"torch.distributed.launch"``
    (the legacy ``--local_rank`` route), ``"lockstep.launch"``, ``"env"`` (``RANK`` and
    ``WORLD_SIZE`` set by hand), ``"slurm"`` (``srun``) or ``"mpi"`` (Open MPI, MPICH, PMI).
    ``agent_store`` is true when a torch elastic agent already hosts the rendezvous store
    on ``master_addr:master_port``, so that no worker may start one. ``restart_count`` counts the
    agent's restarts of the group (``--max-restarts``). ``elastic_store`` is the HOST:PORT of an
    elastic job's rendezvous store (``lockstep run --nodes MIN:MAX``), which outlives the workers.
    """

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int | None = None
    launcher: str = "none"
    agent_store: bool = False
    restart_count: int = 0
    elastic_store: str = ""

    @property
    def capabilities(self) -> Capabilities:
        """What the launcher that started this process can do (``lockstep.env.launchers``)."""
        return capabilities_of(self.launcher)

    def __post_init__(self) -> None:
        source = f"(launcher: {self.launcher})"
        if self.world_size < 1:
            raise EnvError(f"world size is {self.world_size} {source}; it must be at least 1.")
        if not 0 <= self.rank < self.world_size:
            raise EnvError(
                f"rank {self.rank} does not fit world size {self.world_size} {source}: ranks run "
                f"from 0 to {self.world_size - 1}. Check that every node was started with the "
                "same number of nodes and processes per node."
            )
        if not 1 <= self.local_world_size <= self.world_size:
            raise EnvError(
                f"{self.local_world_size} processes on this node do not fit world size "
                f"{self.world_size} {source}. Check the processes-per-node setting of the launcher."
            )
        if not 0 <= self.local_rank < self.local_world_size:
            raise EnvError(
                f"local rank {self.local_rank} does not fit the {self.local_world_size} "
                f"processes on this node {source}: local ranks run from 0 to "
                f"{self.local_world_size - 1}."
            )
        if not 0 <= self.node_rank < self.num_nodes:
            raise EnvError(
                f"node rank {self.node_rank} does not fit {self.num_nodes} node(s) {source}: "
                f"node ranks run from 0 to {self.num_nodes - 1}."
            )
        if self.world_size > 1 and self.master_port is None:
            raise EnvError(
                f"{self.world_size} processes but no master port {source}: set MASTER_PORT "
                "to a free port on the master node (the same value on every node)."
            )
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise EnvError(f"master port {self.master_port} is not a valid TCP port (1-65535).")

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_global_zero(self) -> bool:
        return self.rank == 0

    @property
    def is_local_zero(self) -> bool:
        return self.local_rank == 0

    @classmethod
    def from_environ(
        cls, environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None
    ) -> DistEnv:
        """Read the launcher's variables (``os.environ`` and ``sys.argv`` by default).

        Precedence: a Ray Train worker, then torch elastic / plain ``RANK``+``WORLD_SIZE`` (they also
        win inside a SLURM job, where ``lockstep run`` or ``torchrun`` may start the workers), then
        SLURM under ``srun``, then MPI, then a single process.
        """
        import sys

        env = os.environ if environ is None else environ
        args = sys.argv[1:] if argv is None else list(argv)
        legacy_local_rank = _local_rank_from_argv(args)
        for reader in (_from_ray, _from_torch_env, _from_slurm, _from_mpi):
            found = reader(env, legacy_local_rank)
            if found is not None:
                return found
        if legacy_local_rank is not None:
            raise EnvError(
                f"--local_rank={legacy_local_rank} was passed on the command line but RANK and "
                "WORLD_SIZE are not set: start the script with `python -m torch.distributed.launch`"
                ", torchrun or `lockstep run`, which set both."
            )
        return cls()


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise EnvError(f"{name} is not set; the launcher must set it for every process.")
        return default
    try:
        return int(raw)
    except ValueError:
        raise EnvError(f"{name}={raw!r} is not an integer.") from None


def _local_rank_from_argv(args: Sequence[str]) -> int | None:
    """The legacy ``torch.distributed.launch`` passes ``--local_rank=N`` or ``--local-rank N``."""
    for i, arg in enumerate(args):
        match = re.fullmatch(r"--local[_-]rank(?:=(.*))?", arg)
        if match is None:
            continue
        value = match.group(1)
        if value is None:
            value = args[i + 1] if i + 1 < len(args) else ""
        try:
            return int(value)
        except ValueError:
            raise EnvError(f"{arg} {value!r}: the local rank must be an integer.") from None
    return None


def _port(env: Mapping[str, str]) -> int | None:
    return _int(env, "MASTER_PORT") if env.get("MASTER_PORT") else None


def _from_torch_env(env: Mapping[str, str], legacy_local_rank: int | None) -> DistEnv | None:
    if "RANK" not in env and "WORLD_SIZE" not in env:
        return None
    if "RANK" not in env or "WORLD_SIZE" not in env:
        missing = "RANK" if "RANK" not in env else "WORLD_SIZE"
        raise EnvError(f"{missing} is not set while the other of RANK/WORLD_SIZE is: set both.")
    rank, world_size = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if legacy_local_rank is not None:
        launcher = "torch.distributed.launch"
        if "LOCAL_RANK" in env and _int(env, "LOCAL_RANK") != legacy_local_rank:
            raise EnvError(
                f"--local_rank={legacy_local_rank} disagrees with LOCAL_RANK={env['LOCAL_RANK']}."
            )
        local_rank = legacy_local_rank
    else:
        launcher = env.get("LOCKSTEP_LAUNCHER", "env")
        if "TORCHELASTIC_RUN_ID" in env:  # torch elastic; in a Kubernetes pod or a SLURM job, the scheduler's route
            launcher = ("kubernetes" if "KUBERNETES_SERVICE_HOST" in env
                        else "torchrun-slurm" if "SLURM_JOB_ID" in env else "torchrun")
        local_rank = _int(env, "LOCAL_RANK", default=rank if world_size == 1 else None)
    # Old launchers set no LOCAL_WORLD_SIZE: then all processes are taken to share this node.
    local_world_size = _int(env, "LOCAL_WORLD_SIZE", default=world_size)
    num_nodes = _int(env, "GROUP_WORLD_SIZE", default=max(1, world_size // max(1, local_world_size)))  # 0: said below
    node_rank = _int(env, "GROUP_RANK", default=(rank - local_rank) // max(1, local_world_size))
    return DistEnv(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        local_world_size=local_world_size,
        node_rank=node_rank,
        num_nodes=num_nodes,
        master_addr=env.get("MASTER_ADDR", DEFAULT_MASTER_ADDR),
        master_port=_port(env),
        launcher=launcher,
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true",
        restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", default=0),
        elastic_store=env.get("LOCKSTEP_ELASTIC_STORE", ""),
    )


def _from_ray(env: Mapping[str, str], legacy_local_rank: int | None) -> DistEnv | None:
    """A Ray Train worker: Ray sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK and
    MASTER_ADDR/PORT in each worker (a process of a Ray node: RAY_RAYLET_PID), and has already
    formed the process group. Nodes may hold different numbers of workers (3 on one, 1 on another):
    the node count is that of the nodes the job's placement group spans."""
    if "RAY_RAYLET_PID" not in env or "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    found = _from_torch_env(env, legacy_local_rank)
    if found is None:
        return None
    node_rank = _int(env, "NODE_RANK", default=found.node_rank)
    num_nodes = max(node_rank + 1, _ray_nodes() or found.num_nodes)
    return dataclasses.replace(found, launcher="ray", node_rank=node_rank, num_nodes=num_nodes)


def _ray_nodes() -> int | None:
    """The number of nodes this Ray worker's placement group spans (None outside one)."""
    import sys

    ray = sys.modules.get("ray")  # a Ray worker has imported ray; lockstep never imports it first
    if ray is None or not ray.is_initialized():  # asked outside a connected worker, Ray would start a cluster
        return None
    from ray.util import get_current_placement_group, placement_group_table

    group = get_current_placement_group()
    if group is None:
        return None
    bundles = placement_group_table(group).get("bundles_to_node_id") or {}
    return len(set(bundles.values())) or None


def in_srun_step(env: Mapping[str, str]) -> bool:
    """srun started this process as a task of a job step (not the batch script's shell)."""
    return "SLURM_STEP_ID" in env or "SLURM_STEPID" in env


def _in_interactive_shell(env: Mapping[str, str]) -> bool:
    """A script run from the shell of an salloc session (a job named ``bash`` or ``interactive``, Lightning's
    test): one process, also where the shell's own step counts several tasks. Unless srun started this very
    process (its parent is ``slurmstepd``): ``srun -n 2 python train.py`` typed in that shell is a step of 2."""
    return env.get("SLURM_JOB_NAME") in ("bash", "interactive") and not _started_by_slurmstepd()


def _started_by_slurmstepd() -> bool:
    try:
        with open(f"/proc/{os.getppid()}/comm") as handle:
            return handle.read().strip() == "slurmstepd"
    except OSError:  # not Linux, or the parent is gone
        return False


def _from_slurm(env: Mapping[str, str], legacy_local_rank: int | None) -> DistEnv | None:
    if "SLURM_JOB_ID" not in env or _in_interactive_shell(env):
        return None
    under_srun = in_srun_step(env)
    ntasks = _int(env, "SLURM_NTASKS", default=1)
    if not under_srun:
        if ntasks > 1:
            raise EnvError(
                f"this SLURM job asks for {ntasks} tasks but the script was started without srun, "
                "so only one process runs: start it as `srun python train.py ...` in the sbatch "
                "script (or use `lockstep slurm`), or ask for --ntasks=1 and let "
                "`lockstep run --devices N` start the processes."
            )
        return None
    world_size = _int(env, "SLURM_STEP_NUM_TASKS", default=ntasks)
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    hosts = expand_nodelist(nodelist) if nodelist else [DEFAULT_MASTER_ADDR]
    node_rank = _int(env, "SLURM_NODEID", default=0)
    per_node_spec = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if per_node_spec:
        per_node = expand_tasks_per_node(per_node_spec)
    else:
        per_node = [_int(env, "SLURM_NTASKS_PER_NODE", default=world_size)] * len(hosts)
    if sum(per_node) != world_size:
        raise EnvError(
            f"SLURM reports {world_size} tasks but {per_node_spec or per_node} tasks per node "
            f"(sum {sum(per_node)}): make --ntasks equal --nodes x --ntasks-per-node."
        )
    if node_rank >= len(per_node):
        raise EnvError(
            f"SLURM_NODEID={node_rank} but the step has only {len(per_node)} node(s) "
            f"({nodelist!r})."
        )
    port = _port(env)
    if port is None:
        port = SLURM_PORT_BASE + _int(env, "SLURM_JOB_ID") % SLURM_PORT_SPAN
    return DistEnv(
        rank=_int(env, "SLURM_PROCID"),
        local_rank=_int(env, "SLURM_LOCALID"),
        world_size=world_size,
        local_world_size=per_node[node_rank],
        node_rank=node_rank,
        num_nodes=len(per_node),
        master_addr=env.get("MASTER_ADDR", hosts[0]),
        master_port=port,
        launcher="slurm",
    )


_MPI_NAMES = (
    # rank, size, local rank, local size
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ("PMIX_RANK", "PMIX_SIZE", "PMIX_LOCAL_RANK", "PMIX_LOCAL_SIZE"),
)


def _from_mpi(env: Mapping[str, str], legacy_local_rank: int | None) -> DistEnv | None:
    for rank_name, size_name, local_rank_name, local_size_name in _MPI_NAMES:
        if rank_name not in env:
            continue
        rank, world_size = _int(env, rank_name), _int(env, size_name, default=1)
        local_world_size = _int(env, local_size_name, default=world_size)
        if local_world_size < 1:
            raise EnvError(f"{local_size_name}={local_world_size}: the processes on this node must be at least 1.")
        local_rank = _int(env, local_rank_name, default=rank % local_world_size)
        if world_size % local_world_size:
            raise EnvError(
                f"{world_size} MPI processes do not split evenly into {local_world_size} per node: "
                "start the same number of processes on every node (mpirun -npernode N)."
            )
        num_nodes = world_size // local_world_size
        if num_nodes > 1 and "MASTER_ADDR" not in env:
            raise EnvError(
                f"MPI started {world_size} processes on {num_nodes} nodes but MASTER_ADDR is not "
                "set: export MASTER_ADDR=<address of the node of rank 0> and MASTER_PORT, e.g. "
                "`mpirun -x MASTER_ADDR=node1 -x MASTER_PORT=29500 ...`."
            )
        return DistEnv(
            rank=rank,
            local_rank=local_rank,
            world_size=world_size,
            local_world_size=local_world_size,
            node_rank=rank // local_world_size,
            num_nodes=num_nodes,
            master_addr=env.get("MASTER_ADDR", DEFAULT_MASTER_ADDR),
            master_port=_port(env) or (29500 if world_size > 1 else None),
            launcher="mpi",
        )
    return None
