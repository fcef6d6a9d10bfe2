"""Checkpoints as folders: every rank writes its own shards, committed whole or not at all.

A checkpoint folder holds:

- the tensors of models and optimizers, written by ``torch.distributed.checkpoint`` (DCP): each
  rank writes the shards it holds (a replicated tensor is written once), nothing is gathered;
- ``state.pt``: the small non-tensor state (loader position, counters, schedulers, random states),
  written by rank 0 and read with weights-only unpickling;
- ``lockstep.json``: the metadata (format, step, world size, strategy, ...), readable without
  loading any tensor, with every other file's size and XXH3 checksum (``integrity``). It is
  written last: a folder without it is not a checkpoint.

A save goes to a hidden ``.NAME.partial`` folder that rank 0 renames to ``NAME`` once every rank
has written, so a crash mid-save leaves the previous checkpoint as it was. DCP reshards on load:
a checkpoint loads on any number of processes, under any strategy. Loading checks every file
against its checksum first, and runs no code from any file.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import io
import pickle
import re
import shutil
import struct
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from lockstep.errors import CheckpointError
from lockstep.runtime.checkpoint.format import FORMAT, OBJECTS, lockstep_version, publish, read_metadata, read_objects
from lockstep.runtime.checkpoint.integrity import (
    DCP_METADATA,
    SafePlanner,
    SafeReader,
    UnsafeCheckpointError,
    checksummed_writer,
    files_written_by,
    verify,
)
from lockstep.runtime.files import write_atomic


class Checkpointer:
    """Saves and loads checkpoint folders for one job. Every rank calls every method.

    ``blocking=False`` copies the state to host memory, then writes it in a background thread while
    training goes on (``dcp.async_save`` over a Gloo group of its own, so its collectives never mix
    with the training loop's); the checksums are computed in that thread too. The next save,
    ``wait()`` and ``close()`` wait for it; ``raise_if_failed()`` raises a failure as soon as it is known.
    """

    def __init__(self, rank: int, world_size: int, barrier: Callable[[], None], checksums: bool = True) -> None:
        """``checksums=False`` (``LOCKSTEP_CHECKPOINT_CHECKSUMS=0``) neither records checksums at a
        save nor checks them at a load: for checkpoints so large that reading them back costs too much."""
        self.rank, self.world_size, self._barrier = rank, world_size, barrier
        self.checksums = checksums
        # DCP warns at every save and load without a process group, the normal case for one process;
        # an async save warns from its background thread, where no catch_warnings block reaches: so
        # the filter is process-wide (adding it again replaces it).
        warnings.filterwarnings("ignore", message="torch.distributed is (disabled, )?unavailable or uninitialized")
        self._pending: concurrent.futures.Future[Any] | None = None
        self._group: Any = None

    def save(
        self, path: Path | str, sharded: dict[str, Any], objects: dict[str, Any], metadata: dict[str, Any],
        blocking: bool = True, then: Callable[[], None] | None = None,
    ) -> float:
        """Write ``sharded`` (DCP-stateful parts, e.g. ``ModelState``) and ``objects`` (rank 0's
        small state) to the folder ``path``. Rank 0 runs ``then`` after the commit. Returns the
        seconds the caller was blocked."""
        start = time.perf_counter()
        _refuse_unloadable(objects)
        self.wait()
        final = Path(path)
        partial = final.parent / f".{final.name}.partial"
        with _plainly(final, partial if self.rank == 0 else None):
            if self.rank == 0:
                shutil.rmtree(partial, ignore_errors=True)
                partial.mkdir(parents=True)
                write_atomic(partial / OBJECTS, lambda handle: torch.save(objects, handle))
        self._barrier()
        info = {"format": FORMAT, "lockstep": lockstep_version(), "saved_at": time.time(),
                "sharded": sorted(sharded), "objects": sorted(objects), **metadata}

        writer, written_files = checksummed_writer(partial)

        def commit() -> None:  # every rank, once every rank has written
            with _plainly(final, partial if self.rank == 0 else None):
                extra = (DCP_METADATA, OBJECTS) if self.rank == 0 else ()
                files = (self._gather(files_written_by(partial, self.rank, extra, written_files.sums))
                         if self.checksums else None)
                if self.rank == 0:
                    publish(partial, final, {**info, "files": files})
            if self.rank == 0 and then is not None:
                then()

        alone = not dist.is_initialized()
        if blocking:
            with _plainly(final, partial if self.rank == 0 else None):
                dcp.save(sharded, storage_writer=writer, no_dist=alone)
            commit()
            self._barrier()
        else:
            options: dict[str, Any] = {"no_dist": True} if alone else {"process_group": self._files_group()}
            written = dcp.async_save(sharded, storage_writer=writer, **options)
            self._pending = _then(written, commit, final, partial if self.rank == 0 else None)  # type: ignore[arg-type]
        return time.perf_counter() - start

    def load(self, path: Path | str, sharded: dict[str, Any], metadata: dict[str, Any],
             verify_files: bool = True) -> dict[str, Any]:
        """Load the sharded parts in place (resharded to this job) and return the saved objects.

        ``metadata`` is the folder's, already read (a missing or foreign folder was refused then).
        The files are checked against the checksums written at commit first (each rank checks its
        share), unless ``verify_files`` is False; a damaged checkpoint is refused, naming the file."""
        path = Path(path)
        if verify_files:
            problems = self.verify(path, metadata)
            if problems:
                raise CheckpointError(f"{path}: damaged, not loaded:\n  " + "\n  ".join(problems))
        try:
            reader = SafeReader(str(path))
            stored = set(reader.read_metadata().state_dict_metadata)
            for name, part in sharded.items():  # which optimizer states the checkpoint holds (see ModelState)
                part.stored = {key.removeprefix(f"{name}.") for key in stored if key.startswith(f"{name}.")}
            self._refuse_other_weights(path, stored, sharded)
            dcp.load(sharded, checkpoint_id=str(path), no_dist=not dist.is_initialized(),
                     storage_reader=reader, planner=SafePlanner())
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as error:  # noqa: BLE001 - DCP's own is a BaseException
            # The reason is quoted; DCP's text repeats every rank's traceback (about 200 lines of noise).
            raise _load_error(path, error) from None
        return read_objects(path)

    def _refuse_other_weights(self, path: Path, stored: set[str], sharded: dict[str, Any]) -> None:
        """DCP loads the weights it is asked for and ignores the rest: a larger model's checkpoint would load into
        a smaller one. Refused (on every rank alike) when it holds a weight that no rank's model has (pipeline
        stages each hold their own)."""
        asked = sorted(f"{name}.model.{key}" for name, part in sharded.items() for key in part.model_keys())
        everyone = {key for keys in self._gather({"asked": asked}, everyone=True).values() for key in keys}
        models = tuple(f"{name}.model." for name in sharded)
        extra = sorted(key for key in stored if key.startswith(models) and key not in everyone)
        if extra:
            shown = ", ".join(key.split(".model.", 1)[1] for key in extra[:5])
            raise CheckpointError(f"{path}: it holds {len(extra)} weight(s) this model does not have ({shown}"
                                  f"{', ...' if len(extra) > 5 else ''}): it was saved from a larger or another "
                                  "model; build the same model as the run that saved it.")

    def verify(self, path: Path | str, metadata: dict[str, Any] | None = None) -> list[str]:
        """Every problem with the files of checkpoint ``path`` (none when intact); the same list on
        every rank, each rank having read its share of the files. ``metadata``: the folder's, when
        already read."""
        path = Path(path)
        try:
            metadata = metadata if metadata is not None else read_metadata(path)
            recorded = metadata.get("files") if self.checksums else None
            mine = verify(path, recorded, (self.rank, self.world_size))
        except CheckpointError as error:
            mine = [str(error)]
        found = self._gather({str(i): problem for i, problem in enumerate(mine)}, everyone=True)
        return sorted(set(found.values()))

    @property
    def pending(self) -> bool:
        """True while a background save is under way (or done, not yet waited for)."""
        return self._pending is not None

    def raise_if_failed(self) -> None:
        """Raise the error of a background save that has failed; return at once otherwise."""
        if self._pending is not None and self._pending.done():
            self.wait()

    def wait(self) -> None:
        """Wait for a background save to be written (and committed)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        self.wait()

    def _files_group(self) -> Any:
        """A Gloo group of the checkpointer's own: async saves and the checksum exchange run on it,
        from any thread, without mixing with the training loop's collectives."""
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _gather(self, mine: dict[str, Any], everyone: bool = False) -> dict[str, Any]:
        """Every rank's dict merged: on rank 0 (on all ranks with ``everyone``); ``mine`` elsewhere."""
        if not dist.is_initialized() or self.world_size == 1:
            return mine
        group = self._files_group()
        if everyone:
            every: list[Any] = [None] * self.world_size
            dist.all_gather_object(every, mine, group=group)
        else:
            every = [None] * self.world_size if self.rank == 0 else []
            dist.gather_object(mine, every if self.rank == 0 else None, dst=0, group=group)
        merged: dict[str, Any] = {}
        for rank, part in enumerate(every):
            merged.update({f"{rank}:{k}" if everyone else k: v for k, v in part.items()})
        return merged if every else mine



def _then(
    future: concurrent.futures.Future[Any], action: Callable[[], None], final: Path, partial: Path | None,
) -> concurrent.futures.Future[None]:
    """A future that completes once ``future`` has and ``action`` ran after it (not if it failed);
    a failure removes the ``partial`` folder and is told plainly."""
    done: concurrent.futures.Future[None] = concurrent.futures.Future()

    def follow(finished: concurrent.futures.Future[Any]) -> None:
        try:
            with _plainly(final, partial):
                finished.result()
            action()
        except BaseException as error:  # noqa: BLE001 - handed to whoever waits
            done.set_exception(error)
        else:
            done.set_result(None)

    future.add_done_callback(follow)
    return done


@contextlib.contextmanager
def _plainly(final: Path, partial: Path | None) -> Iterator[None]:
    """A failed save removes its ``partial`` folder (on rank 0, which made it) and says what went
    wrong in words: a full disk reads as one, not as torch's ``enforce fail at inline_container.cc``."""
    try:
        yield
    except BaseException as error:
        free = _free_bytes(final.parent)
        if partial is not None:
            shutil.rmtree(partial, ignore_errors=True)
        if _no_space(error, free):
            raise CheckpointError(
                f"{final}: not saved, the disk is full ({free:,} bytes free on the file system of "
                f"{final.parent}): free space there, or save elsewhere (checkpoint_dir)."
            ) from error
        raise


def _free_bytes(folder: Path) -> int:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return -1


_FULL_DISK_BELOW = 64 << 20  # torch.save reports a short write as "unexpected pos": with so little left, a full disk


def _causes(error: BaseException) -> Iterator[BaseException]:
    """``error``, its causes and contexts, and the per-rank failures DCP wraps (at most 32 in all)."""
    pending = [error]
    for _ in range(32):
        if not pending:
            return
        seen = pending.pop()
        yield seen
        pending += [e for e in (seen.__cause__, seen.__context__) if e is not None]
        for failure in getattr(seen, "failures", {}).values():  # DCP's: (exception, its stack summary)
            failure = failure[0] if isinstance(failure, tuple) and failure else failure
            if isinstance(failure, BaseException):
                pending.append(failure)


def _no_space(error: BaseException, free: int) -> bool:
    for seen in _causes(error):
        text = str(seen)
        if (isinstance(seen, OSError) and seen.errno == errno.ENOSPC) or "No space left on device" in text:
            return True
        if "unexpected pos" in text and 0 <= free < _FULL_DISK_BELOW:
            return True
    return False


def _refuse_unloadable(objects: dict[str, Any]) -> None:
    """Every rank, before anything is written: a value that the load (weights-only, which runs no code) cannot
    read back is refused now, by name, instead of a checkpoint that saves and never loads."""
    for name, value in objects.items():
        buffer = io.BytesIO()
        torch.save(value, buffer)
        buffer.seek(0)
        try:
            torch.load(buffer, weights_only=True)
        except pickle.UnpicklingError as error:
            found = re.search(r"Unsupported global: GLOBAL (\S+)", str(error))
            raise CheckpointError(
                f"state[{name!r}] holds {found.group(1) if found else 'a value'}, which a checkpoint cannot load "
                "back safely (loading runs no code): save plain data instead, numbers, strings, lists, dicts and "
                "tensors (float(x), x.tolist(), str(path), list(d), ...).") from None


# What reading damaged bytes raises: pickle's (DCP's .metadata, its shards' objects), a short read, a text
# decoded from garbage. A checkpoint of another model reads well and fails at matching names or shapes.
_UNREADABLE = (pickle.UnpicklingError, EOFError, UnicodeDecodeError, struct.error)


def _load_error(path: Path, error: BaseException) -> CheckpointError:
    """What a failed DCP load means: an unsafe file (refused), a damaged one, or another model's checkpoint."""
    for seen in _causes(error):
        if isinstance(seen, UnsafeCheckpointError) or "UnsafeCheckpointError" in str(seen):
            reason = str(seen).strip().splitlines()[-1][:300]
            return CheckpointError(f"{path}: refused ({reason}).")
    for seen in _causes(error):
        if isinstance(seen, _UNREADABLE) and "Weights only load failed" not in str(seen):  # the bytes, not a
            # model's mismatch (nor a value a weights-only load refuses: a tensor subclass, a newer torch's)
            reason = f"{type(seen).__name__}: {str(seen).strip()[:200]}".rstrip(": ")
            return CheckpointError(
                f"{path}: damaged, not loaded: a file of it cannot be read ({reason}), which a truncated or "
                "overwritten file gives. Its files were not checked before (a load with verify=False, or a folder "
                f"without lockstep's checksums); `lockstep checkpoint verify {path}` names the damaged file. Load "
                "an earlier checkpoint, or copy this one again from where it was saved.")
    first = str(error).strip().splitlines()[-1][:300] if str(error).strip() else type(error).__name__
    return CheckpointError(
        f"{path}: cannot load it into this model ({first}). It was saved from a different model or "
        "optimizer: build the same model, with the same optimizers, as the run that saved it."
    )


