"""A checkpoint folder's files, trusted only once checked: checksums written at commit and verified
before use, and readers that never run code from a file.

- **Integrity.** Each rank checksums the shards it writes as it writes them (XXH3-64, about 20
  GB/s, in the writing thread: nothing is read back), and the few small files by reading them;
  rank 0 records every file's size and checksum in ``lockstep.json`` at commit. ``verify``
  compares them, each rank reading its share of the files. A checksum finds damage (a flipped
  bit, a truncated or missing shard), not tampering: whoever can write the folder can rewrite
  the checksums too.
- **No code from a file.** DCP reads ``.metadata`` with ``pickle.load`` and non-tensor entries
  (optimizer hyper-parameters, ...) with ``torch.load(weights_only=False)``: either runs whatever
  code a crafted file names. ``SafeReader`` unpickles ``.metadata`` allowing only DCP's own
  metadata classes, and ``SafePlanner`` reads every entry weights-only; anything else is refused.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import pathlib
import pickle
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import ReadItem

from lockstep.errors import CheckpointError, UnsafeCheckpointError
from lockstep.runtime._torch_compat import (
    DCP_METADATA_PRIVATE_NAMES,
    dcp_metadata_name,
    dcp_shard_pattern,
    stamp_load_id,
    use_file_system,
)
from lockstep.runtime.files import own_name

DCP_METADATA = dcp_metadata_name(None)
_CHUNK = 8 << 20




def checksum_of(path: Path) -> tuple[int, str]:
    """A file's size and XXH3-64 checksum (16 hex digits)."""
    digest, size = xxhash.xxh3_64(), 0
    with open(path, "rb", buffering=0) as handle:
        buffer = bytearray(_CHUNK)
        view = memoryview(buffer)
        while read := handle.readinto(buffer):
            digest.update(view[:read])
            size += read
    return size, digest.hexdigest()


class _HashingStream:
    """A file being written, checksummed on the way. A seek (out of order writes) makes the sum
    unusable; the file is then read back instead."""

    def __init__(self, stream: Any) -> None:
        self._stream, self._digest, self.size, self.in_order = stream, xxhash.xxh3_64(), 0, True

    def write(self, data: Any) -> int:
        written = self._stream.write(data)
        view = memoryview(data).cast("B")
        self._digest.update(view if written is None or written == len(view) else view[:written])
        self.size += len(view) if written is None else written
        return int(len(view) if written is None else written)

    def seek(self, *args: Any) -> int:
        self.in_order = False
        return int(self._stream.seek(*args))

    def truncate(self, *args: Any) -> int:
        self.in_order = False
        return int(self._stream.truncate(*args))

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)

    def entry(self) -> dict[str, Any]:
        return {"size": self.size, "xxh3": self._digest.hexdigest()}


class ChecksummingFileSystem(FileSystem):
    """DCP's local file system, checksumming every file it writes (``sums``: name -> entry)."""

    def __init__(self) -> None:
        super().__init__()
        self.sums: dict[str, dict[str, Any]] = {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as stream:
            if "w" not in mode:
                yield stream
                return
            hashing = _HashingStream(stream)
            yield hashing
        if hashing.in_order:
            self.sums[Path(path).name] = hashing.entry()


def checksummed_writer(folder: Path) -> tuple[FileSystemWriter, ChecksummingFileSystem]:
    """A DCP writer into ``folder`` that checksums the shards as it writes them."""
    writer, files = FileSystemWriter(str(folder)), ChecksummingFileSystem()
    use_file_system(writer, files)
    return writer, files


def files_written_by(
    folder: Path, rank: int, extra: Iterable[str] = (), known: dict[str, dict[str, Any]] | None = None,
) -> dict[str, dict[str, Any]]:
    """Size and checksum of the DCP shards rank ``rank`` wrote into ``folder`` (``__RANK_*``), and of
    ``extra`` names (rank 0: DCP's ``.metadata``, lockstep's objects): taken from ``known`` (summed
    while written) where it has them, else read back."""
    names = sorted(p.name for p in folder.glob(dcp_shard_pattern(rank)) if p.is_file())
    names += [name for name in extra if (folder / name).is_file()]
    found = {}
    for name in names:
        if known and name in known and known[name]["size"] == (folder / name).stat().st_size:
            found[name] = known[name]
            continue
        size, digest = checksum_of(folder / name)
        found[name] = {"size": size, "xxh3": digest}
    return found


def verify(folder: Path, recorded: dict[str, Any] | None, share: tuple[int, int] = (0, 1)) -> list[str]:
    """What is wrong with the files of the checkpoint ``folder`` against the checksums ``recorded``
    at commit: one line per damaged file, none when intact. ``share=(i, n)`` checks every n-th
    file from the i-th, so that n ranks check a folder together. A checkpoint written before
    checksums were recorded (``recorded`` None) has nothing to check against."""
    if recorded is None:
        return []
    if not isinstance(recorded, dict):
        return [f"{folder / 'lockstep.json'}: its list of files is damaged"]
    problems = []
    index, count = share
    if index == 0 and (folder / DCP_METADATA).is_file():  # what DCP reads must be what the commit listed
        if DCP_METADATA not in recorded:
            problems.append(f"{folder / DCP_METADATA}: not among the files its commit listed")
        try:
            problems += [f"{folder / DCP_METADATA}: {problem}"
                         for problem in layout_problems(read_dcp_metadata(folder), recorded)]
        except UnsafeCheckpointError as error:  # it names code: said as such
            problems.append(f"{folder / DCP_METADATA}: {error}")
        except (OSError, pickle.UnpicklingError, EOFError, ValueError, AttributeError, TypeError) as error:
            problems.append(f"{folder / DCP_METADATA}: unreadable ({type(error).__name__})")
    for name in sorted(recorded)[index::count]:
        entry = recorded[name]
        path = folder / name
        if not own_name(name) or not isinstance(entry, dict):
            problems.append(f"{folder / 'lockstep.json'}: a damaged entry for {name!r}")
        elif not path.is_file() or path.is_symlink():
            problems.append(f"{path}: missing")
        else:
            size, digest = checksum_of(path)
            if size != entry.get("size"):
                problems.append(f"{path}: {size:,} bytes where {entry.get('size')} were written (truncated or damaged)")
            elif digest != entry.get("xxh3"):
                problems.append(f"{path}: its checksum differs from the one written at commit (the file is damaged)")
    return problems


# -- reading without running code -------------------------------------------------------------

_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
_ALLOWED = DCP_METADATA_PRIVATE_NAMES | {
    ("torch", "Size"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata``: DCP's metadata classes, torch sizes, dtypes and layouts, paths."""

    def find_class(self, module: str, name: str) -> Any:
        if module == _METADATA_MODULE and not name.startswith("__"):
            import torch.distributed.checkpoint.metadata as metadata

            found = getattr(metadata, name, None)
            if isinstance(found, type) and found.__module__ == _METADATA_MODULE:
                return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED:
            if module == "pathlib":
                return getattr(pathlib, name)
            return super().find_class(module, name)
        raise UnsafeCheckpointError(
            f"it names {module}.{name}, which is not part of a checkpoint's metadata: the file may run code "
            "when loaded, so lockstep does not load it"
        )


def read_dcp_metadata(folder: Path, name: str = DCP_METADATA) -> Any:
    """DCP's ``Metadata`` of ``folder``, unpickled with only DCP's metadata classes allowed."""
    if not (folder / name).is_file():  # a pipe or a device there would be read without end
        raise CheckpointError(f"{folder / name}: not a regular file")
    with open(folder / name, "rb") as handle:
        return _MetadataUnpickler(io.BytesIO(handle.read())).load()


def layout_problems(metadata: Any, listed: dict[str, Any] | None = None) -> list[str]:
    """What DCP's ``metadata`` says that no checkpoint says: a shard that is a path rather than a file of the
    folder, one its commit did not list (``listed``: lockstep.json's files), a tensor whose chunks do not
    cover it exactly (a load would keep the model's own values there). Read as untrusted."""
    problems: dict[str, None] = {}
    for info in dict(getattr(metadata, "storage_data", None) or {}).values():
        name = getattr(info, "relative_path", None)
        if not own_name(name):
            problems[f"it names the shard file {str(name)[:200]!r}, not a file of its folder"] = None
        elif listed is not None and name not in listed:
            problems[f"it reads {name!r}, a file its commit did not list"] = None
    for fqn, entry in dict(getattr(metadata, "state_dict_metadata", None) or {}).items():
        chunks = getattr(entry, "chunks", None)
        problem = _coverage(tuple(getattr(entry, "size", ())), chunks) if chunks is not None else ""
        if problem:
            problems[f"the tensor {str(fqn)[:200]!r}: {problem}"] = None
    return list(problems)[:20]


def _coverage(size: tuple[int, ...], chunks: Any) -> str:
    """'' when the ``chunks`` (DCP's offsets and sizes) cover a tensor of ``size`` exactly once, else why not."""
    boxes, volume = [], 0
    for chunk in chunks:
        offsets, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
        if len(offsets) != len(size) or len(sizes) != len(size) or any(
                not 0 <= o <= o + n <= whole for o, n, whole in zip(offsets, sizes, size, strict=True)):
            return "a chunk lies outside it"
        volume += math.prod(sizes)
        boxes.append((offsets, sizes))
    if volume != math.prod(size):
        return f"its chunks hold {volume:,} of its {math.prod(size):,} elements"
    if len(boxes) <= 64 and any(
            all(oa < ob + nb and ob < oa + na for oa, na, ob, nb in zip(a[0], a[1], b[0], b[1], strict=True))
            and math.prod(a[1]) and math.prod(b[1]) for i, a in enumerate(boxes) for b in boxes[i + 1:]):
        return "two of its chunks overlap"
    return ""


class SafeReader(FileSystemReader):
    """DCP's file reader, with ``.metadata`` read by the restricted unpickler (tensors are already
    read weights-only by DCP), once: a load asks for it before DCP's own load does."""

    _read: tuple[Path, Any] | None = None  # the metadata file read last, and what it held: read once per load

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        file = Path(os.fspath(self.path)) / dcp_metadata_name(kwargs.get("rank"))
        if self._read is None or self._read[0] != file:
            metadata = read_dcp_metadata(file.parent, file.name)
            problems = layout_problems(metadata)
            if problems:
                raise CheckpointError(f"{file}: damaged or crafted, not loaded: " + "; ".join(problems))
            self._read = (file, metadata)
        return stamp_load_id(self._read[1], self.load_id)


class SafePlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor entries weights-only (DCP's own reads them with
    ``torch.load(weights_only=False)``)."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as error:
            raise UnsafeCheckpointError(
                f"the entry {read_item.dest_index.fqn!r} is not plain data ({str(error).splitlines()[0][:200]}): "
                "it may run code when loaded, so lockstep does not load it"
            ) from None
        # Handed on re-serialised: DCP's own load_bytes then unpickles only what this just wrote.
        plain = io.BytesIO()
        torch.save(loaded, plain)
        plain.seek(0)
        super().load_bytes(read_item, plain)
