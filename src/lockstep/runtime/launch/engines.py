"""The engines behind ``lockstep run``: what starts and supervises the workers. Each plans a ``RunRequest``
(every check that can fail before a process starts, raising ``PreflightError``) and runs the plan (its
exit status is the command's). ``engine_for`` chooses one, once:

- ``TorchElastic``: the torch elastic agent on this node (one node or several, fixed or MIN:MAX);
- ``RayTrain``: Ray Train's workers on the Ray cluster of ``RAY_ADDRESS`` (``--engine ray``);
- ``ReplicaGroups``: the replica groups of a fault-tolerant job, each a ``lockstep run`` of its own, under a
  supervisor that hosts torchft's lighthouse (``--fault-tolerant``).

The checks that need the training side (strategy and precision names, the devices, which import torch)
are the caller's (``TrainingChecks``): this package never loads the training side.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable
from typing import Any, Protocol

from lockstep.env import RUNTIME_VARIABLES, job_secret_from_environ
from lockstep.errors import PreflightError
from lockstep.runtime.launch.elastic import run_elastic, stop_local_workers, stop_this_node, threads_per_process
from lockstep.runtime.launch.fork_server import ForkServer, forked_workers
from lockstep.runtime.launch.node_watch import NodeWatch
from lockstep.runtime.launch.plan import Plan, ReplicaPlan, plan, plan_replica_groups
from lockstep.runtime.launch.request import RunRequest, check_script

Say = Callable[[str], None]
#: The options of one engine only, as the command line names them.
_FAULT_TOLERANCE_ONLY = {"replicas": "--replicas", "min_replicas": "--min-replicas", "step_timeout": "--step-timeout"}
_RAY_ONLY = {"storage": "--storage", "name": "--name", "resize_interval": "--resize-interval",
             "keep_checkpoints": "--keep-checkpoints"}


class TrainingChecks(Protocol):
    """What only the training side can check (it imports torch); ``cli/run.py`` gives it."""

    def names(self, strategy: str | None, precision: str | None) -> None: ...
    def devices(self, devices: str, accelerator: str) -> tuple[int, str | None]: ...  # processes, CUDA_VISIBLE_DEVICES
    def workers_per_node(self, devices: str | None) -> int: ...
    def gpus(self, accelerator: str) -> bool: ...
    def layout(self, parallel: str, world_size: int) -> None: ...  # --parallel's degrees fit the world size


class Engine(Protocol):
    def plan(self, request: RunRequest) -> Any: ...
    def run(self, job: Any) -> int: ...


def engine_for(request: RunRequest, checks: TrainingChecks, say: Say) -> Engine:
    """The engine ``request`` asks for."""
    if request.engine == "ray":
        return RayTrain(checks, say)
    if request.fault_tolerant:
        return ReplicaGroups(checks, say)
    return TorchElastic(checks, say)


def _refuse_options_of(options: dict[str, str], request: RunRequest, without: str, purpose: str) -> None:
    """Options of one engine, given to another, refused by name: ``without`` is what they need."""
    given = [option for name, option in options.items() if getattr(request, name) is not None]
    if given:
        raise PreflightError(f"{', '.join(given)} without {without}: these set {purpose}; add {without}, or leave "
                             "them out.")


def _refuse_fault_tolerance_options(request: RunRequest) -> None:
    if not request.fault_tolerant:  # the engine refuses --fault-tolerant itself (Ray), or is the replica groups'
        _refuse_options_of(_FAULT_TOLERANCE_ONLY, request, "--fault-tolerant",
                           "the replica groups of a fault-tolerant job")


def _refuse_ray_options(request: RunRequest) -> None:
    _refuse_options_of(_RAY_ONLY, request, "--engine ray", "Ray Train's run")


class TorchElastic:
    """The torch elastic agent on this node, with lockstep's node watch on several nodes."""

    def __init__(self, checks: TrainingChecks, say: Say) -> None:
        self.checks, self.say = checks, say

    def plan(self, request: RunRequest) -> tuple[RunRequest, Plan, ForkServer | None]:
        _refuse_fault_tolerance_options(request)
        _refuse_ray_options(request)
        assert request.devices is not None, "with_orchestrator_defaults fills the devices"
        devices = request.devices
        parallel = request.parallel
        server = ForkServer.start()  # its import of torch runs beside this process's own (the checks')
        try:
            return request, plan(request, lambda: self.checks.names(request.strategy, request.precision),
                                 lambda: self.checks.devices(devices, request.accelerator),
                                 lambda world: self.checks.layout(parallel, world) if parallel else None), server
        except BaseException:
            if server is not None:
                server.stop(at_once=True)
            raise

    def run(self, job: tuple[RunRequest, Plan, ForkServer | None]) -> int:
        request, planned, server = job
        with forked_workers(server):
            return self._run(request, planned)

    def _run(self, request: RunRequest, planned: Plan) -> int:
        for name, value in request.runtime_choices().items():  # the workers inherit it: the documented contract
            os.environ[RUNTIME_VARIABLES[name]] = value
        if planned.visible_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = planned.visible_devices
        os.environ.update(planned.environment)
        for note in planned.notes:
            self.say(note)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_process(planned.nproc)))
        return run_elastic(planned.torchrun_args, _watch(planned, request.node_rank or 0))


def _watch(job: Plan, node_rank: int) -> NodeWatch | None:
    """The node watch of a job on several nodes (None on one node)."""
    if job.nodes[1] < 2 or job.master_port is None:
        return None
    where = ", ".join(filter(None, [socket.gethostname(), job.local_address]))
    secret = job_secret_from_environ()
    if secret is None:
        print(f"lockstep run: LOCKSTEP_JOB_SECRET is not set: the messages that stop nodes are not signed, and "
              f"whoever reaches {job.master_addr}:{job.master_port} can forge one. Set the same secret on every "
              "node (see docs/reliability.md).", file=sys.stderr, flush=True)
    if job.elastic:  # a silent node leaves the job, which goes on without it
        return NodeWatch(job.master_addr, job.master_port, f"node {where}", stop_this_node, stop_local_workers,
                         job.hosts_store, secret=secret)
    return NodeWatch(job.master_addr, job.master_port, f"node {node_rank} ({where})", stop_this_node,
                     stop_this_node, job.hosts_store, secret=secret)


class RayTrain:
    """``--engine ray``: the script on the workers of a Ray cluster, through Ray Train."""

    def __init__(self, checks: TrainingChecks, say: Say) -> None:
        self.checks, self.say = checks, say

    def plan(self, request: RunRequest) -> Any:
        from lockstep.runtime.launch.ray_engine import forwarded_environment, plan_ray_job

        _refuse_fault_tolerance_options(request)
        check_script(request)
        self.checks.names(request.strategy, request.precision)
        per_node = self.checks.workers_per_node(request.devices)
        environment = {**forwarded_environment(os.environ),
                       **{RUNTIME_VARIABLES[name]: value for name, value in request.runtime_choices().items()},
                       **request.output_variables()}
        job = plan_ray_job(request, per_node, environment)
        if request.parallel:  # the degrees fit the workers (an elastic job's fewest and most), or none starts
            for world in {job.workers} if isinstance(job.workers, int) else set(job.workers):
                self.checks.layout(request.parallel, world)
        return job

    def run(self, job: Any) -> int:
        from lockstep.runtime.launch.ray_engine import run_ray_job

        return run_ray_job(job, self.say)


class ReplicaGroups:
    """``--fault-tolerant``: host the lighthouse (node 0), run each of this node's replica groups as a
    ``lockstep run`` of its own, and replace a group that dies."""

    def __init__(self, checks: TrainingChecks, say: Say) -> None:
        self.checks, self.say = checks, say

    def plan(self, request: RunRequest) -> tuple[RunRequest, ReplicaPlan, int]:
        check_script(request)
        _refuse_ray_options(request)
        self.checks.names(request.strategy, request.precision)
        assert request.devices is not None, "with_orchestrator_defaults fills the devices"
        nproc, visible = self.checks.devices(request.devices, request.accelerator)
        planned = plan_replica_groups(request, nproc, visible, self.checks.gpus(request.accelerator))
        if request.parallel:  # each group is a job of its own: its degrees fit its processes, or none starts
            self.checks.layout(request.parallel, nproc // len(planned.devices))
        return request, planned, nproc

    def run(self, job: tuple[RunRequest, ReplicaPlan, int]) -> int:
        from lockstep.env.fault_tolerance import FaultTolerance
        from lockstep.runtime.comm.network import free_port
        from lockstep.runtime.launch.replicas import ReplicaGroupsRun

        request, planned, nproc = job
        # every group of the job (on every node) waits for the others at its first quorum
        config = FaultTolerance(min_replicas=planned.min_replicas, step_timeout=planned.step_timeout,
                                start_with=planned.job_groups)
        chosen = [item for name, value in request.runtime_choices().items() for item in (f"--{name}", value)]

        def command(index: int) -> list[str]:
            # on several nodes, the group's rendezvous listens on this node's address: the other groups reach
            # its store and its manager there
            where = (["--master", f"{planned.group_address}:{free_port(planned.group_address)}"]
                     if planned.environment else [])
            return [sys.executable, "-m", "lockstep.cli.main", "run", "--devices",
                    planned.devices[index - planned.first_index], *where, *chosen, "--max-restarts", "0",
                    *(["-m"] if request.module else []), request.script, *request.script_args]

        for note in planned.notes:
            self.say(note)
        restarts = 3 if request.max_restarts is None else request.max_restarts
        environment = {**planned.environment,
                       "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads_per_process(nproc)))}
        groups = range(planned.first_index, planned.first_index + len(planned.devices))
        return ReplicaGroupsRun(groups, command, lambda index: environment, config, restarts, self.say,
                                (planned.lighthouse_host, planned.lighthouse_port), planned.hosts_lighthouse,
                                planned.group_address).run()
