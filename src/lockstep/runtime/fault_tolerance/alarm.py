"""The alarm of a step's all-reduce across replica groups: a participant whose all-reduce fails tells the
others, so that they stop waiting at once instead of at the step timeout."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from lockstep.errors import CollectiveError
from lockstep.runtime.fault_tolerance._torchft_compat import torch_group


class Alarm:
    """What a participant does when a step's all-reduce fails, so that the others stop waiting at once
    instead of at the step timeout (two things Gloo does not do):

    - tell the others: a key in the quorum's store (the one torchft's process group rendezvouses
      through), read by the participants whose all-reduce still waits (on one that failed, not on the
      one that died: Gloo's abort closes no connection). A store that cannot be reached (its host died
      with its group) counts as the key, once the all-reduce has had ``GONE_GRACE_S`` more to end (the
      host may have ended its job after the same all-reduce: its data is then already on the way);
    - abort the group without waiting for it: a Gloo group released while one of its all-reduces still
      waits blocks until that all-reduce times out, so the group is kept until it has ended.

    On CUDA, NCCL's abort ends the others' wait itself: only the abort is done.
    """

    POLL_S = 0.1  # how often a waiting all-reduce looks at the key
    GONE_GRACE_S = 2.0  # how long an all-reduce may still take once the store's host is gone

    def __init__(self, group_rank: int, connect_timeout: float, cuda: bool) -> None:
        self._group_rank, self._timeout, self._cuda = group_rank, connect_timeout, cuda
        self._quorum_id: int | None = None
        self._store: Any = None
        self._key = ""
        self._retired: list[tuple[Any, Any]] = []  # (torch group, its all-reduce that still waits)

    def arm(self, quorum: Any, step: int) -> None:
        """The key of this quorum's step ``step`` (a new store client when the quorum changed)."""
        self._retired = [(group, work) for group, work in self._retired if not work.is_completed()]
        if self._cuda:
            return
        if quorum.quorum_id != self._quorum_id:
            from torchft.process_group import create_store_client

            self._quorum_id, self._store = quorum.quorum_id, None
            try:
                self._store = create_store_client(
                    f"{quorum.store_address}/lockstep/{quorum.quorum_id}/{self._group_rank}",
                    timeout=timedelta(seconds=self._timeout))
            except RuntimeError:  # the store's host is gone: the step's all-reduce will fail by itself
                pass
        self._key = f"failed-{step}"

    def wait(self, work: Any) -> None:
        """Wait for ``work``; raise when it fails, or when another participant says the step failed."""
        if self._cuda or self._store is None:
            work.wait()
            return
        while not self._done(work, self.POLL_S):
            rung = self._rung()
            if rung == "gone" and self._done(work, self.GONE_GRACE_S):
                return  # the store's host ended its job after this same all-reduce: ours was finishing too
            if rung and not work.is_completed():  # done meanwhile: its own outcome counts
                raise CollectiveError("another participant's all-reduce of this step failed (a participant was lost)")

    @staticmethod
    def _done(work: Any, seconds: float) -> bool:
        """Whether ``work`` ended within ``seconds``; raise if it failed."""
        try:
            work.wait(timedelta(seconds=seconds))
            return True
        except RuntimeError:
            if work.is_completed():  # it failed, not the wait that ran out
                raise
            return False

    def _rung(self) -> str | None:
        """"key": a participant said the step failed; "gone": the store cannot be reached (its host died
        with its group, or ended its job after the step: a participant ends only after its all-reduce,
        so then this one's ends within moments); else None."""
        try:
            return "key" if self._store.check([self._key]) else None
        except RuntimeError:
            return "gone"

    def fail(self, pg: Any, work: Any) -> None:
        """This participant's all-reduce ``work`` on torchft's group ``pg`` failed: tell the others, and
        abort ``pg`` (torchft makes a new group at the next quorum) without waiting for ``work``."""
        if self._store is not None:
            try:
                self._store.set(self._key, "1")
            except RuntimeError:
                pass
        group = torch_group(pg)  # the torch group that torchft's wrapper lets go of on abort
        if group is not None and work is not None and not work.is_completed():
            self._retired.append((group, work))
        pg.abort()
