"""Sockets for rendezvous: a free port, and a store that listens on one address only."""

from __future__ import annotations

import socket
from collections.abc import Mapping
from typing import Any

from lockstep.errors import NoRouteError


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def listening(host: str, port: int, timeout_s: float) -> bool:
    """Whether something accepts connections at ``host:port`` (tried once, for at most ``timeout_s``): a
    quiet probe before a store client, whose own retries log a C++ stack trace each while nobody listens
    there (a rendezvous store hosted by a node not started yet)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def host_store(host: str, port: int = 0, timeout: Any = None) -> tuple[Any, int]:
    """Host the rendezvous store on ``host:port`` only (port 0: a free one); returns (store, port).

    torch's TCPStore server listens on every interface. This one listens on the socket bound here,
    and the torch elastic agent in this process reuses it (``multi_tenant``): a single-node job's
    store is then reachable from loopback only. Keep the store alive while the job runs.
    """
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # as torch's own store: a job started again at once binds its port while the last one's connections
    # wait out TCP's TIME_WAIT (another program listening there is still refused)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, port))
        listener.listen(128)
    except OSError:
        listener.close()
        raise
    port = int(listener.getsockname()[1])
    options = {} if timeout is None else {"timeout": timeout}
    store = dist.TCPStore(host, port, is_master=True, multi_tenant=True, wait_for_workers=False,
                          master_listen_fd=listener.detach(), **options)
    return store, port


def store_listen_address(master_addr: str, one_node: bool) -> str | None:
    """Where rank 0 hosts the store: the IPv4 address ``master_addr`` names, so that it listens on
    the interface the other ranks reach it by (loopback on one node), not on every interface.
    None (every interface) only when a job of several nodes names its master by a loopback
    address, which the other nodes could not reach anyway."""
    try:
        address = str(socket.getaddrinfo(master_addr, None, socket.AF_INET, socket.SOCK_STREAM)[0][4][0])
    except (OSError, IndexError):
        return None
    if address.startswith("127.") and not one_node:
        return None
    return address


SOCKET_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def ipv4_of(interface: str) -> str | None:
    """The IPv4 address of ``interface`` (Linux), or None."""
    try:
        import fcntl
        import struct

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", interface[:15].encode()))  # SIOCGIFADDR
        return socket.inet_ntoa(packed[20:24])
    except (OSError, ImportError):
        return None


def interfaces() -> dict[str, str | None]:
    """Interface name -> IPv4 address (None when it has none)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        names = []
    return {name: ipv4_of(name) for name in names}




def interface_towards(host: str) -> tuple[str, str]:
    """(interface, its address) that this node's routing table uses to reach ``host``.

    A UDP socket connected to ``host`` takes the kernel's route and source address without sending
    anything; the interface is the one that holds that source address.
    """
    found = interfaces()
    seen = ", ".join(f"{name} ({ip})" if ip else name for name, ip in found.items()) or "none"
    try:
        address = socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((address, 9))
            source = probe.getsockname()[0]
    except OSError as error:
        raise NoRouteError(f"no network interface of this node reaches {host} ({error.strerror or error}); "
                           f"interfaces seen: {seen}") from None
    name = next((name for name, ip in found.items() if ip == source), None)
    if name is None:
        raise NoRouteError(f"the route to {host} leaves from {source}, which no interface holds; "
                           f"interfaces seen: {seen}")
    return name, source


def socket_interface_variables(host: str, environ: Mapping[str, str]) -> tuple[dict[str, str], str]:
    """GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME values for the interface that reaches ``host``.

    Only the variables unset in ``environ`` are returned, with the one line that says so (no
    variables and an empty line when the user set both). Raises NoRouteError when no interface
    reaches ``host``: Gloo would otherwise take the interface of this host's name, which is
    loopback on many images, and the nodes could not connect.
    """
    unset = [name for name in SOCKET_VARIABLES if not environ.get(name)]
    if not unset:
        return {}, ""
    name, source = interface_towards(host)
    return ({variable: name for variable in unset},
            f"network interface {name} ({source}) reaches {host}: {' and '.join(unset)}={name}")
