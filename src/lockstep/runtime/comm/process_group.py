"""Create and destroy the default process group, with errors that say what went wrong."""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from lockstep.env import DistEnv
from lockstep.errors import ConfigError, RendezvousError
from lockstep.runtime._torch_compat import set_default_timeout
from lockstep.runtime.comm.network import NoRouteError, host_store, socket_interface_variables, store_listen_address

BACKENDS = ("gloo", "nccl", "mpi")


def choose_backend(accelerator: str, backend: str | None, shares_gpu: bool = False, sharded: bool = False) -> str:
    """NCCL for CUDA, Gloo for CPU; ``mpi`` only on request and where torch was built with it.

    ``shares_gpu``: this rank's GPU also runs another rank of the job. NCCL refuses that (it needs one
    GPU per rank), so the default is then Gloo, which runs DDP's collectives on CUDA tensors too.
    ``sharded``: the strategy is FSDP or a device mesh on several processes, whose collectives crash
    torch's Gloo on CUDA tensors; refused there."""
    chosen = _backend(accelerator, backend, shares_gpu)
    if chosen == "gloo" and accelerator == "cuda" and sharded:
        raise ConfigError(
            "FSDP and the device mesh (tensor or pipeline parallel, DDP with tp or pp) over Gloo on CUDA tensors: "
            "torch's Gloo crashes in their collectives (a segmentation fault, seen on torch 2.11 with 2 and 4 "
            "processes on one GPU). Use NCCL with one GPU per process, strategy='ddp' (which runs over Gloo on "
            "CUDA, also with several processes on one GPU), or accelerator='cpu'.")
    return chosen


def _backend(accelerator: str, backend: str | None, shares_gpu: bool) -> str:
    if backend is None:
        return "nccl" if accelerator == "cuda" and not shares_gpu else "gloo"
    if backend == "nccl" and shares_gpu:
        raise ConfigError("backend 'nccl' with several processes on one GPU (a GPU index listed twice in "
                          "devices): NCCL needs one GPU per rank. Use backend='gloo' (the default there), or "
                          "one process per GPU.")
    if backend not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}: use one of {', '.join(BACKENDS)}.")
    available = {
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "mpi": dist.is_mpi_available(),
    }
    if not available[backend]:
        built = [name for name, there in available.items() if there]
        raise ConfigError(f"backend {backend!r} is not built into this torch; it has {', '.join(built) or 'none'}: "
                          "leave backend unset (lockstep chooses), or name one of those.")
    if backend == "nccl" and accelerator != "cuda":
        raise ConfigError("backend 'nccl' needs CUDA tensors: use backend='gloo' on the CPU.")
    return backend


def init_process_group(
    env: DistEnv,
    backend: str,
    timeout_s: float,
    init_method: str | None = None,
    device: torch.device | None = None,
) -> bool:
    """Join the job's process group; returns True if this call created it.

    Every rank must call it. It blocks until all ``env.world_size`` ranks have arrived, for at
    most ``timeout_s`` seconds. A group that already exists (``lockstep.launch`` made one) is
    adopted after checking that its size matches, and its collectives get ``timeout_s`` too.
    """
    timeout = timedelta(seconds=timeout_s)
    if dist.is_initialized():
        if dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
            raise RendezvousError(
                f"a process group already exists with rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but the environment says rank {env.rank} of "
                f"{env.world_size}: create the Runtime before calling init_process_group yourself, "
                "or not at all."
            )
        set_default_timeout(timeout)  # the Runtime's timeout governs its collectives
        return False
    device_id = device if device is not None and device.type == "cuda" else None
    if backend == "mpi":
        dist.init_process_group("mpi", timeout=timeout)
        return True
    choose_socket_interface(env)
    if init_method is not None:
        dist.init_process_group(
            backend, init_method=init_method, rank=env.rank, world_size=env.world_size,
            timeout=timeout, device_id=device_id,
        )
        return True
    store = _connect_store(env, timeout)
    _check_everyone_joined(store, env, timeout)
    dist.init_process_group(
        backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout,
        device_id=device_id,
    )
    return True


def _check_everyone_joined(store: dist.Store, env: DistEnv, timeout: timedelta) -> None:
    """Before the backend's own rendezvous (whose timeout names a store key, not a rank): every rank of
    ``env.world_size`` joined the store, started for the same world size. Rank 0 waits for them all and
    writes its verdict, which every rank reads: a rank never started (or failed before its Runtime) is
    named on every rank, as are ranks started with another ``WORLD_SIZE``."""
    joined = [f"lockstep/joined/{rank}" for rank in range(env.world_size)]
    store.set(f"lockstep/joined/{env.rank}", str(env.world_size))
    if env.rank == 0:
        try:
            store.wait(joined, timeout)
            sizes = store.multi_get(joined)
            other = {rank: size.decode() for rank, size in enumerate(sizes) if size.decode() != str(env.world_size)}
            verdict = "ok" if not other else (
                f"the ranks were started for different world sizes (rank 0: {env.world_size}, " +
                ", ".join(f"rank {rank}: {size}" for rank, size in other.items()) +
                "): start every rank with the same WORLD_SIZE (the same --ntasks, --nproc-per-node, nodes).")
        except RuntimeError:  # a rank did not join within the timeout
            missing = [rank for rank in range(env.world_size) if not store.check([joined[rank]])]
            verdict = (f"rank(s) {', '.join(map(str, missing))} of {env.world_size} did not join within "
                       f"{timeout.total_seconds():.0f}s: each was never started, failed before joining (its "
                       "own error says why), or was started with a smaller WORLD_SIZE or another "
                       "MASTER_ADDR/MASTER_PORT.")
        store.set("lockstep/joined/verdict", f"{env.world_size} {verdict}")
    else:
        try:
            store.wait(["lockstep/joined/verdict"], 2 * timeout)  # rank 0 waits up to timeout for the others
        except RuntimeError:
            raise RendezvousError(f"rank {env.rank}: rank 0 gave no word within {2 * timeout.total_seconds():.0f}s "
                                  "of the ranks joining: its own error says why.") from None
    size, _, verdict = store.get("lockstep/joined/verdict").decode().partition(" ")
    if verdict == "ok" and size != str(env.world_size):
        verdict = (f"this rank was started for a world of {env.world_size} ranks, rank 0 for {size}: start every "
                   "rank with the same WORLD_SIZE.")
    if verdict != "ok":
        raise RendezvousError(f"rank {env.rank}: {verdict}")


def init_single_process_group(backend: str, timeout_s: float) -> bool:
    """A group of this one process, over an in-memory store (no port, no peer): what FSDP's CPU
    offload needs to shard a model on one device. True if this call created it."""
    if dist.is_initialized():
        return False
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timedelta(seconds=timeout_s))
    return True


def choose_socket_interface(env: DistEnv) -> None:
    """On several nodes, point Gloo and NCCL at the interface that reaches the master, unless set.

    Without it Gloo binds to the address of this host's name, a loopback address on many images
    (Debian and Ubuntu map it in /etc/hosts), and the nodes cannot connect to each other.
    """
    if env.num_nodes < 2:
        return
    try:
        variables, line = socket_interface_variables(env.master_addr, os.environ)
    except NoRouteError as error:
        raise RendezvousError(
            f"rank {env.rank}: {error}. Set GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME) to the interface "
            "between the nodes, or check MASTER_ADDR."
        ) from None
    os.environ.update(variables)
    if line and env.local_rank == 0:
        print(f"lockstep: node {env.node_rank}: {line}", file=sys.stderr, flush=True)


def _connect_store(env: DistEnv, timeout: timedelta) -> dist.Store:
    """Rank 0 hosts the rendezvous store unless a torch elastic agent already does.

    The agent's store outlives a restart of the workers, so each attempt gets its own key prefix
    (as torch's env:// does), or keys of the failed attempt would mix into the new one.
    """
    is_master = env.rank == 0 and not env.agent_store
    address = f"{env.master_addr}:{env.master_port}"
    try:
        if is_master:
            listen = store_listen_address(env.master_addr, env.num_nodes == 1)
            if listen is not None:
                store, _ = host_store(listen, int(env.master_port or 0), timeout)
            else:
                store = dist.TCPStore(env.master_addr, int(env.master_port or 0), is_master=True, timeout=timeout,
                                      wait_for_workers=False)
        else:
            store = _connect_within(env.master_addr, int(env.master_port or 0), timeout)
        if env.agent_store:
            return dist.PrefixStore(f"/worker/attempt_{env.restart_count}", store)
        return store
    except (RuntimeError, OSError) as error:
        text = str(error).lower()
        if is_master and ("address already in use" in text or "errno 98" in text):
            raise RendezvousError(
                f"rank 0 cannot open the rendezvous store on port {env.master_port}: another "
                "program is using it. Set MASTER_PORT to a free port (or let `lockstep run` pick "
                "one)."
            ) from error
        if is_master:
            raise RendezvousError(
                f"rank 0 cannot open the rendezvous store at {address}: {error}. Check that "
                "MASTER_ADDR is an address of this node."
            ) from error
        raise RendezvousError(
            f"rank {env.rank} could not reach the rendezvous store at {address} within "
            f"{timeout.total_seconds():.0f}s: check that MASTER_ADDR/MASTER_PORT name the node "
            "of rank 0, that rank 0 started, and that no firewall blocks the port."
        ) from error


def _connect_within(host: str, port: int, timeout: timedelta) -> dist.TCPStore:
    """A TCPStore client, connected within about ``timeout``, then waiting ``timeout`` per operation.

    A TCPStore client given timeout T tries to connect for T, sleeps a random part of T and
    tries for T again: up to about 2.6 T when nobody answers. Short tries until the deadline
    keep the whole wait near T.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        left = deadline - time.monotonic()
        attempt = timedelta(seconds=max(1.0, min(10.0, left / 2.6)))
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=attempt, wait_for_workers=False)
        except dist.DistNetworkError:
            if deadline - time.monotonic() < 1.0:
                raise
            continue
        store.set_timeout(timeout)
        return store


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
