"""Checkpoint files: atomic writes, weights-only reads, and finding the newest valid one."""

from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Any

import torch

FORMAT = 1  # bump when the layout changes; older lockstep refuses newer files with a clear message


class CheckpointError(ValueError):
    """A checkpoint cannot be used; the message says why and what to do."""


def save_atomic(state: dict[str, Any], path: Path) -> None:
    """Write to a temporary file in the same folder, flush it to disk, then rename over ``path``.

    A crash mid-write leaves the previous file at ``path`` intact.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    with open(partial, "wb") as handle:
        torch.save({**state, "format": FORMAT}, handle)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def load(path: Path | str) -> dict[str, Any]:
    """Read a checkpoint with weights-only unpickling (a checkpoint cannot run code)."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file.")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - torch raises many kinds for a damaged file
        raise CheckpointError(
            f"{path}: cannot read it ({type(error).__name__}: {str(error).splitlines()[0][:200]}). It is "
            "truncated, damaged or not a lockstep checkpoint: delete it, or resume from another one."
        ) from None
    if not isinstance(state, dict) or "format" not in state:
        raise CheckpointError(f"{path}: not a lockstep checkpoint (no format field).")
    if state["format"] > FORMAT:
        raise CheckpointError(
            f"{path}: written by a newer lockstep (checkpoint format {state['format']}); this one reads "
            f"format {FORMAT}: upgrade lockstep to resume from it."
        )
    return dict(state)


def _step_of(path: Path) -> int:
    match = re.search(r"step=(\d+)", path.name)
    return int(match.group(1)) if match else -1


def newest_valid(folder: Path) -> tuple[Path, dict[str, Any]] | None:
    """The loadable checkpoint in ``folder`` with the most training steps (ties: the newest file)."""
    if not folder.is_dir():
        return None
    best: tuple[int, Path, dict[str, Any]] | None = None
    for path in sorted(folder.glob("*.ckpt"), key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            state = load(path)
        except CheckpointError:
            continue  # e.g. truncated by a crash: fall back to an older one
        step = int(state.get("loop", {}).get("global_step", _step_of(path)))
        if best is None or step > best[0]:
            best = (step, path, state)
    return None if best is None else (best[1], best[2])


def capture_rng() -> dict[str, Any]:
    """This process's random states (python, numpy, torch CPU and CUDA), in weights-only types."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [kind, torch.from_numpy(np.asarray(keys).astype(np.int64)), pos, has_gauss, cached]
    except ImportError:
        pass
    return state


def restore_rng(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))


def load_module_state(module: torch.nn.Module, state: dict[str, Any], path: Path | str) -> None:
    """``load_state_dict`` with an error that names the mismatch instead of torch's wall of keys."""
    own = module.state_dict()
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [k for k in state if k in own and tuple(own[k].shape) != tuple(state[k].shape)]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} key(s), e.g. {missing[:3]}")
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected key(s), e.g. {unexpected[:3]}")
        if shapes:
            parts.append(f"different shapes for {shapes[:3]}")
        raise CheckpointError(f"{path}: was saved from a different model ({'; '.join(parts)}).")
    module.load_state_dict(state)
