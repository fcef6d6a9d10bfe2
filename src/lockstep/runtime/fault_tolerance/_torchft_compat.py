"""Every private torchft API lockstep uses, in one place, each with its public alternative or why there is none
(as ``runtime/_torch_compat.py`` does for torch's). A torchft release that changes one of them breaks here,
by name, not somewhere in a step.

- ``Manager._client`` (its ``ManagerClient``) and ``ManagerClient._quorum``: the manager does not expose the
  last quorum it took (the replica ids in participant order, the healing plan), which the one-line reports
  of who left, joined or healed from whom need. No public alternative (torchft 0.x).
- ``ProcessGroupGloo._pg`` (the torch process group inside torchft's reconfigurable wrapper): a Gloo
  group released while one of its all-reduces still waits blocks until that all-reduce times out, so the
  group is kept until its work ends. No public alternative: ``abort`` drops the reference.
- ``torchft.manager.ManagerServer``, the name ``Manager.__init__`` builds its group's server with: torchft
  binds that server to ``[::]:{port}`` (every interface) and offers no bind address, and its gRPC service
  answers ``Kill``, ``ShouldCommit`` and ``Quorum`` from anyone who reaches it. ``manager_bound_to``
  replaces the name while one ``Manager`` is built, so that its server binds to one address, the one its
  peers reach it by; torchft's own ``bind`` argument then carries the address. No public alternative
  (torchft 0.2).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from lockstep.errors import ConfigError

_BINDING = threading.Lock()  # one Manager built at a time under the replaced name


class QuorumRecorder:
    """Stands in for torchft's manager client and keeps the last quorum it returned (the replica ids
    and the healing plan), which the manager does not expose; every other call goes through."""

    def __init__(self, client: Any) -> None:
        self._client, self.last = client, None

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        self.last = self._client._quorum(*args, **kwargs)
        return self.last

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)



def record_quorums(manager: Any) -> QuorumRecorder:
    """Put a ``QuorumRecorder`` between ``manager`` and its client; its ``last`` is the last quorum."""
    recorder = QuorumRecorder(manager._client)
    manager._client = recorder
    return recorder


def torch_group(pg: Any) -> Any:
    """The torch process group inside torchft's process group ``pg`` (None when it holds none)."""
    return getattr(pg, "_pg", None)


@contextlib.contextmanager
def manager_bound_to(address: str, group: int) -> Iterator[None]:
    """While a torchft ``Manager`` is built inside the block, its ``ManagerServer`` listens on ``address``
    only (the port torchft chose), not on every interface; an address it cannot listen on is said, naming
    replica group ``group``."""
    import torchft.manager as manager_module

    server_class = manager_module.ManagerServer
    host = f"[{address}]" if ":" in address and not address.startswith("[") else address

    def bound_server(*args: Any, bind: str, **kwargs: Any) -> Any:
        where = f"{host}:{bind.rsplit(':', 1)[1]}"
        try:
            return server_class(*args, bind=where, **kwargs)
        except RuntimeError as error:  # torchft says what the socket said
            raise ConfigError(f"replica group {group}: its torchft manager cannot listen on {where} ({error}): "
                              "MASTER_ADDR must be an address of this node (lockstep run --fault-tolerant sets "
                              "it).") from None

    with _BINDING:
        manager_module.ManagerServer = bound_server
        try:
            yield
        finally:
            manager_module.ManagerServer = server_class
