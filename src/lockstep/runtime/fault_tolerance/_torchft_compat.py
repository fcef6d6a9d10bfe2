"""Every private torchft API lockstep uses, in one place, each with its public alternative or why there is none
(as ``runtime/_torch_compat.py`` does for torch's). A torchft release that changes one of them breaks here,
by name, not somewhere in a step.

- ``Manager._client`` (its ``ManagerClient``) and ``ManagerClient._quorum``: the manager does not expose the
  last quorum it took (the replica ids in participant order, the healing plan), which the one-line reports
  of who left, joined or healed from whom need. No public alternative (torchft 0.x).
- ``ProcessGroupGloo._pg`` (the torch process group inside torchft's reconfigurable wrapper): a Gloo
  group released while one of its all-reduces still waits blocks until that all-reduce times out, so the
  group is kept until its work ends. No public alternative: ``abort`` drops the reference.
"""

from __future__ import annotations

from typing import Any


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
