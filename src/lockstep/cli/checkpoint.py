"""``lockstep checkpoint inspect|verify|consolidate``: read a checkpoint folder without a training job.

Every command reads the files as a training job does: ``.metadata`` with only DCP's metadata
classes allowed, every entry weights-only, nothing that runs code; ``verify`` and ``consolidate``
check each file against the checksum written at commit.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from lockstep.errors import CheckpointError

# torch and the checkpoint readers load in each command, not here: `lockstep --help` imports no torch.


def add_parser(commands: Any) -> None:
    parser = commands.add_parser("checkpoint", help="inspect a checkpoint folder, or consolidate it into one file")
    actions = parser.add_subparsers(dest="action", required=True)
    inspect = actions.add_parser("inspect", help="print the metadata and every tensor's name, shape, dtype, bytes")
    inspect.add_argument("folder", type=Path)
    inspect.set_defaults(func=_inspect)
    check = actions.add_parser(
        "verify", help="check every file against the checksums written at commit, and that nothing in it runs code "
        "(a run folder: each checkpoint in it)")
    check.add_argument("folder", type=Path)
    check.set_defaults(func=_verify)
    consolidate = actions.add_parser(
        "consolidate", help="write a model's whole weights to one .pt (torch.load(weights_only=True)) or .safetensors")
    consolidate.add_argument("folder", type=Path)
    consolidate.add_argument("out", type=Path)
    consolidate.add_argument("--part", default=None, help="which saved model, when the checkpoint holds several")
    consolidate.set_defaults(func=_consolidate)
    export = actions.add_parser(
        "export", help="write a Hugging Face model folder (config.json, safetensors) from a checkpoint")
    export.add_argument("folder", type=Path)
    export.add_argument("out", type=Path)
    export.add_argument("--hf", action="store_true", required=True,
                        help="as a transformers model folder that from_pretrained(OUT) loads")
    export.add_argument("--part", default=None, help="which saved model, when the checkpoint holds several")
    export.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    export.set_defaults(func=_export)


def _verify(args: argparse.Namespace) -> int:
    """One checkpoint folder; or a run folder, each checkpoint in it, as ``resume="auto"`` scans it."""
    from lockstep.runtime.checkpoint.format import METADATA, is_checkpoint_folder
    from lockstep.runtime.checkpoint.life import complete_checkpoints

    folder = Path(args.folder)
    if is_checkpoint_folder(folder) or not folder.is_dir() or os.path.lexists(folder / METADATA):  # (a damaged one)
        return 0 if _verify_one(folder) else 1
    found = complete_checkpoints(folder)  # those whose metadata reads, the newest first
    readable = {checkpoint.path for checkpoint in found}
    unreadable = sorted(path for path in folder.iterdir()  # resume="auto" passes them over: said here
                        if not path.is_symlink() and is_checkpoint_folder(path) and path not in readable)
    if not found and not unreadable:
        print(f"lockstep: {folder}: holds no checkpoint folder (none with a lockstep.json).", file=sys.stderr)
        return 1
    intact = [checkpoint for checkpoint in found if _verify_one(checkpoint.path)]
    for path in unreadable:
        _verify_one(path)
    total = len(found) + len(unreadable)
    newest = f"; resume='auto' loads {intact[0].path.name}" if intact else "; resume='auto' finds none to load"
    print(f"lockstep: {folder}: a run folder, {len(intact)} of {total} checkpoint(s) intact{newest}.")
    return 0 if len(intact) == total else 1


def _verify_one(folder: Path) -> bool:
    from lockstep.runtime.checkpoint.consolidate import problems_of
    from lockstep.runtime.checkpoint.format import read_metadata

    problems = problems_of(folder)
    for problem in problems:
        print(f"lockstep: {problem}", file=sys.stderr)
    if problems:
        print(f"lockstep: {folder}: damaged or unsafe; do not load it.", file=sys.stderr)
        return False
    files = read_metadata(folder).get("files")
    how = f"{len(files)} files match their checksums" if files else "written without checksums (older lockstep)"
    print(f"lockstep: {folder}: intact ({how}); nothing in it runs code when loaded.")
    return True


def _inspect(args: argparse.Namespace) -> int:
    import torch

    from lockstep.runtime.checkpoint.consolidate import tensors_of
    from lockstep.runtime.checkpoint.format import read_metadata

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


def _consolidate(args: argparse.Namespace) -> int:
    from lockstep.runtime.checkpoint.consolidate import model_weights
    from lockstep.runtime.checkpoint.format import is_checkpoint_folder

    if args.out.is_dir():
        print(f"lockstep: {args.out} is a folder; consolidate writes one file: name it, e.g. {args.out / 'model.pt'} "
              "(or .safetensors).", file=sys.stderr)
        return 2
    source = Path(args.folder).resolve()
    inside = next((folder for folder in args.out.resolve().parents if is_checkpoint_folder(folder) or folder == source),
                  None)
    if inside is not None:  # it would replace a file of a checkpoint (its shards, its lockstep.json)
        print(f"lockstep: {args.out} is inside the checkpoint {inside}: write the weights outside any checkpoint "
              "folder.", file=sys.stderr)
        return 2
    try:
        weights = model_weights(args.folder, args.part)
    except CheckpointError as error:
        print(f"lockstep: {error}", file=sys.stderr)
        return 2
    partial = args.out.with_name(f".{args.out.name}.partial")
    try:  # a whole file or none: written beside it, then put in its place
        args.out.parent.mkdir(parents=True, exist_ok=True)
        _write_weights(weights, partial, safetensors=args.out.suffix == ".safetensors")
        os.replace(partial, args.out)
    except ImportError:
        print("lockstep: writing .safetensors needs the safetensors package: pip install safetensors", file=sys.stderr)
        return 2
    except (OSError, RuntimeError) as error:
        print(f"lockstep: cannot write {args.out} ({str(error).splitlines()[0] if str(error) else error!r}).",
              file=sys.stderr)
        return 2
    finally:
        if partial.is_file():
            partial.unlink()
    print(f"lockstep: wrote {len(weights)} tensors to {args.out}")
    return 0


def _write_weights(weights: dict[str, Any], path: Path, safetensors: bool) -> None:
    import torch

    if safetensors:
        from safetensors.torch import save_file

        save_file({name: t.contiguous() for name, t in weights.items()}, str(path))
    else:
        torch.save(weights, path)


def _export(args: argparse.Namespace) -> int:
    from lockstep.runtime.checkpoint.hf_export import export_hf

    try:
        name = export_hf(args.folder, args.out, args.part, args.max_shard_size)
    except CheckpointError as error:
        print(f"lockstep: {error}", file=sys.stderr)
        return 2
    print(f"lockstep: wrote {name} to {args.out} (from_pretrained({str(args.out)!r}) loads it)")
    return 0
