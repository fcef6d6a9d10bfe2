"""Checkpoint files: atomic writes, weights-only reads, and finding the newest valid one."""

from __future__ import annotations

import random
import re
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lockstep.runtime import Runtime, write_atomic

if TYPE_CHECKING:
    from lockstep.train.trainer import Trainer

FORMAT = 1  # bump when the layout changes; older lockstep refuses newer files with a clear message


class CheckpointError(ValueError):
    """A checkpoint cannot be used; the message says why and what to do."""


def save_atomic(state: dict[str, Any], path: Path) -> None:
    """Write ``state`` to ``path`` whole or not at all: a crash mid-write leaves the previous file."""
    write_atomic(path, lambda handle: torch.save({**state, "format": FORMAT}, handle))


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


def restore_rank_rng(rt: Runtime, states: list[dict[str, Any]]) -> None:
    """This rank's random states from a checkpoint of every rank's (not across world sizes)."""
    if len(states) == rt.world_size:
        restore_rng(states[rt.rank])
    else:
        rt.print(f"lockstep: the checkpoint comes from {len(states)} processes, this run has "
                 f"{rt.world_size}: random states are not restored (the sample order still is).")


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


def agreed_checkpoint(
    rt: Runtime, resume: str | Path, checkpoint_dir: Path | None,
) -> tuple[Path, dict[str, Any]] | None:
    """The checkpoint to resume from (``"auto"``: the newest valid one in ``checkpoint_dir``),
    the same on every rank, or an error that says why not. Every rank must call it.

    Each rank reads it from its own file system: one that the nodes do not share would otherwise
    resume rank 0 alone and train the others from scratch.
    """
    found, problem = None, ""
    try:
        if str(resume) == "auto":
            assert checkpoint_dir is not None, "TrainerConfig checks that resume='auto' has a folder"
            found = newest_valid(checkpoint_dir)
        else:
            found = Path(resume), load(resume)
    except CheckpointError as error:
        problem = str(error)
    mine = problem or (f"{found[0].name} (step {found[1]['loop']['global_step']})" if found else "none")
    seen = rt.all_gather((socket.gethostname(), mine))
    if len({what for _, what in seen}) > 1 or problem:
        lines = [f"  rank {r} on {host}: {what}" for r, (host, what) in enumerate(seen)]
        raise CheckpointError(
            "the ranks cannot resume from the same checkpoint:\n" + "\n".join(lines) + "\n"
            "Rank 0 writes the checkpoints: put checkpoint_dir (or the resume path) on a file system "
            "that every node shares, or copy the file to every node."
        )
    return found


def capture_state(trainer: Trainer) -> dict[str, Any]:
    """Everything resuming needs, each part from its own ``state_dict``. Every rank must call it."""
    rt = trainer.runtime
    loader = trainer.train_loader
    return {
        "module": trainer.module.state_dict(),
        "optimizers": [o.state_dict() for o in trainer.optimizers],
        "schedulers": [s.state_dict() for s, _ in trainer.lr_schedulers],
        "precision": rt.precision.state_dict(),
        "loop": {"epoch": trainer.current_epoch, "global_step": trainer.global_step,
                 "batches_done_in_epoch": trainer.batches_done_in_epoch, "samples_seen": trainer.samples_seen},
        "loader": loader.state_dict() if loader is not None else {},
        "rng": rt.all_gather(capture_rng()),
        **trainer.metrics.state_dict(rt),
        "world_size": rt.world_size,
        "config": {k: str(v) for k, v in trainer.config.hparams().items()},
        "callbacks": {f"{type(c).__name__}-{i}": c.state_dict() for i, c in enumerate(trainer.callbacks)},
    }


def load_state(trainer: Trainer, path: Path, state: dict[str, Any]) -> int:
    """Load ``state`` into the Trainer's parts (random states apart); returns the batches done in the
    epoch it resumes, where the loop continues."""
    rt = trainer.runtime
    load_module_state(trainer.module, state["module"], path)
    for optimizer, saved in zip(trainer.optimizers, state["optimizers"], strict=True):
        optimizer.load_state_dict(saved)
    for (scheduler, _), saved in zip(trainer.lr_schedulers, state["schedulers"], strict=True):
        scheduler.load_state_dict(saved)
    rt.precision.load_state_dict(state["precision"])
    loop = state["loop"]
    trainer.current_epoch, trainer.global_step = int(loop["epoch"]), int(loop["global_step"])
    trainer.samples_seen, batches_done = int(loop["samples_seen"]), int(loop["batches_done_in_epoch"])
    if batches_done >= trainer.steps_per_epoch:
        trainer.current_epoch, batches_done = trainer.current_epoch + 1, 0
    trainer.metrics.load_state_dict(rt, state, mid_epoch=batches_done > 0)
    for i, callback in enumerate(trainer.callbacks):
        callback.load_state_dict(state["callbacks"].get(f"{type(callback).__name__}-{i}", {}))
    return batches_done
