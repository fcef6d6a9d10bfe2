"""Files written whole or not at all; names read from files checked before they name a file."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def own_name(name: object) -> bool:
    """Whether ``name``, read from a file, is a file's or folder's own name in its folder: no separator, not
    "." or ".." (a path there would reach outside the folder)."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and "\\" not in name \
        and "\0" not in name


def write_atomic(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Call ``write`` on a temporary file beside ``path``, flush it to disk, then rename it over ``path``.

    A crash at any point leaves either the previous file at ``path`` or the new one, never a part.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        with open(partial, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink()
        raise
    folder = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(folder)
    finally:
        os.close(folder)
