"""``lockstep run``: check the request, then start the workers through the torch elastic agent."""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from lockstep.env import RUNTIME_VARIABLES, job_secret_from_environ
from lockstep.errors import PreflightError
from lockstep.runtime.comm.network import (
    NoRouteError,
    host_store,
    interface_towards,
    interfaces,
    socket_interface_variables,
)
from lockstep.runtime.launch.elastic import run_elastic, stop_local_workers, stop_this_node, threads_per_process
from lockstep.runtime.launch.node_watch import NodeWatch


def add_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = commands.add_parser(
        "run",
        help="start a training script on N processes per node (torch elastic underneath)",
        description="Start SCRIPT on --devices processes on this node (and --nodes nodes), with "
        "the environment that lockstep.Runtime, torch.distributed and torchrun scripts read. "
        "Option names follow torchrun's where the two overlap.",
    )
    parser.add_argument("--devices", default="auto",
                        help="per node: a count (GPUs with cuda, processes with cpu), GPU indices "
                        "such as 0,2 (sets CUDA_VISIBLE_DEVICES), or auto: every GPU, or 1 CPU process")
    parser.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "cuda"],
                        help="passed to the script's Runtime; auto = cuda when a GPU is visible")
    parser.add_argument("--nodes", default="1",
                        help="number of nodes (default 1), or MIN:MAX for an elastic job that goes on "
                        "with MIN to MAX nodes as nodes leave and join (see docs/launching.md)")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's rank, 0..nodes-1 (fixed size)")
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
    parser.add_argument("--strategy", help="passed to the script's Runtime (ddp, fsdp, dp, single)")
    parser.add_argument("--precision", help="passed to the script's Runtime (32-true, 16-mixed, bf16-mixed, ...)")
    parser.add_argument("-m", dest="module", action="store_true",
                        help="SCRIPT is a module name, run as `python -m SCRIPT`")
    parser.add_argument("script", metavar="SCRIPT", help="the training script (or module with -m)")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS",
                        help="arguments for the script")
    parser.set_defaults(func=run_command)


@dataclass(frozen=True)
class Plan:
    """What the agent will start on this node."""

    nproc: int
    visible_devices: str | None
    master_addr: str
    master_port: int | None
    torchrun_args: list[str]
    store: object | None  # the rendezvous store hosted here (node 0), bound to master_addr only
    elastic: bool  # nodes MIN:MAX or a c10d endpoint: membership may change between restarts
    nodes: tuple[int, int]  # (min, max)
    environment: dict[str, str]  # set for the workers: the network interface between the nodes
    notes: list[str]  # what the launcher chose, one line each
    local_address: str  # this node's address towards the master (several nodes)
    hosts_store: bool  # the rendezvous store lives in this process (static node 0, or the c10d endpoint)


def _split_host_port(value: str, option: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PreflightError(f"{option} {value!r}: give HOST:PORT, e.g. 10.0.0.1:29500.")
    return host, int(port)


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
    return len(ids), ",".join(str(i) for i in ids)


def _parse_nodes(value: str) -> tuple[int, int]:
    low, _, high = value.partition(":")
    try:
        nodes = (int(low), int(high or low))
    except ValueError:
        nodes = (0, 0)
    if not 1 <= nodes[0] <= nodes[1]:
        raise PreflightError(f"--nodes {value}: give a count N or a range MIN:MAX with 1 <= MIN <= MAX.")
    return nodes


def _resolve(host: str) -> str:
    try:
        return str(socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0])
    except OSError:
        raise PreflightError(f"{host} does not resolve: give an address or a name this node knows.") from None


def _network(host: str, nodes: int) -> tuple[dict[str, str], list[str], str]:
    """For several nodes: the socket interface variables for the workers, the line saying so, and
    this node's address towards ``host``."""
    if nodes < 2:
        return {}, [], ""
    try:
        variables, line = socket_interface_variables(host, os.environ)
        source = interface_towards(host)[1]
    except NoRouteError as error:
        raise PreflightError(f"{error}. Check --master/--rdzv-endpoint, or set GLOO_SOCKET_IFNAME and "
                             "NCCL_SOCKET_IFNAME to the interface between the nodes.") from None
    return variables, [line] if line else [], source


def _elastic_rendezvous(args: argparse.Namespace) -> tuple[str, int, bool, list[str]]:
    """(host, port, whether this node hosts it, torchrun options) of a c10d rendezvous on
    ``--rdzv-endpoint`` or ``--master``."""
    endpoint = args.rdzv_endpoint or args.master
    if not endpoint:
        raise PreflightError("--nodes MIN:MAX needs --master HOST:PORT (the node hosting the rendezvous).")
    host, port = _split_host_port(endpoint, "--rdzv-endpoint" if args.rdzv_endpoint else "--master")
    # This node hosts the rendezvous store when the endpoint is one of its addresses. torch's own
    # test compares with the address of the host name, a loopback address on many images.
    address = _resolve(host)
    hosting = not address.startswith("127.") and address in interfaces().values()
    conf = ",".join(filter(None, ["is_host=true" if hosting else "", args.rdzv_conf]))
    options = ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", args.rdzv_id]
    return host, port, hosting, options + (["--rdzv-conf", conf] if conf else [])


def _static_rendezvous(args: argparse.Namespace, nodes: int) -> tuple[str, int, object | None, list[str]]:
    """(host, port, store hosted here, torchrun options) of a static rendezvous on node 0."""
    if args.master:
        host, port = _split_host_port(args.master, "--master")
    elif nodes > 1:
        raise PreflightError("--nodes > 1 needs --master HOST:PORT (node 0's address) or --rdzv-endpoint.")
    else:
        host, port = "127.0.0.1", 0  # single node: loopback only, a free port
    store = None
    if args.node_rank == 0:
        try:
            store, port = host_store(host, port)
        except OSError as error:
            raise PreflightError(
                f"port {port} on {host} is in use by another program or not an address of this "
                f"node ({error.strerror}): pick a free --master port, or leave --master out on a "
                "single node."
            ) from None
    options = ["--rdzv-backend", "static", "--master-addr", host, "--master-port", str(port),
               "--node-rank", str(args.node_rank)]
    return host, port, store, options


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
    if args.module:
        if importlib.util.find_spec(args.script) is None:
            raise PreflightError(f"-m {args.script}: no such module on this Python's path.")
    elif not Path(args.script).is_file():
        raise PreflightError(f"{args.script}: no such script (looked in {Path.cwd()}).")
    _check_names(args.strategy, args.precision)
    nodes = _parse_nodes(str(args.nodes))
    elastic = nodes[0] != nodes[1] or bool(args.rdzv_endpoint)
    if not elastic and not 0 <= args.node_rank < nodes[0]:
        raise PreflightError(f"--node-rank {args.node_rank} does not fit --nodes {nodes[0]} (0..{nodes[0] - 1}).")
    restarts = args.max_restarts if args.max_restarts is not None else (3 if nodes[0] != nodes[1] else 0)
    if restarts < 0:
        raise PreflightError("--max-restarts must be 0 or more.")
    nproc, visible = _resolve_devices(args.devices, args.accelerator)
    options = ["--nnodes", f"{nodes[0]}:{nodes[1]}", "--nproc-per-node", str(nproc),
               "--max-restarts", str(restarts), "--monitor-interval", "0.1"]
    if elastic:
        host, port, hosting, rendezvous = _elastic_rendezvous(args)
        store = None
    else:
        host, port, store, rendezvous = _static_rendezvous(args, nodes[0])
        hosting = store is not None
    environment, notes, local_address = _network(host, nodes[1])
    if elastic:
        if local_address:  # the address this node's workers get if it becomes the group's rank 0
            rendezvous += ["--local-addr", local_address]
        environment["LOCKSTEP_ELASTIC_STORE"] = f"{host}:{port}"  # membership reports (runtime/launch/membership.py)
        # torch's agents share their rendezvous store with the workers unless told not to; a node that
        # joins a later round then waits forever for the store address, which rank 0 published only in
        # the round it created the store. Without sharing, every round publishes it again.
        environment.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    target = (["-m"] if args.module else []) + [args.script, *args.script_args]
    return Plan(nproc, visible, host, port, options + rendezvous + target, store, elastic, nodes, environment, notes,
                local_address, hosting)


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
