"""A checkpoint's whole life for one Runtime: saving, finding the newest, the ranks' agreement on
it, verifying, loading. ``rt.save``, ``rt.load``, ``rt.verify_checkpoint``, ``rt.latest_checkpoint``
and ``rt.resume`` each delegate to one method here; the Trainer uses the same ones.

The order of a resume, in one place (``Checkpoints.find``): list the folder's complete
checkpoints from their metadata (each ``lockstep.json`` read once), with the newest one the engine
recorded when it trained further (Ray Train's copy, ``ray_record``), the newest first; check that
every rank sees the same list; verify each one's files in turn until one is intact; hand back its
path with that metadata, which ``load`` then uses instead of reading it again. DCP loads at the
first save or load (``checkpointer``), not at import.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lockstep.env import verify_from_environ
from lockstep.errors import CheckpointError, NoSuchCheckpointError
from lockstep.runtime.checkpoint.format import METADATA, is_checkpoint_folder, read_metadata

if TYPE_CHECKING:
    from torch import nn

    from lockstep.runtime.checkpoint.checkpointer import Checkpointer
    from lockstep.runtime.checkpoint.ray_record import RayRecord
    from lockstep.runtime.faults.watchdog import Watchdog


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint folder and its metadata (``lockstep.json``), as read once."""

    path: Path
    metadata: dict[str, Any] = field(repr=False)

    @property
    def step(self) -> int:
        """The training step it was saved at (-1 when its metadata holds none and its name neither)."""
        try:
            return int(self.metadata.get("step", _step_in_name(self.path)))
        except (TypeError, ValueError):
            return -1

    @classmethod
    def read(cls, path: Path | str) -> Checkpoint:
        """The checkpoint at ``path``; an error that says why when it is none."""
        return cls(Path(path), read_metadata(path))


def _step_in_name(path: Path) -> int:
    match = re.search(r"step=(\d+)", path.name)
    return int(match.group(1)) if match else -1


def complete_checkpoints(folder: Path | str) -> list[Checkpoint]:
    """The complete checkpoint folders in ``folder``, the most training steps first (ties: the newest
    first). Judged by their metadata alone, each read once; links (``last.ckpt``) are skipped, the
    folder they point to is listed itself; a folder with damaged metadata is left out."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        if path.is_symlink() or not is_checkpoint_folder(path):
            continue
        try:
            checkpoint = Checkpoint.read(path)
            found.append((checkpoint.step, path.stat().st_mtime, checkpoint))
        except (CheckpointError, OSError):
            continue  # e.g. damaged metadata: fall back to an older one
    return [checkpoint for *_, checkpoint in sorted(found, key=lambda c: c[:2], reverse=True)]


@dataclass
class Ranks:
    """What the checkpoint room needs of the job: where this rank sits, and the Runtime's watched
    collectives (a rank that never arrives is named, not waited for)."""

    rank: int
    world_size: int
    barrier: Callable[[], None]
    all_gather: Callable[[Any], list[Any]]
    sync_buffers: Callable[[nn.Module], None]
    say: Callable[[str], None]
    watchdog: Watchdog


_LOSS_SCALE = "lockstep.loss_scale"  # the precision's state in the objects of a checkpoint that was not given it


class Checkpoints:
    """Saves, finds, verifies and loads checkpoint folders; every rank calls every method."""

    def __init__(self, ranks: Ranks, strategy_name: str, checksums: bool, record: RayRecord | None = None,
                 precision: Any = None) -> None:
        """``record``: the engine's record of the job's checkpoints (Ray Train), told of each committed
        checkpoint and asked for its newest at a resume. ``precision``: the Runtime's, whose loss scale
        (``16-mixed``) every checkpoint holds, unless the state given holds it already."""
        self.ranks, self.strategy_name, self.checksums, self.record = ranks, strategy_name, checksums, record
        self.precision = precision
        self._checkpointer: Checkpointer | None = None  # made at the first save or load (it imports DCP)
        self._unreported: tuple[Path, dict[str, Any]] | None = None  # a background save the record awaits
        # Under lockstep verify: this run's record folder, stamped on what it saves. Its runs share the script's
        # arguments, so a checkpoint folder too: one run must not resume from what another saved.
        verifying = verify_from_environ()
        self.verify_run = verifying[0] if verifying is not None else None

    # -- saving ---------------------------------------------------------------------------------
    def save(self, path: Path | str, state: dict[str, Any], blocking: bool, metadata: dict[str, Any] | None,
             on_commit: Callable[[], None] | None) -> float:
        from lockstep.runtime.checkpoint.hf_export import describe
        from lockstep.runtime.checkpoint.parts import OPTIMIZERS_BY_PARAMETER, split_state

        _replaceable(Path(path))
        state = self._with_loss_scale(state)
        sharded, objects, optimizer_of = split_state(state)
        for part in sharded.values():  # the ranks' buffers may differ: rank 0's are the model's
            self.ranks.sync_buffers(part.model)
        _say_pending_gradients([name for name, part in sharded.items()
                                if part.optimizers and _holds_gradients(part.model)])
        hf_models = {name: d for name, part in sharded.items() if (d := describe(part.model)) is not None}
        # An optimizer that has taken no step has no state: DCP makes it one (a step at lr 0, which counts in
        # Adam's step), so the live optimizer is given its empty state back and a load empties it again.
        fresh = sorted(name for name in optimizer_of if not state[name].state)
        info = {**(metadata or {}), "world_size": self.ranks.world_size, "strategy": self.strategy_name,
                "optimizers": optimizer_of, "optimizer_layout": OPTIMIZERS_BY_PARAMETER,
                **({"stateless_optimizers": fresh} if fresh else {}),
                **({"hf_models": hf_models} if hf_models else {}),
                **({"verify_run": self.verify_run} if self.verify_run is not None else {})}
        reported = self.wait() if self.record is not None else 0.0  # the record hears of saves in order
        with self.ranks.watchdog.watch("checkpoint save"):
            try:
                blocked = self._files().save(path, sharded, objects, info, blocking=blocking, then=on_commit)
            finally:  # the state DCP made is in the save (staged): the live optimizers have none, as before
                for name in fresh:
                    state[name].state.clear()
        if self.record is not None:
            self._unreported = (Path(path), info)
            if blocking:
                self._report()
        return reported + blocked

    def _report(self) -> float:
        """Tell the record of the committed checkpoint not yet reported (every rank, at the same point:
        after a blocking save, else when the background save is next waited for). Returns the seconds."""
        start = time.perf_counter()
        if self.record is not None and self._unreported is not None:
            (path, info), self._unreported = self._unreported, None
            with self.ranks.watchdog.watch("checkpoint report to Ray Train"):
                self.record.report(path, info)
        return time.perf_counter() - start

    def prepare_folder(self, folder: Path | str) -> None:
        """Before training: remove what interrupted saves left (``.NAME.partial`` folders, on rank 0),
        and check that every rank can write into ``folder``, so that a read-only or missing folder
        fails now, naming itself, instead of at the first save."""
        folder, rank = Path(folder), self.ranks.rank
        if rank == 0 and folder.is_dir():
            for leftover in folder.glob(".*.partial"):
                if leftover.is_dir() and not leftover.is_symlink():
                    shutil.rmtree(leftover, ignore_errors=True)
        problem = ""
        probe = folder / f".lockstep-write-check-{rank}-{os.getpid()}"
        try:
            folder.mkdir(parents=True, exist_ok=True)
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as error:
            problem = f"rank {rank} on {socket.gethostname()}: {error.strerror or error}"
        problems = [p for p in self.ranks.all_gather(problem) if p]
        if problems:
            raise CheckpointError(f"cannot write checkpoints into {folder}: " + "; ".join(problems)
                                  + ". Choose a checkpoint folder every rank can write to.")

    # -- finding and agreeing ---------------------------------------------------------------------
    def find(self, source: Path | str, exact: bool = False) -> Checkpoint | None:
        """The checkpoint to resume from, the same on every rank, or an error that says why not.

        ``source`` is a checkpoint folder (that one, refused if damaged) or a folder of them (the
        newest complete one whose files match their checksums; a damaged one is skipped, in one line
        saying which file and why; None when there is none). Each rank looks on its own file system:
        one that the nodes do not share would otherwise resume some ranks and train the others anew.
        """
        source = Path(source)
        one = exact or is_checkpoint_folder(source) or (source / METADATA).exists()
        found: list[Checkpoint] = []
        failure: CheckpointError | None = None
        try:
            if exact and not source.exists():
                raise NoSuchCheckpointError(f"{source}: no such checkpoint.")
            if one:
                found = [Checkpoint.read(source)]
            elif source.exists() and not source.is_dir():
                raise CheckpointError(f"{source}: a file, not a checkpoint folder or a folder of checkpoints.")
            else:
                found = self._with_recorded(complete_checkpoints(source))
            found = self._this_verify_run(found, one)
        except CheckpointError as error:
            failure = error
        self._agree(str(failure or "") or ", ".join(f"{c.path.name} (step {c.step})" for c in found) or "none")
        if failure is not None:
            raise failure
        for checkpoint in found:
            damage = self.verify(checkpoint.path, checkpoint.metadata)
            if not damage:
                return checkpoint
            if one:
                raise CheckpointError(f"{checkpoint.path}: damaged, not resumed from:\n  " + "\n  ".join(damage))
            more = f" (and {len(damage) - 1} more)" if len(damage) > 1 else ""
            self.ranks.say(f"lockstep: skipping the damaged checkpoint {checkpoint.path.name}: {damage[0]}{more}")
        return None

    def _this_verify_run(self, found: list[Checkpoint], one: bool) -> list[Checkpoint]:
        """Under lockstep verify, ``found`` less what another of its runs saved (a checkpoint given by name is
        refused): each run starts where the script starts it, not where the other run got to."""
        if self.verify_run is None:
            return found
        other = [c for c in found if c.metadata.get("verify_run") not in (None, self.verify_run)]
        if other and one:
            raise CheckpointError(f"{other[0].path}: saved by another run of this lockstep verify (the runs share the "
                                  "script's arguments): give the script a checkpoint folder of each world size, or "
                                  "none, to verify it.")
        if other:
            self.ranks.say(f"lockstep verify: not resuming from {', '.join(c.path.name for c in other)} in "
                           f"{other[0].path.parent}: saved by another run of this verify.")
        return [c for c in found if c not in other]

    def _with_recorded(self, found: list[Checkpoint]) -> list[Checkpoint]:
        """``found`` and, where it trained further, the newest checkpoint the record holds (after Ray
        restarted the workers, perhaps on other nodes: Ray's copy in its storage), the most steps first."""
        path = self.record.newest() if self.record is not None else None
        if path is None or any(c.path.resolve() == path.resolve() for c in found):
            return found
        try:
            recorded = Checkpoint.read(path)
        except CheckpointError as error:
            self.ranks.say(f"lockstep: the checkpoint Ray Train holds is not one to resume from: {error}")
            return found
        if found and found[0].step >= recorded.step:
            return found
        return [recorded, *found]

    def _agree(self, mine: str) -> None:
        """Every rank must have found the same checkpoints: else an error naming what each saw."""
        seen = self.ranks.all_gather((socket.gethostname(), mine))
        if len({what for _, what in seen}) > 1:
            lines = [f"  rank {r} on {host}: {what}" for r, (host, what) in enumerate(seen)]
            raise CheckpointError(
                "the ranks cannot resume from the same checkpoint:\n" + "\n".join(lines) + "\n"
                "Every rank writes its shards into the checkpoint folder: put the checkpoint folder (or the "
                "resume path) on a file system that every node shares."
            )

    # -- verifying and loading ----------------------------------------------------------------------
    def verify(self, path: Path | str, metadata: dict[str, Any] | None = None) -> list[str]:
        with self.ranks.watchdog.watch("checkpoint verify"):
            return self._files().verify(path, metadata)

    def load(self, source: Path | str | Checkpoint, state: dict[str, Any], verify: bool) -> dict[str, Any]:
        from lockstep.runtime.checkpoint.parts import OPTIMIZERS_BY_PARAMETER, is_stateful, split_state

        checkpoint = source if isinstance(source, Checkpoint) else Checkpoint.read(source)
        by_parameter = checkpoint.metadata.get("optimizer_layout") == OPTIMIZERS_BY_PARAMETER
        sharded, _, optimizer_of = split_state(state, by_parameter)
        with self.ranks.watchdog.watch("checkpoint load"):
            objects = self._files().load(checkpoint.path, sharded, checkpoint.metadata, verify_files=verify)
        if _LOSS_SCALE in objects and state is not self._with_loss_scale(state):  # not given it: it is the run's own
            self.precision.load_state_dict(objects[_LOSS_SCALE])
        stateless = checkpoint.metadata.get("stateless_optimizers")
        for name in stateless if isinstance(stateless, list) else ():  # saved before their first step
            if name in optimizer_of:
                state[name].state.clear()
        for name, value in state.items():
            if name in sharded or name in optimizer_of:
                continue
            if name not in objects:
                raise CheckpointError(f"{checkpoint.path}: holds no {name!r}; it holds {sorted(objects)}.")
            if is_stateful(value):
                value.load_state_dict(objects[name])
            else:
                state[name] = objects[name]
        return state

    def _with_loss_scale(self, state: dict[str, Any]) -> dict[str, Any]:
        """``state`` with the precision's loss scale (``16-mixed``), unless it holds the precision already (the
        Trainer's does)."""
        scaled = self.precision is not None and getattr(self.precision, "scaler", None) is not None
        if not scaled or any(value is self.precision for value in state.values()):
            return state
        return {**state, _LOSS_SCALE: self.precision}

    # -- background saves ---------------------------------------------------------------------------
    def wait(self, report: bool = True) -> float:
        """Wait for a background save to be committed and, with ``report``, reported to the record (a
        barrier of every rank: not while a failing rank closes); returns the seconds spent reporting."""
        if self._checkpointer is not None:
            self._checkpointer.wait()
        return self._report() if report else 0.0

    def raise_if_failed(self) -> None:
        if self._checkpointer is not None:
            self._checkpointer.raise_if_failed()

    @property
    def saving(self) -> bool:
        """True while a background save is being written."""
        return self._checkpointer is not None and self._checkpointer.pending

    def _files(self) -> Checkpointer:
        if self._checkpointer is None:
            from lockstep.runtime.checkpoint.checkpointer import Checkpointer

            ranks = self.ranks
            self._checkpointer = Checkpointer(ranks.rank, ranks.world_size, ranks.barrier, self.checksums)
        return self._checkpointer


def _holds_gradients(model: Any) -> bool:
    """Gradients not yet stepped: some parameter's ``.grad`` is set and not all zero (this rank's shard), or
    FSDP keeps some unsharded between the micro-steps of an accumulation."""
    from lockstep.runtime._torch_compat import fsdp_unsynced_grads, to_local

    grads = [p.grad for p in model.parameters() if p.grad is not None] + list(fsdp_unsynced_grads(model))
    return any(bool(to_local(g).detach().ne(0).any()) for g in grads)


def _replaceable(path: Path) -> None:
    """A save replaces what is at ``path`` only where that is a checkpoint, a link (``last.ckpt``) or an empty
    folder: anything else there (a run's folder, a file) is the user's, and is refused, not deleted. Every rank
    asks (the folder is shared), so every rank refuses alike."""
    if path.is_symlink() or not path.exists() or is_checkpoint_folder(path):
        return
    if path.is_dir() and not any(path.iterdir()):
        return
    what = "a file" if not path.is_dir() else f"a folder that is no checkpoint (it holds {_some(path)})"
    raise CheckpointError(f"cannot save to {path}: it is {what}, which a save would replace. Give the checkpoint "
                          f"a name of its own, such as {path / 'step-1'}.")


def _some(folder: Path) -> str:
    names = sorted(entry.name for entry in itertools.islice(folder.iterdir(), 4))
    return ", ".join(names) + (", ..." if len(names) == 4 else "")


def _say_pending_gradients(names: list[str]) -> None:
    """A save in the middle of an accumulation: a checkpoint holds whole steps (weights, optimizer state, the
    loader past the micro-batches drawn), so the gradients summed since the last optimizer step are lost."""
    if names:
        import warnings

        warnings.warn(f"lockstep: rt.save while {', '.join(repr(n) for n in names)} holds gradients not yet "
                      "stepped (in the middle of a gradient accumulation): the checkpoint does not keep them, and a "
                      "run resumed from it skips those micro-batches. Save after optimizer.step() and zero_grad().",
                      stacklevel=4)
