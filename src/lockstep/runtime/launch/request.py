"""``RunRequest``: what ``lockstep run`` was asked, as one plain value (the command line's options, or a
program's own), which every engine plans from; the defaults an orchestrator fills in; the script's check."""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lockstep.env.distenv import in_srun_step
from lockstep.errors import PreflightError


@dataclass(frozen=True)
class RunRequest:
    """``lockstep run``'s options (``lockstep run --help`` says each); None: not given."""

    script: str
    script_args: tuple[str, ...] = ()
    module: bool = False  # ``-m``: script is a module name
    devices: str | None = None
    accelerator: str = "auto"
    nodes: str | None = None
    node_rank: int | None = None
    master: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_id: str = "lockstep"
    rdzv_conf: str | None = None
    max_restarts: int | None = None
    fault_tolerant: bool = False
    replicas: int | None = None
    min_replicas: int | None = None
    step_timeout: float | None = None
    engine: str = "torch"
    storage: str | None = None
    name: str | None = None
    resize_interval: float | None = None
    keep_checkpoints: int | None = None
    strategy: str | None = None
    precision: str | None = None
    parallel: str | None = None
    rank_prefix: bool = False
    show_ranks: str | None = None

    @classmethod
    def from_options(cls, options: Any) -> RunRequest:
        """From parsed options (an ``argparse.Namespace``, or any object with these attributes)."""
        values = {f.name: getattr(options, f.name) for f in dataclasses.fields(cls) if hasattr(options, f.name)}
        values["script_args"] = tuple(values.get("script_args") or ())
        return cls(**values)

    def replace(self, **changes: Any) -> RunRequest:
        return dataclasses.replace(self, **changes)

    def runtime_choices(self) -> dict[str, str]:
        """``--accelerator/--strategy/--precision/--parallel`` as given (``auto`` is no choice): what the workers'
        Runtime takes when the script leaves them unset."""
        return {name: value for name in ("accelerator", "strategy", "precision", "parallel")
                if (value := getattr(self, name)) and value != "auto"}

    def output_variables(self) -> dict[str, str]:
        """``--rank-prefix/--show-ranks`` as the variables each worker's ``import lockstep`` reads
        (``lockstep.env.lines``); a malformed ``--show-ranks`` is refused here, before any worker starts."""
        from lockstep.env.lines import PREFIX_VARIABLE, SHOW_VARIABLE, shown_ranks
        from lockstep.errors import ConfigError

        variables = {PREFIX_VARIABLE: "1"} if self.rank_prefix else {}
        if self.show_ranks is not None:
            try:
                ranks = shown_ranks(self.show_ranks, "--show-ranks")
            except ConfigError as error:
                raise PreflightError(str(error)) from None
            variables[SHOW_VARIABLE] = ",".join(str(rank) for rank in sorted(ranks))
        return variables


#: What Kubeflow Trainer's torch runtime puts in each node's pod (as torchrun reads them): the node
#: count, processes per node ("auto" or a count), this pod's node rank (its Job completion index), and
#: node 0's address (``<job>-node-0-0.<job>``, the headless service) and port.
KUBEFLOW_VARIABLES = ("PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")


def with_orchestrator_defaults(request: RunRequest, environ: Mapping[str, str]) -> tuple[RunRequest, list[str]]:
    """The options not given (None) filled from Kubeflow Trainer's ``PET_*`` variables when they are set, as
    torchrun does, so that ``lockstep run train.py`` is a TrainJob's entrypoint; with several nodes and no
    master, from ``MASTER_ADDR`` and ``MASTER_PORT`` (a job script's exports); else from the usual
    defaults. Returns the request and the lines that say what was taken."""
    _one_task_per_node(environ)
    pet = {name: environ[name] for name in KUBEFLOW_VARIABLES if environ.get(name)}
    changes: dict[str, Any] = {}
    if request.nodes is None and "PET_NNODES" in pet:
        changes["nodes"] = pet["PET_NNODES"]
    if request.node_rank is None and "PET_NODE_RANK" in pet:
        try:
            changes["node_rank"] = int(pet["PET_NODE_RANK"])
        except ValueError:
            raise PreflightError(f"PET_NODE_RANK={pet['PET_NODE_RANK']!r}: a node rank is a whole number.") from None
    if request.devices is None and "PET_NPROC_PER_NODE" in pet:
        changes["devices"] = pet["PET_NPROC_PER_NODE"]
    nodes = changes.get("nodes", request.nodes)
    several = nodes is not None and str(nodes) not in ("1", "1:1")
    if (several and not (request.master or request.rdzv_endpoint)
            and {"PET_MASTER_ADDR", "PET_MASTER_PORT"} <= set(pet)):
        changes["master"] = f"{pet['PET_MASTER_ADDR']}:{pet['PET_MASTER_PORT']}"
    options = {"nodes": "--nodes", "node_rank": "--node-rank", "devices": "--devices", "master": "--master"}
    taken = [f"{options[name]} {changes[name]}" for name in options if name in changes]
    notes = [f"from Kubeflow Trainer's PET_* variables: {' '.join(taken)}"] if taken else []
    if several and not (request.master or request.rdzv_endpoint or "master" in changes) \
            and environ.get("MASTER_ADDR") and environ.get("MASTER_PORT"):  # as a job script exports them
        changes["master"] = f"{environ['MASTER_ADDR']}:{environ['MASTER_PORT']}"
        notes.append(f"from MASTER_ADDR and MASTER_PORT: --master {changes['master']}")
    filled = request.replace(**changes)
    filled = filled.replace(nodes="1" if filled.nodes is None else filled.nodes,
                            node_rank=0 if filled.node_rank is None else filled.node_rank,
                            devices="auto" if filled.devices is None else filled.devices)
    return filled, notes


def _one_task_per_node(environ: Mapping[str, str]) -> None:
    """``lockstep run`` starts its node's processes itself: as one of several srun tasks on a node (an sbatch
    script's ``--ntasks-per-node=2`` kept with ``srun lockstep run``), each task would start a job of its own."""
    if not in_srun_step(environ):
        return
    try:
        tasks, nodes = int(environ.get("SLURM_STEP_NUM_TASKS", "1")), int(environ.get("SLURM_STEP_NUM_NODES", "1"))
    except ValueError:
        return
    if tasks > nodes:
        raise PreflightError(f"srun started {tasks} tasks on {nodes} node(s) here, each running lockstep run, which "
                             "starts its node's processes itself: each task would run a job of its own. Ask srun for "
                             "one task per node (--ntasks-per-node=1) and give lockstep run --devices N, or drop "
                             "lockstep run and let srun start the processes (`srun python train.py`).")


def check_script(request: RunRequest) -> None:
    """The script (or the module, with ``-m``) exists; raises PreflightError."""
    if request.module:
        if importlib.util.find_spec(request.script) is None:
            raise PreflightError(f"-m {request.script}: no such module on this Python's path.")
    elif Path(request.script).is_dir():
        raise PreflightError(f"{request.script} is a folder, not a script: name the .py file to run (or a package's "
                             "module with -m).")
    elif not Path(request.script).is_file():
        raise PreflightError(f"{request.script}: no such script (looked in {Path.cwd()}).")
