"""Sockets for rendezvous: a free port, and a store that listens on one address only."""

from __future__ import annotations

import socket
from typing import Any


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def host_store(host: str, port: int = 0) -> tuple[Any, int]:
    """Host the rendezvous store on ``host:port`` only (port 0: a free one); returns (store, port).

    torch's TCPStore server listens on every interface. This one listens on the socket bound here,
    and the torch elastic agent in this process reuses it (``multi_tenant``): a single-node job's
    store is then reachable from loopback only. Keep the store alive while the job runs.
    """
    import torch.distributed as dist

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind((host, port))
        listener.listen(128)
    except OSError:
        listener.close()
        raise
    port = int(listener.getsockname()[1])
    store = dist.TCPStore(host, port, is_master=True, multi_tenant=True, wait_for_workers=False,
                          master_listen_fd=listener.detach())
    return store, port
