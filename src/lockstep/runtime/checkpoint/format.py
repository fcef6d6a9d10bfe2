"""The on-disk format of a checkpoint folder: its metadata, its commit, and reading it back.

A checkpoint folder holds the DCP shards of models and optimizers, ``state.pt`` (rank 0's small
state, read weights-only) and ``lockstep.json`` (format, step, world size, strategy, and every
other file's size and checksum). ``lockstep.json`` is written last and the folder is renamed into
place after it: a folder without it is not a checkpoint. Reading the metadata loads no tensor and
imports no DCP.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import uuid
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import torch

from lockstep.errors import CheckpointError
from lockstep.runtime.files import write_atomic

FORMAT = 2
METADATA = "lockstep.json"
OBJECTS = "state.pt"


def lockstep_version() -> str:
    try:
        return version("lockstep")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "unknown"


#: The most a checkpoint's metadata may weigh (its list of files and their checksums): a larger one is damaged.
METADATA_LIMIT = 256 * 2**20


def read_metadata(path: Path | str) -> dict[str, Any]:
    """The metadata of the complete checkpoint folder ``path``, without loading a tensor."""
    path = Path(path)
    if not path.is_dir():
        what = "no such file or folder" if not path.exists() else "a file, not a checkpoint folder"
        raise CheckpointError(f"{path}: {what}. A lockstep checkpoint is a folder holding {METADATA}.")
    if not (path / METADATA).exists() and not path.name.startswith("."):
        raise CheckpointError(f"{path}: not a lockstep checkpoint (it holds no {METADATA}). Give a checkpoint "
                              "folder such as runs/exp/last.ckpt, or resume='auto' to take the newest.")
    if not (path / METADATA).is_file() or (path / METADATA).stat().st_size > METADATA_LIMIT:  # a pipe there would
        raise CheckpointError(f"{path}: {METADATA} is damaged (not a regular file, or over "  # be read without end
                              f"{METADATA_LIMIT // 2**20} MiB): resume from another checkpoint.")
    try:
        metadata = json.loads((path / METADATA).read_text())
    except (OSError, ValueError, RecursionError) as error:  # RecursionError: JSON nested beyond Python's stack
        raise CheckpointError(
            f"{path}: not a complete lockstep checkpoint ({type(error).__name__}: {error}). A save that "
            "was interrupted leaves no metadata: resume from another checkpoint."
        ) from None
    version = metadata.get("format", 0) if isinstance(metadata, dict) else None
    if type(version) is not int:  # valid JSON of another shape (null, a list, a format that is no number)
        raise CheckpointError(f"{path}: {METADATA} is damaged (it holds {str(metadata)[:80]!r}, not lockstep's "
                              "metadata): resume from another checkpoint.")
    if version > FORMAT:
        raise CheckpointError(
            f"{path}: written by a newer lockstep (checkpoint format {metadata['format']}); this one reads "
            f"format {FORMAT}: upgrade lockstep to resume from it."
        )
    return dict(metadata)


def is_checkpoint_folder(path: Path) -> bool:
    """A complete checkpoint: a folder (or a link to one) with metadata, not a partial save."""
    return path.is_dir() and not path.name.startswith(".") and (path / METADATA).is_file()


def read_objects(path: Path) -> dict[str, Any]:
    try:
        with open(path / OBJECTS, "rb") as handle:
            data = io.BytesIO(handle.read())
        return dict(torch.load(data, map_location="cpu", weights_only=True))
    except Exception as error:  # noqa: BLE001 - torch raises many kinds for a damaged file
        raise CheckpointError(f"{path / OBJECTS}: cannot read it ({type(error).__name__}: {error}).") from None




def publish(partial: Path, final: Path, metadata: dict[str, Any]) -> None:
    """Rank 0, once every rank has written: the metadata, then the rename that publishes the folder.

    A checkpoint already at ``final`` (e.g. ``last.ckpt``) is moved aside first and deleted last, so
    at every moment one complete checkpoint exists.
    """
    write_atomic(partial / METADATA, lambda handle: handle.write(json.dumps(metadata, indent=1).encode()))
    old = None
    if final.is_symlink() or final.exists():
        old = final.with_name(f"{final.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(final, old)
    os.rename(partial, final)
    if old is not None:
        if old.is_symlink() or old.is_file():
            old.unlink()
        else:
            shutil.rmtree(old, ignore_errors=True)
