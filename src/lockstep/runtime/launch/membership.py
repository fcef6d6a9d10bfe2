"""Which nodes an elastic job runs on, and what changed since the previous attempt.

The rendezvous store (``lockstep run --nodes MIN:MAX`` names it in LOCKSTEP_ELASTIC_STORE)
outlives the workers, so each attempt records its nodes and world size there; the next attempt
compares and says which nodes left or joined.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lockstep.env.lines import printable
from lockstep.runtime.comm.network import ipv4_of

_KEY = "lockstep/membership"


def node_label() -> str:
    """This node as the others' messages name it: host name, and address between the nodes when known."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME", "")
    address = ipv4_of(interface) if interface else None
    return f"{socket.gethostname()} ({address})" if address else socket.gethostname()


def membership_change(address: str, rank: int, world_size: int, all_gather: Callable[[Any], list[Any]]) -> str:
    """On rank 0, the change of nodes and world size since the previous attempt ('' when none).

    ``address`` is the rendezvous store's HOST:PORT; every rank must call this.
    """
    labels = all_gather(node_label())
    nodes = list(dict.fromkeys(labels))
    if rank != 0:
        return ""
    host, _, port = address.rpartition(":")
    store = dist.TCPStore(host, int(port), is_master=False, wait_for_workers=False, timeout=timedelta(seconds=30))
    previous = _previous(store.get(_KEY)) if store.check([_KEY]) else None
    store.set(_KEY, "\n".join([str(world_size), *nodes]))
    if previous is None:
        return ""
    before, old_nodes = previous
    left = [node for node in old_nodes if node not in nodes]
    joined = [node for node in nodes if node not in old_nodes]
    if not left and not joined and before == world_size:
        return ""
    parts = [f"node {', '.join(names)} {verb}" for names, verb in ((left, "left"), (joined, "joined")) if names]
    return (f"the job re-formed: {'; '.join(parts) or 'same nodes'}; world size {before} -> {world_size} "
            f"on {len(nodes)} node(s)")


def _previous(raw: bytes) -> tuple[int, list[str]] | None:
    """The previous attempt's world size and node labels, read as untrusted (anyone who reaches the store may
    have written it): None when it is not that, as when there was no previous attempt."""
    lines = raw[:65536].decode(errors="replace").split("\n")
    if not (lines[0].isdigit() and len(lines[0]) <= 9) or len(lines) > 1 + 4096:
        return None
    return int(lines[0]), [printable(line, 128) for line in lines[1:]]


def report_membership(address: str, rank: int, world_size: int, all_gather: Callable[[Any], list[Any]]) -> None:
    """Rank 0 prints the change that ``membership_change`` finds, if any; every rank must call this."""
    change = membership_change(address, rank, world_size, all_gather)
    if change:
        print(f"lockstep: {change}.", flush=True)
