"""A checkpoint folder read without a training job: its tensors' metadata, its problems, and one
model's whole weights with the shards joined (``lockstep checkpoint``, ``rt.full_state_dict``'s
offline counterpart). Every read is the safe one: ``.metadata`` with only DCP's metadata classes
allowed, every entry weights-only, each file checked against its checksum first."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lockstep.errors import CheckpointError
from lockstep.runtime.checkpoint.format import read_metadata
from lockstep.runtime.checkpoint.integrity import SafePlanner, SafeReader, read_dcp_metadata, verify


def tensors_of(folder: Path) -> dict[str, TensorStorageMetadata]:
    """Every saved tensor's metadata (global shape, dtype), by its full name; nothing is loaded."""
    try:
        metadata = read_dcp_metadata(folder)
    except Exception as error:  # noqa: BLE001 - a damaged or crafted file: many kinds
        raise CheckpointError(f"{folder / '.metadata'}: cannot read it safely ({str(error)[:300]}).") from None
    return {name: item for name, item in metadata.state_dict_metadata.items()
            if isinstance(item, TensorStorageMetadata)}


def problems_of(folder: Path) -> list[str]:
    """What is wrong with the checkpoint ``folder``: damaged files, or a ``.metadata`` that names
    anything but DCP's metadata classes. Empty when it is intact and safe to read."""
    try:
        problems = verify(folder, read_metadata(folder).get("files"))
        tensors_of(folder)
    except CheckpointError as error:
        return [str(error)]
    return problems


def model_weights(folder: Path, part: str | None = None) -> dict[str, torch.Tensor]:
    """One saved model's whole weights, keyed as its own ``state_dict`` (shards joined)."""
    problems = problems_of(folder)
    if problems:
        raise CheckpointError(f"{folder}: damaged or unsafe, not read:\n  " + "\n  ".join(problems))
    names = sorted(tensors_of(folder))
    parts = sorted({name.split(".", 1)[0] for name in names if name.split(".")[1:2] == ["model"]})
    if part is None:
        if len(parts) != 1:
            raise CheckpointError(f"{folder}: holds the models {parts}: choose one with --part.")
        part = parts[0]
    prefix = f"{part}.model."
    wanted = {name[len(prefix):]: name for name in names if name.startswith(prefix)}
    if not wanted:
        raise CheckpointError(f"{folder}: holds no model {part!r}; it holds {parts}.")
    metadata = tensors_of(folder)
    buffers = {name: torch.zeros(tuple(metadata[full].size), dtype=metadata[full].properties.dtype)
               for name, full in wanted.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({part: {"model": buffers}}, checkpoint_id=str(folder), no_dist=True,
                 storage_reader=SafeReader(str(folder)), planner=SafePlanner())
    return buffers
