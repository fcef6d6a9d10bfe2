"""``lockstep run``: check the request, then start the workers through the torch elastic agent."""

from __future__ import annotations

import argparse
import os
import socket
import sys

from lockstep.env import RUNTIME_VARIABLES, job_secret_from_environ
from lockstep.errors import PreflightError
from lockstep.runtime.launch.elastic import run_elastic, stop_local_workers, stop_this_node, threads_per_process
from lockstep.runtime.launch.node_watch import NodeWatch
from lockstep.runtime.launch.plan import Plan, check_script, orchestrator_defaults, plan_replica_groups
from lockstep.runtime.launch.plan import plan as make_plan


def add_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = commands.add_parser(
        "run",
        help="start a training script on N processes per node (torch elastic underneath)",
        description="Start SCRIPT on --devices processes on this node (and --nodes nodes), with "
        "the environment that lockstep.Runtime, torch.distributed and torchrun scripts read. "
        "Option names follow torchrun's where the two overlap.",
    )
    parser.add_argument("--devices", default=None,
                        help="per node: a count (GPUs with cuda, processes with cpu), GPU indices "
                        "such as 0,2 (sets CUDA_VISIBLE_DEVICES), or auto (default): every GPU, or 1 CPU process")
    parser.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "cuda"],
                        help="passed to the script's Runtime; auto = cuda when a GPU is visible")
    parser.add_argument("--nodes", default=None,
                        help="number of nodes (default 1), or MIN:MAX for an elastic job that goes on "
                        "with MIN to MAX nodes as nodes leave and join (see docs/launching.md)")
    parser.add_argument("--node-rank", type=int, default=None, help="this node's rank, 0..nodes-1 (fixed size)")
    parser.add_argument("--master", metavar="HOST:PORT",
                        help="address of node 0 (several nodes; with MIN:MAX, the node hosting the "
                        "rendezvous); a free loopback port is chosen for a single node")
    parser.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                        help="dynamic (c10d) rendezvous endpoint, in place of --master/--node-rank")
    parser.add_argument("--rdzv-id", default="lockstep", help="job id shared by the nodes (c10d)")
    parser.add_argument("--rdzv-conf", default=None, metavar="KEY=VALUE,...",
                        help="c10d rendezvous settings, as torchrun's (join_timeout, last_call_timeout, ...)")
    parser.add_argument("--max-restarts", type=int, default=None,
                        help="restart the whole group up to K times after a worker fails "
                        "(default 0; 3 with --nodes MIN:MAX)")
    parser.add_argument("--fault-tolerant", action="store_true",
                        help="run --replicas replica groups that train on when one dies, and start a "
                        "replacement for it, which takes its state from a live group (torchft; "
                        "docs/fault-tolerance.md); --max-restarts then counts per group (default 3)")
    parser.add_argument("--replicas", type=int, default=2, help="with --fault-tolerant: how many replica "
                        "groups share --devices (default 2)")
    parser.add_argument("--min-replicas", type=int, default=1, help="with --fault-tolerant: the fewest live "
                        "groups a step may run with (default 1)")
    parser.add_argument("--step-timeout", type=float, default=30.0, help="with --fault-tolerant: seconds a "
                        "step may wait for the other groups; every other timeout derives from it (default 30)")
    parser.add_argument("--engine", choices=["torch", "ray"], default="torch",
                        help="what starts and supervises the workers: torch elastic on this node (default), or "
                        "Ray Train on the Ray cluster of RAY_ADDRESS (--devices workers per node, --nodes N or "
                        "MIN:MAX; see docs/launching.md)")
    parser.add_argument("--storage", metavar="DIR", help="with --engine ray: Ray Train's storage folder (a folder "
                        "every node mounts), where Ray keeps the run and a copy of each checkpoint")
    parser.add_argument("--name", help="with --engine ray: the run's name in Ray's storage (default: the "
                        "script's name); a run of the same name and storage resumes from its newest checkpoint")
    parser.add_argument("--resize-interval", type=float, default=None, metavar="SECONDS",
                        help="with --engine ray and --nodes MIN:MAX: how often Ray looks for room to grow a "
                        "running job (Ray's default 60)")
    parser.add_argument("--strategy", help="passed to the script's Runtime (ddp, fsdp, dp, single)")
    parser.add_argument("--precision", help="passed to the script's Runtime (32-true, 16-mixed, bf16-mixed, ...)")
    parser.add_argument("-m", dest="module", action="store_true",
                        help="SCRIPT is a module name, run as `python -m SCRIPT`")
    parser.add_argument("script", metavar="SCRIPT", help="the training script (or module with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="arguments for the script")
    parser.set_defaults(func=run_command)


def _resolve_devices(devices: str, accelerator: str) -> tuple[int, str | None]:
    """Processes per node, and the CUDA_VISIBLE_DEVICES value to set (None: leave it)."""
    import torch

    from lockstep.runtime.parallel.devices import parse_devices  # torch's import: not for --help

    gpus = torch.cuda.device_count() if accelerator in ("auto", "cuda") else 0
    if accelerator == "cuda" and gpus == 0:
        raise PreflightError("--accelerator cuda, but torch sees no CUDA GPU on this node.")
    try:
        wanted = parse_devices(devices)
    except ValueError as error:
        raise PreflightError(f"--devices {devices}: {error}") from None
    if isinstance(wanted, str):  # "auto"
        return (gpus or 1), None
    if isinstance(wanted, int):
        if gpus and wanted > gpus:
            raise PreflightError(f"--devices {wanted}, but only {gpus} GPU(s) are visible on this node.")
        return wanted, None
    ids = wanted
    if not gpus:
        raise PreflightError(f"--devices {devices}: GPU indices need CUDA GPUs; on the CPU give a count.")
    missing = [i for i in ids if i >= gpus]
    if missing:
        raise PreflightError(f"--devices {devices}: GPU(s) {missing} do not exist ({gpus} visible).")
    if len(set(ids)) != len(ids):
        raise PreflightError(f"--devices {devices}: lockstep run starts one process per GPU it lists. For several "
                             "processes on one GPU, pass devices=[0, 0] to the Runtime or Trainer in the script and "
                             "start it with torchrun --nproc-per-node 2 or lockstep.launch(fn, nprocs=2).")
    return len(ids), ",".join(str(i) for i in ids)


def _check_names(strategy: str | None, precision: str | None) -> None:
    """A misspelt --strategy or --precision is refused here, not by every worker after its start."""
    from lockstep.runtime.parallel.precision import PRECISION_NAMES  # torch's import: not for --help
    from lockstep.runtime.parallel.strategy import STRATEGIES

    if strategy is not None and strategy.lower() not in STRATEGIES:
        raise PreflightError(f"--strategy {strategy}: no such strategy; use one of {', '.join(STRATEGIES)}.")
    if precision is not None and precision not in PRECISION_NAMES:
        raise PreflightError(f"--precision {precision}: no such precision; use one of {', '.join(PRECISION_NAMES)}.")


def plan(args: argparse.Namespace) -> Plan:
    """Every check that can fail before a process starts; raises PreflightError."""
    return make_plan(args, lambda: _check_names(args.strategy, args.precision),
                     lambda: _resolve_devices(args.devices, args.accelerator))


def _watch(job: Plan, args: argparse.Namespace) -> NodeWatch | None:
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
    return NodeWatch(job.master_addr, job.master_port, f"node {args.node_rank} ({where})", stop_this_node,
                     stop_this_node, job.hosts_store, secret=secret)


def run_command(args: argparse.Namespace) -> int:
    try:
        for note in orchestrator_defaults(args, os.environ):
            print(f"lockstep run: {note}", file=sys.stderr, flush=True)
        if args.engine == "ray":
            return _run_on_ray(args)
        if args.fault_tolerant:
            return _run_replica_groups(args)
        job = plan(args)
    except PreflightError as error:
        print(f"lockstep run: {error}", file=sys.stderr)
        return 2
    choices = {"accelerator": None if args.accelerator == "auto" else args.accelerator,
               "strategy": args.strategy, "precision": args.precision}
    for name, value in choices.items():
        if value:  # the workers inherit this environment: the documented contract
            os.environ[RUNTIME_VARIABLES[name]] = value
    if job.visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = job.visible_devices
    os.environ.update(job.environment)
    for note in job.notes:
        print(f"lockstep run: {note}", file=sys.stderr, flush=True)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_process(job.nproc)))
    return run_elastic(job.torchrun_args, _watch(job, args))


def _run_on_ray(args: argparse.Namespace) -> int:
    """``--engine ray``: the script on the workers of a Ray cluster, through Ray Train."""
    from lockstep.runtime.launch.ray_engine import plan_ray_job, run_ray_job
    from lockstep.runtime.parallel.devices import parse_devices  # torch's import: not for --help

    check_script(args)
    _check_names(args.strategy, args.precision)
    try:
        wanted = parse_devices(args.devices or "auto")
    except ValueError as error:
        raise PreflightError(f"--devices {args.devices}: {error}") from None
    if isinstance(wanted, tuple):
        raise PreflightError(f"--devices {args.devices}: with --engine ray give a count of workers per node; "
                             "Ray gives each worker its GPU.")
    per_node = 1 if wanted == "auto" else int(wanted)
    environment = {RUNTIME_VARIABLES[name]: value for name in ("accelerator", "strategy", "precision")
                   if (value := getattr(args, name)) and value != "auto"}
    job = plan_ray_job(args, per_node, environment)
    return run_ray_job(job, lambda line: print(f"lockstep run: {line}", file=sys.stderr, flush=True))


def _run_replica_groups(args: argparse.Namespace) -> int:
    """``--fault-tolerant``: host the lighthouse (node 0), run each of this node's replica groups as a
    ``lockstep run`` of its own."""
    from lockstep.env.fault_tolerance import FaultTolerance
    from lockstep.runtime.comm.network import free_port
    from lockstep.runtime.launch.replicas import ReplicaGroupsRun

    check_script(args)
    _check_names(args.strategy, args.precision)
    nproc, visible = _resolve_devices(args.devices, args.accelerator)
    import torch

    gpus = args.accelerator != "cpu" and torch.cuda.device_count() > 0
    job = plan_replica_groups(args, nproc, visible, gpus)
    config = FaultTolerance(min_replicas=args.min_replicas, step_timeout=args.step_timeout)
    chosen = [item for name in ("accelerator", "strategy", "precision")
              for item in ((f"--{name}", getattr(args, name)) if getattr(args, name) else ())]

    def command(index: int) -> list[str]:
        # on several nodes, the group's rendezvous listens on this node's address: the other groups reach
        # its store and its manager there
        where = ["--master", f"{job.group_address}:{free_port(job.group_address)}"] if job.environment else []
        return [sys.executable, "-m", "lockstep.cli.main", "run", "--devices", job.devices[index - job.first_index],
                *where, *chosen, "--max-restarts", "0", *(["-m"] if args.module else []), args.script,
                *args.script_args]

    say = lambda line: print(f"lockstep run: {line}", file=sys.stderr, flush=True)  # noqa: E731
    for note in job.notes:
        say(note)
    restarts = 3 if args.max_restarts is None else args.max_restarts
    environment = {**job.environment,
                   "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(threads_per_process(nproc)))}
    groups = range(job.first_index, job.first_index + len(job.devices))
    return ReplicaGroupsRun(groups, command, lambda index: environment, config, restarts, say,
                            (job.lighthouse_host, job.lighthouse_port), job.hosts_lighthouse).run()
