"""``lockstep checkpoint inspect|verify|consolidate``: read a checkpoint folder without a training job.

Every command reads the files as a training job does: ``.metadata`` with only DCP's metadata
classes allowed, every entry weights-only, nothing that runs code; ``verify`` and ``consolidate``
check each file against the checksum written at commit.
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lockstep.runtime.checkpoint import CheckpointError, read_metadata
from lockstep.runtime.checkpoint_files import SafePlanner, SafeReader, read_dcp_metadata, verify


def add_parser(commands: Any) -> None:
    parser = commands.add_parser("checkpoint", help="inspect a checkpoint folder, or consolidate it into one file")
    actions = parser.add_subparsers(dest="action", required=True)
    inspect = actions.add_parser("inspect", help="print the metadata and every tensor's name, shape, dtype, bytes")
    inspect.add_argument("folder", type=Path)
    inspect.set_defaults(func=_inspect)
    check = actions.add_parser(
        "verify", help="check every file against the checksums written at commit, and that nothing in it runs code")
    check.add_argument("folder", type=Path)
    check.set_defaults(func=_verify)
    consolidate = actions.add_parser(
        "consolidate", help="write a model's whole weights to one .pt (torch.load(weights_only=True)) or .safetensors")
    consolidate.add_argument("folder", type=Path)
    consolidate.add_argument("out", type=Path)
    consolidate.add_argument("--part", default=None, help="which saved model, when the checkpoint holds several")
    consolidate.set_defaults(func=_consolidate)


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


def _verify(args: argparse.Namespace) -> int:
    problems = problems_of(args.folder)
    for problem in problems:
        print(f"lockstep: {problem}", file=sys.stderr)
    if problems:
        print(f"lockstep: {args.folder}: damaged or unsafe; do not load it.", file=sys.stderr)
        return 1
    files = read_metadata(args.folder).get("files")
    how = f"{len(files)} files match their checksums" if files else "written without checksums (older lockstep)"
    print(f"lockstep: {args.folder}: intact ({how}); nothing in it runs code when loaded.")
    return 0


def _inspect(args: argparse.Namespace) -> int:
    try:
        info = read_metadata(args.folder)
        tensors = tensors_of(args.folder)
    except CheckpointError as error:
        print(f"lockstep: {error}", file=sys.stderr)
        return 2
    print(json.dumps(info, indent=1, sort_keys=True))
    total = 0
    for name, item in sorted(tensors.items()):
        size = item.size.numel() * torch.empty((), dtype=item.properties.dtype).element_size()
        total += size
        print(f"{name}  {tuple(item.size)}  {str(item.properties.dtype).removeprefix('torch.')}  {size:,} B")
    print(f"{total:,} bytes of tensors")
    return 0


def model_weights(folder: Path, part: str | None = None) -> dict[str, torch.Tensor]:
    """One saved model's whole weights, keyed as its own ``state_dict`` (shards joined)."""
    import torch.distributed.checkpoint as dcp

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
    buffers = {name: torch.empty(tuple(metadata[full].size), dtype=metadata[full].properties.dtype)
               for name, full in wanted.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({part: {"model": buffers}}, checkpoint_id=str(folder), no_dist=True,
                 storage_reader=SafeReader(str(folder)), planner=SafePlanner())
    return buffers


def _consolidate(args: argparse.Namespace) -> int:
    try:
        weights = model_weights(args.folder, args.part)
    except CheckpointError as error:
        print(f"lockstep: {error}", file=sys.stderr)
        return 2
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.out.suffix == ".safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError:
            print("lockstep: writing .safetensors needs the safetensors package: pip install safetensors",
                  file=sys.stderr)
            return 2
        save_file({name: t.contiguous() for name, t in weights.items()}, str(args.out))
    else:
        torch.save(weights, args.out)
    print(f"lockstep: wrote {len(weights)} tensors to {args.out}")
    return 0
