"""``lockstep run --engine ray``: the same script on a Ray cluster's workers, through Ray Train's
``TorchTrainer``. Each worker runs the script as ``python SCRIPT ARGS`` would (``__main__``, its
arguments in ``sys.argv``, its folder on the path, the caller's working folder when the node has
it); Ray forms the process group, which the script's Runtime adopts (``DistEnv``'s ``"ray"`` route),
restarts the workers after a failure (``--max-restarts``) and resizes an elastic job
(``--nodes MIN:MAX``). Ray is imported only when this engine runs.
"""

from __future__ import annotations

import os
import re
import runpy
import socket
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lockstep.env.settings import RAY_CHECKPOINTS
from lockstep.errors import ConfigError, MissingExtraError, PreflightError, WorkerError
from lockstep.runtime.launch.plan import parse_nodes
from lockstep.runtime.launch.request import RunRequest


@dataclass(frozen=True)
class RayJob:
    """What ``lockstep run --engine ray`` asks of Ray Train."""

    script: str
    script_args: list[str]
    module: bool
    workers: int | tuple[int, int]  # a fixed count, or (min, max) for an elastic job
    gpu: bool | None  # None: whatever the cluster has
    storage: str | None  # RunConfig(storage_path): a folder every node mounts, or Ray's default
    name: str  # RunConfig(name): the same name and storage resume a run Ray has recorded
    named: bool  # the name was given (--name): a run to continue; else a new one, named after the script and time
    max_failures: int
    resize_interval: float | None  # ScalingConfig(elastic_resize_monitor_interval_s); None: Ray's default
    keep_checkpoints: int | None  # CheckpointConfig(num_to_keep); None: the script's own (RAY_CHECKPOINTS)
    environment: dict[str, str] = field(default_factory=dict)  # set in every worker before the script


#: The caller's variables that describe its own shell, host, Python environment, devices or place in a job:
#: not forwarded to Ray's workers, which have their own. Every other variable is.
_HOST_VARIABLES = frozenset({
    "_", "HOME", "PATH", "PWD", "OLDPWD", "SHELL", "SHLVL", "USER", "LOGNAME", "HOSTNAME", "TERM", "DISPLAY", "TMPDIR",
    "LD_LIBRARY_PATH", "LD_PRELOAD", "VIRTUAL_ENV", "CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
    "MASTER_ADDR", "MASTER_PORT"})
_HOST_PREFIXES = ("RAY_", "SLURM_", "PET_", "KUBERNETES_", "TORCHELASTIC_", "CONDA_", "SSH_", "XDG_", "TMUX",
                  "PYENV_", "LOCKSTEP_JOB_")


def forwarded_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The caller's environment as Ray's workers get it (``lockstep run`` with the torch engine hands the
    workers the whole of it): every variable but those of ``_HOST_VARIABLES`` and ``_HOST_PREFIXES``."""
    return {name: value for name, value in environ.items()
            if name not in _HOST_VARIABLES and not name.startswith(_HOST_PREFIXES)}


def plan_ray_job(args: RunRequest, devices_per_node: int, environment: dict[str, str]) -> RayJob:
    """``lockstep run``'s options as a Ray job; raises PreflightError for what Ray cannot do."""
    for option, value in (("--node-rank", args.node_rank), ("--master", args.master),
                          ("--rdzv-endpoint", args.rdzv_endpoint), ("--fault-tolerant", args.fault_tolerant)):
        if value:
            raise PreflightError(f"{option} is for the torch engine; with --engine ray, Ray places the workers "
                                 "on the cluster of RAY_ADDRESS (give --devices and --nodes).")
    if devices_per_node < 1:
        raise PreflightError(f"--devices {devices_per_node}: give at least 1 worker per node.")
    nodes = parse_nodes(str(args.nodes or 1))
    restarts = args.max_restarts if args.max_restarts is not None else (3 if nodes[0] != nodes[1] else 0)
    if restarts < 0:
        raise PreflightError("--max-restarts must be 0 or more.")
    workers: int | tuple[int, int] = (devices_per_node * nodes[0] if nodes[0] == nodes[1]
                                      else (devices_per_node * nodes[0], devices_per_node * nodes[1]))
    gpu = {"cuda": True, "cpu": False}.get(args.accelerator)
    # a new run unless --name says which to continue: the same name and storage resume Ray's newest checkpoint
    name = args.name or f"{Path(args.script).stem.replace('.', '-')}-{time.strftime('%Y%m%d-%H%M%S')}"
    storage = str(Path(args.storage).resolve()) if args.storage else None
    if args.resize_interval is not None and (args.resize_interval < 0 or nodes[0] == nodes[1]):
        raise PreflightError(f"--resize-interval {args.resize_interval}: give 0 or more seconds, for an elastic job "
                             "(--nodes MIN:MAX).")
    if args.keep_checkpoints is not None and args.keep_checkpoints < 1:
        raise PreflightError(f"--keep-checkpoints {args.keep_checkpoints}: give 1 or more (or leave it out: Ray keeps "
                             "the checkpoints the script keeps).")
    if args.keep_checkpoints is None:
        environment = {**environment, RAY_CHECKPOINTS: "as-the-script"}
    return RayJob(args.script, list(args.script_args), args.module, workers, gpu, storage, name, bool(args.name),
                  restarts, args.resize_interval, args.keep_checkpoints, environment)


def run_ray_job(job: RayJob, say: Callable[[str], None]) -> int:
    """Run ``job`` on the Ray cluster (``RAY_ADDRESS``; without it Ray starts one on this machine);
    0 when the script ended well on every worker, 1 after saying why not."""
    try:
        import ray
        import ray.train.torch  # noqa: F401 - Ray Train itself, which the extra installs
    except ImportError as error:
        raise MissingExtraError("--engine ray needs Ray Train: pip install 'lockstep[ray]'") from error

    where = os.environ.get("RAY_ADDRESS") or "this machine"
    advice = ("set RAY_ADDRESS to the head's HOST:PORT (ray start --head prints it), and its token where the "
              "cluster asks for one (RAY_AUTH_TOKEN_PATH)")
    try:
        _check_reachable(os.environ.get("RAY_ADDRESS", ""))
        ray.init()
    except (ConnectionError, RuntimeError, OSError, ValueError) as error:  # no cluster there (or no address: a
        # ValueError), or one that refuses this driver
        say(f"cannot reach the Ray cluster at {where}: {_first_line(error)}; {advice}.")
        return 1
    try:
        gpu = job.gpu if job.gpu is not None else ray.cluster_resources().get("GPU", 0) > 0
        short = _too_few_resources(job, gpu, ray.cluster_resources())
        if short:  # Ray would wait for them without end (its start timeout is retried): said now
            say(f"the Ray cluster at {where} has {short}: a fixed number of workers needs them now. Give fewer "
                "--devices or --nodes, add nodes to the cluster, or give --nodes MIN:MAX, which waits for them.")
            return 2
        trainer = _torch_trainer(job, gpu)
        count = job.workers if isinstance(job.workers, int) else f"{job.workers[0]} to {job.workers[1]}"
        say(f"on Ray: {count} worker(s){' with a GPU each' if gpu else ''}, run {job.name!r} "
            + ("(given by --name: Ray's newest checkpoint of it, if any, is resumed)" if job.named else
               f"(a new run; after a failure of this command, --name {job.name} resumes it)"))
        try:
            result = trainer.fit()
        except Exception as error:  # noqa: BLE001 - Ray's TrainingFailedError and its causes, said once
            say(f"the Ray job failed: {_failures(error)}")
            return 1
        if result.checkpoint is not None:
            say(f"Ray's newest checkpoint: {result.checkpoint.path}")
        return 0
    finally:
        ray.shutdown()


def _torch_trainer(job: RayJob, gpu: bool) -> Any:
    """Ray Train's ``TorchTrainer`` for ``job``: each worker runs the script through ``run_script``."""
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    config = {"script": job.script if job.module else str(Path(job.script).resolve()),
              "args": job.script_args, "module": job.module, "cwd": os.getcwd(), "environment": job.environment}
    scaling: dict[str, Any] = {"num_workers": job.workers, "use_gpu": gpu}
    if job.resize_interval is not None:
        scaling["elastic_resize_monitor_interval_s"] = job.resize_interval
    return TorchTrainer(run_script, train_loop_config=config, scaling_config=ScalingConfig(**scaling),
                        run_config=RunConfig(name=job.name, storage_path=job.storage,
                                             failure_config=FailureConfig(max_failures=job.max_failures),
                                             checkpoint_config=CheckpointConfig(num_to_keep=job.keep_checkpoints)))


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A HOST:PORT address must accept a connection within ``timeout_s``: Ray's own driver retries an
    unreachable one for minutes. ``auto``, ``ray://`` and an empty address are left to Ray."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or "://" in address:
        return
    with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
        pass


def _too_few_resources(job: RayJob, gpu: bool, cluster: Mapping[str, float]) -> str:
    """What the cluster lacks for a fixed number of workers (each takes a CPU, and a GPU with ``gpu``: Ray
    Train's default), e.g. ``4 CPUs for 8 workers``; '' when it holds them, or for an elastic job."""
    if not isinstance(job.workers, int):
        return ""
    needs = {"CPU": job.workers, **({"GPU": job.workers} if gpu else {})}
    return ", ".join(f"{cluster.get(kind, 0):g} {kind}s for {job.workers} workers"
                     for kind, count in needs.items() if cluster.get(kind, 0) < count)


def _failures(error: BaseException) -> str:
    """Ray's failure in one line: each failed worker's own error where Ray lists them (its message cuts them
    short), else the line of its message that names one."""
    failures = getattr(error, "worker_failures", None)
    if not failures:
        return _first_line(error)
    lines = [(rank, _first_line(failure)[:400]) for rank, failure in sorted(failures.items())[:4]]
    said = [line if line.startswith(f"rank {rank}:") else f"rank {rank}: {line}" for rank, line in lines]
    more = f"; {len(failures) - 4} more" if len(failures) > 4 else ""
    return "; ".join(said) + more


def _first_line(error: BaseException) -> str:
    """The line of Ray's error that names the workers' own error (e.g. lockstep's, which says what to
    change), else its first line."""
    lines = (str(error).strip() or type(error).__name__).splitlines()
    named = [line.strip() for line in lines if re.match(r"\s*[\w.]*(Error|Exception): ", line)]
    own = [line for line in named if not line.startswith("ray.")]
    if own or named:
        return (own or named)[-1]
    return lines[0]


def run_script(config: dict[str, Any]) -> None:
    """A Ray Train worker's loop (``train_loop_per_worker``): the script, as ``python SCRIPT ARGS`` runs
    it. Usable from your own ``TorchTrainer``: ``TorchTrainer(run_script, train_loop_config={"script":
    "train.py", "args": [...]}, ...)``."""
    os.environ.update(config.get("environment") or {})
    cwd = config.get("cwd")
    if cwd and Path(cwd).is_dir():
        os.chdir(cwd)
    script, args, module = str(config["script"]), list(config.get("args") or []), bool(config.get("module"))
    if not module:
        script = str(Path(script).resolve())
        if not Path(script).is_file():
            raise ConfigError(f"{script}: no such script on this Ray node: put it on a folder every node mounts, "
                              "or in the image the workers run.")
        sys.path.insert(0, str(Path(script).parent))
    sys.argv = [script, *args]
    try:
        if module:
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code not in (None, 0):
            rank = int(os.environ.get("RANK", "0"))
            raise WorkerError(f"rank {rank}: {script} exited with status {stop.code}", rank) from None
