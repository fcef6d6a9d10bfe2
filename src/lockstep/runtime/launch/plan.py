"""``lockstep run``'s plan: every check of a request that can fail before a process starts (the
script, the nodes, the rendezvous, the network between the nodes), and what the torch elastic
agent will then start on this node. The engines (``engines.py``) plan a request with it."""

from __future__ import annotations

import importlib.util
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

from lockstep.env.settings import DEFAULT_TIMEOUT_S, timeout_from_environ
from lockstep.errors import PreflightError
from lockstep.runtime.comm.network import (
    NoRouteError,
    host_store,
    interface_towards,
    interfaces,
    socket_interface_variables,
)
from lockstep.runtime.launch.request import RunRequest, check_script


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


def parse_nodes(value: str) -> tuple[int, int]:
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


def _elastic_rendezvous(request: RunRequest) -> tuple[str, int, bool, object | None, list[str]]:
    """(host, port, whether this node hosts it, its store when bound here, torchrun options) of a c10d
    rendezvous on ``--rdzv-endpoint`` or ``--master``."""
    endpoint = request.rdzv_endpoint or request.master
    if not endpoint:
        raise PreflightError("--nodes MIN:MAX needs --master HOST:PORT (the node hosting the rendezvous).")
    host, port = _split_host_port(endpoint, "--rdzv-endpoint" if request.rdzv_endpoint else "--master")
    # This node hosts the rendezvous store when the endpoint is one of its addresses. torch's own
    # test compares with the address of the host name, a loopback address on many images.
    address = _resolve(host)
    loopback = address.startswith("127.")
    hosting = not loopback and address in interfaces().values()
    conf = ",".join(filter(None, ["is_host=true" if hosting else "", request.rdzv_conf]))
    options = ["--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", request.rdzv_id]
    store = _elastic_store(address, port) if hosting or loopback else None
    return host, port, hosting, store, options + (["--rdzv-conf", conf] if conf else [])


def _elastic_store(address: str, port: int) -> object | None:
    """The c10d rendezvous store on this node's ``address`` (the endpoint's), bound there only: torch's would
    listen on every interface; its agent in this process takes this one, as for a static rendezvous. None
    when another agent on this node already hosts it (torch's then connects)."""
    try:
        return host_store(address, port)[0]
    except OSError:  # another agent on this node hosts it: this one is a client, as torch's own would be
        return None


def _static_rendezvous(request: RunRequest, nodes: int) -> tuple[str, int, object | None, list[str]]:
    """(host, port, store hosted here, torchrun options) of a static rendezvous on node 0."""
    if request.master:
        host, port = _split_host_port(request.master, "--master")
    elif nodes > 1:
        raise PreflightError("--nodes > 1 needs --master HOST:PORT (node 0's address) or --rdzv-endpoint.")
    else:
        host, port = "127.0.0.1", 0  # single node: loopback only, a free port
    store = None
    if request.node_rank == 0:
        try:
            store, port = host_store(host, port)
        except OSError as error:
            raise PreflightError(
                f"port {port} on {host} is in use by another program or not an address of this "
                f"node ({error.strerror}): pick a free --master port, or leave --master out on a "
                "single node."
            ) from None
    options = ["--rdzv-backend", "static", "--master-addr", host, "--master-port", str(port),
               "--node-rank", str(request.node_rank), "--rdzv-id", request.rdzv_id,
               "--rdzv-conf", f"timeout={_static_join_timeout(request.rdzv_conf)}"]
    return host, port, store, options


def rdzv_settings(conf: str | None) -> dict[str, str]:
    """``--rdzv-conf KEY=VALUE,...`` as a dict."""
    return dict(part.partition("=")[::2] for part in (conf or "").split(",") if part)


def _static_join_timeout(conf: str | None) -> int:
    """The seconds a fixed number of nodes waits for all of them to join (torch's static rendezvous: 600
    s, and the wait for its store's clients 900): ``--rdzv-conf timeout=S``, else ``LOCKSTEP_TIMEOUT``,
    else the collectives' default. The static rendezvous reads no other setting: another is refused."""
    given = rdzv_settings(conf)
    other = sorted(set(given) - {"timeout"})
    if other:
        raise PreflightError(f"--rdzv-conf {','.join(other)}: a fixed number of nodes (--nodes N) rendezvous "
                             "statically, which takes only timeout=SECONDS; the other settings are c10d's, for "
                             "--nodes MIN:MAX.")
    if "timeout" in given:
        try:
            seconds = int(given["timeout"])
        except ValueError:
            seconds = 0
        if seconds < 1:
            raise PreflightError(f"--rdzv-conf timeout={given['timeout']}: a whole number of seconds, at least 1.")
        return seconds
    return int(timeout_from_environ() or DEFAULT_TIMEOUT_S)


def plan(request: RunRequest, check_names: Callable[[], None],
         resolve_devices: Callable[[], tuple[int, str | None]], check_layout: Callable[[int], None]) -> Plan:
    """Every check that can fail before a process starts, in the order a user fixes them; raises
    PreflightError. ``request``: what ``lockstep run`` was asked. The checks that need the training side
    (the names of strategies and precisions, the devices, the degrees) are the caller's: ``check_names``,
    ``resolve_devices`` (processes per node, and the ``CUDA_VISIBLE_DEVICES`` to set) and ``check_layout``
    (given the world size of a fixed number of nodes, before the rendezvous store is opened)."""
    check_script(request)
    check_names()
    nodes = parse_nodes(str(request.nodes))
    elastic = nodes[0] != nodes[1] or bool(request.rdzv_endpoint)
    if not elastic and not 0 <= (request.node_rank or 0) < nodes[0]:
        raise PreflightError(f"--node-rank {request.node_rank} does not fit --nodes {nodes[0]} (0..{nodes[0] - 1}).")
    restarts = request.max_restarts if request.max_restarts is not None else (3 if nodes[0] != nodes[1] else 0)
    if restarts < 0:
        raise PreflightError("--max-restarts must be 0 or more.")
    nproc, visible = resolve_devices()
    if not elastic:
        check_layout(nproc * nodes[0])
    options = ["--nnodes", f"{nodes[0]}:{nodes[1]}", "--nproc-per-node", str(nproc),
               "--max-restarts", str(restarts), "--monitor-interval", "0.1"]
    if elastic:
        host, port, hosting, store, rendezvous = _elastic_rendezvous(request)
    else:
        host, port, store, rendezvous = _static_rendezvous(request, nodes[0])
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
    # "--": the script's own options are never taken for the agent's (argparse would match --log to --log-dir)
    target = (["-m"] if request.module else []) + ["--", request.script, *request.script_args]
    return Plan(nproc, visible, host, port, options + rendezvous + target, store, elastic, nodes, environment, notes,
                local_address, hosting)


@dataclass(frozen=True)
class ReplicaPlan:
    """``--fault-tolerant``: this node's replica groups and where the lighthouse is."""

    devices: list[str]  # each of this node's groups' --devices
    first_index: int  # the index of this node's first group (node k runs k * replicas ...)
    lighthouse_host: str  # node 0 hosts the lighthouse there; the other nodes reach it there
    lighthouse_port: int  # 0 on one node: a free one
    hosts_lighthouse: bool
    group_address: str  # where a group's rendezvous (its store, its manager) listens: reachable by the others
    environment: dict[str, str]  # for the groups: the network interface between the nodes
    notes: list[str]
    min_replicas: int = 1
    step_timeout: float = 30.0
    job_groups: int = 1  # on every node


def plan_replica_groups(request: RunRequest, nproc: int, visible: str | None, gpus: bool) -> ReplicaPlan:
    """``--fault-tolerant``: ``--replicas`` groups on each of ``--nodes`` nodes, which split this node's
    processes (and GPUs) evenly; on several nodes, node 0 (``--master HOST:PORT``) hosts the lighthouse
    at that address. Raises PreflightError."""
    replicas = 2 if request.replicas is None else request.replicas
    min_replicas = 1 if request.min_replicas is None else request.min_replicas
    step_timeout = 30.0 if request.step_timeout is None else request.step_timeout
    if importlib.util.find_spec("torchft") is None:
        raise PreflightError("--fault-tolerant needs torchft: pip install 'lockstep[ft]'.")
    nodes = parse_nodes(str(request.nodes))
    if nodes[0] != nodes[1] or request.rdzv_endpoint:
        raise PreflightError("--fault-tolerant takes a fixed number of nodes (--nodes N, --master HOST:PORT): replica "
                             "groups come and go without re-forming the job, so --nodes MIN:MAX and --rdzv-endpoint "
                             "have no use with it.")
    node_rank = request.node_rank or 0
    if not 0 <= node_rank < nodes[0]:
        raise PreflightError(f"--node-rank {node_rank} does not fit --nodes {nodes[0]} (0..{nodes[0] - 1}).")
    if replicas < 1 or nproc % replicas:
        raise PreflightError(f"--replicas {replicas} must divide the {nproc} process(es) of --devices "
                             f"{request.devices}: each replica group gets the same number.")
    total = replicas * nodes[0]
    if min_replicas < 1 or min_replicas > total:
        raise PreflightError(f"--min-replicas {min_replicas}: give 1 to {total} (--replicas {replicas} on each "
                             f"of {nodes[0]} node(s)).")
    if not step_timeout > 0:
        raise PreflightError(f"--step-timeout {step_timeout}: a positive number of seconds.")
    size = nproc // replicas
    ids = visible.split(",") if visible is not None else [str(i) for i in range(nproc)]
    devices = [",".join(ids[g * size:(g + 1) * size]) for g in range(replicas)] if gpus else [str(size)] * replicas
    if nodes[0] == 1:
        host, port = ("127.0.0.1", 0) if not request.master else _split_host_port(request.master, "--master")
        return ReplicaPlan(devices, 0, host, port, True, "127.0.0.1", {}, [], min_replicas, step_timeout, total)
    if not request.master:
        raise PreflightError("--fault-tolerant on several nodes needs --master HOST:PORT: node 0 hosts the "
                             "lighthouse there, and the other nodes' groups reach it there.")
    host, port = _split_host_port(request.master, "--master")
    environment, notes, local_address = _network(host, nodes[0])
    return ReplicaPlan(devices, node_rank * replicas, host, port, node_rank == 0, local_address, environment, notes,
                       min_replicas, step_timeout, total)
