"""The Runtime's checkpoint methods: ``rt.save``, ``rt.load``, ``rt.verify_checkpoint``,
``rt.wait_for_save``. The machinery (DCP, the on-disk format, checksums) lives in ``checkpoint/`` and
loads at the first save or load."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lockstep.env import checksums_from_environ
from lockstep.errors import CheckpointError

if TYPE_CHECKING:
    from torch import nn

    from lockstep.runtime.checkpoint.checkpointer import Checkpointer
    from lockstep.runtime.faults.watchdog import Watchdog
    from lockstep.runtime.parallel.strategy import Strategy


class CheckpointMethods:
    """Mixed into ``Runtime``: saving and loading checkpoint folders on every rank."""

    _checkpointer: Checkpointer | None
    _watchdog: Watchdog
    strategy: Strategy

    if TYPE_CHECKING:  # given by Runtime
        @property
        def rank(self) -> int: ...
        @property
        def world_size(self) -> int: ...
        def barrier(self) -> None: ...
        def sync_buffers(self, model: nn.Module, src: int = 0) -> None: ...

    def save(self, path: str | Path, state: dict[str, Any], blocking: bool = True,
             metadata: dict[str, Any] | None = None, on_commit: Callable[[], None] | None = None) -> float:
        """Save ``state`` as the checkpoint folder ``path``; every rank calls it. Returns the seconds
        the call blocked.

        Models (what ``rt.setup`` returned) and their optimizers are saved by parameter name, each
        rank writing its own shards; loaders and anything else with ``state_dict()`` are saved
        through it; other values (numbers, strings, tensors, dicts of them) as they are on rank 0.
        The folder is committed atomically and loads on any number of processes and any strategy
        (``rt.load``). ``blocking=False`` writes in the background while training goes on (see
        ``wait_for_save``). ``metadata``: JSON values added to the folder's ``lockstep.json``
        (readable without loading, e.g. the step). ``on_commit``: run on rank 0 once the folder is
        complete (after the background write, with ``blocking=False``).
        """
        from lockstep.runtime.checkpoint.parts import split_state

        sharded, objects, optimizer_of = split_state(state)
        for part in sharded.values():  # the ranks' buffers may differ: rank 0's are the model's
            self.sync_buffers(part.model)
        from lockstep.runtime.checkpoint.hf_export import describe

        hf_models = {name: d for name, part in sharded.items() if (d := describe(part.model)) is not None}
        info = {**(metadata or {}), "world_size": self.world_size, "strategy": self.strategy.name,
                "optimizers": optimizer_of, **({"hf_models": hf_models} if hf_models else {})}
        with self._watchdog.watch("checkpoint save"):
            return self._checkpoints().save(path, sharded, objects, info, blocking=blocking, then=on_commit)

    def load(self, path: str | Path, state: dict[str, Any], verify: bool = True) -> dict[str, Any]:
        """Load the checkpoint folder ``path`` into ``state``, as given to ``rt.save``: models,
        optimizers, loaders and other objects with ``load_state_dict`` in place; plain values (None
        too) are replaced in ``state``, which is also returned. Every rank calls it, with the same
        keys. The files are checked against their checksums first (``verify=False``: already done,
        by ``verify_checkpoint``); a damaged checkpoint is refused, naming the file.
        """
        from lockstep.runtime.checkpoint.parts import is_stateful, split_state

        sharded, _, optimizer_of = split_state(state)
        with self._watchdog.watch("checkpoint load"):
            objects = self._checkpoints().load(path, sharded, verify_files=verify)
        for name, value in state.items():
            if name in sharded or name in optimizer_of:
                continue
            if name not in objects:
                raise CheckpointError(f"{path}: holds no {name!r}; it holds {sorted(objects)}.")
            if is_stateful(value):
                value.load_state_dict(objects[name])
            else:
                state[name] = objects[name]
        return state

    def verify_checkpoint(self, path: str | Path) -> list[str]:
        """Every problem with the files of checkpoint ``path`` (none when intact: each file matches the
        checksum written at commit, and nothing in it would run code). Every rank calls it, reads its
        share of the files, and gets the same list."""
        with self._watchdog.watch("checkpoint verify"):
            return self._checkpoints().verify(path)

    def wait_for_save(self) -> None:
        """Block until a background save (``save(blocking=False)``) is written and committed; raise its
        error if it failed. Returns at once when none is under way. Every rank calls it."""
        if self._checkpointer is not None:
            self._checkpointer.wait()

    def _checkpoints(self) -> Checkpointer:
        if self._checkpointer is None:
            from lockstep.runtime.checkpoint.checkpointer import Checkpointer

            self._checkpointer = Checkpointer(self.rank, self.world_size, self.barrier, checksums_from_environ())
        return self._checkpointer
