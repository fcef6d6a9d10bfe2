"""The Trainer's checkpoints: its stateful parts, finding the newest intact one, and resuming.

A checkpoint is a folder (``lockstep.runtime.checkpoint.checkpointer``): the module and optimizers as shards,
the other parts' states from rank 0.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lockstep.errors import CheckpointError
from lockstep.runtime import Runtime, is_checkpoint_folder, read_metadata

if TYPE_CHECKING:
    from lockstep.train.trainer import Trainer

def _step_of(path: Path) -> int:
    match = re.search(r"step=(\d+)", path.name)
    return int(match.group(1)) if match else -1


def complete_checkpoints(folder: Path) -> list[tuple[Path, int]]:
    """The complete checkpoint folders in ``folder`` and their steps, the most training steps first
    (ties: the newest first). Judged by their metadata alone; links (``last.ckpt``) are skipped,
    the folder they point to is listed itself."""
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        if path.is_symlink() or not is_checkpoint_folder(path):
            continue
        try:
            step = int(read_metadata(path).get("step", _step_of(path)))
        except (CheckpointError, TypeError, ValueError):
            continue  # e.g. damaged metadata: fall back to an older one
        found.append((step, path.stat().st_mtime, path))
    return [(path, step) for step, _, path in sorted(found, key=lambda c: c[:2], reverse=True)]


def prepare_folder(rt: Runtime, folder: Path) -> None:
    """Before training: remove what interrupted saves left (``.NAME.partial`` folders, on rank 0),
    and check that every rank can write into ``folder``, so that a read-only or missing folder
    fails now, naming itself, instead of at the first save. Every rank must call it."""
    if rt.is_global_zero and folder.is_dir():
        for leftover in folder.glob(".*.partial"):
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)
    problem = ""
    probe = folder / f".lockstep-write-check-{rt.rank}-{os.getpid()}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as error:
        problem = f"rank {rt.rank} on {socket.gethostname()}: {error.strerror or error}"
    problems = [p for p in rt.all_gather(problem) if p]
    if problems:
        raise CheckpointError(f"cannot write checkpoints into {folder}: " + "; ".join(problems)
                              + ". Choose a checkpoint_dir every rank can write to.")


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


def agreed_checkpoint(rt: Runtime, resume: str | Path, checkpoint_dir: Path | None) -> tuple[Path, int] | None:
    """The checkpoint to resume from and its step, the same on every rank, or an error that says why
    not. Every rank must call it.

    ``"auto"``: the newest complete checkpoint in ``checkpoint_dir`` whose files match their
    checksums; a damaged one is skipped, in one line saying which file and why. A path: that
    checkpoint, refused if damaged. Each rank looks on its own file system: one that the nodes do
    not share would otherwise resume some ranks and train the others from scratch.
    """
    found, problem = [], ""
    try:
        if str(resume) == "auto":
            assert checkpoint_dir is not None, "TrainerConfig checks that resume='auto' has a folder"
            found = complete_checkpoints(checkpoint_dir)
        else:
            path = Path(resume)
            if not path.exists():
                raise CheckpointError(f"resume={str(resume)!r}: no such checkpoint.")
            found = [(path, int(read_metadata(path).get("step", -1)))]
    except CheckpointError as error:
        problem = str(error)
    mine = problem or ", ".join(f"{p.name} (step {step})" for p, step in found) or "none"
    seen = rt.all_gather((socket.gethostname(), mine))
    if len({what for _, what in seen}) > 1:
        lines = [f"  rank {r} on {host}: {what}" for r, (host, what) in enumerate(seen)]
        raise CheckpointError(
            "the ranks cannot resume from the same checkpoint:\n" + "\n".join(lines) + "\n"
            "Every rank writes its shards into the checkpoint folder: put checkpoint_dir (or the resume path) "
            "on a file system that every node shares."
        )
    if problem:
        raise CheckpointError(problem)
    for path, step in found:
        damage = rt.verify_checkpoint(path)
        if not damage:
            return path, step
        if str(resume) != "auto":
            raise CheckpointError(f"{path}: damaged, not resumed from:\n  " + "\n  ".join(damage))
        more = f" (and {len(damage) - 1} more)" if len(damage) > 1 else ""
        rt.print(f"lockstep: skipping the damaged checkpoint {path.name}: {damage[0]}{more}")
    return None


class _Loop:
    """The loop counters; loading them also says where the resumed epoch continues."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        return {"epoch": t.current_epoch, "global_step": t.global_step, "epoch_ended": t.epoch_ended,
                "batches_done_in_epoch": t.batches_done_in_epoch, "samples_seen": t.samples_seen}

    def load_state_dict(self, loop: dict[str, Any]) -> None:
        t = self.trainer
        t.current_epoch, t.global_step = int(loop["epoch"]), int(loop["global_step"])
        t.samples_seen, batches_done = int(loop["samples_seen"]), int(loop["batches_done_in_epoch"])
        # Saved once the epoch's end ran (its scheduler step, validation): the next epoch starts. Saved
        # at its last batch before that: the resumed epoch has no batch left, only its end to run.
        # (Checkpoints without the flag were written at the end of an epoch of known length.)
        ended = loop.get("epoch_ended", t.steps_per_epoch is not None and batches_done >= t.steps_per_epoch)
        if ended:
            t.current_epoch, batches_done = t.current_epoch + 1, 0
        t.resume_at(batches_done)


class _Each:
    """A list of stateful objects (schedulers, callbacks) as one part."""

    def __init__(self, items: list[Any], keys: list[str] | None = None) -> None:
        self.items, self.keys = items, keys

    def state_dict(self) -> Any:
        states = [item.state_dict() for item in self.items]
        return dict(zip(self.keys, states, strict=True)) if self.keys is not None else states

    def load_state_dict(self, state: Any) -> None:
        if self.keys is not None:
            for key, item in zip(self.keys, self.items, strict=True):
                item.load_state_dict(state.get(key, {}))
            return
        for item, saved in zip(self.items, state, strict=True):
            item.load_state_dict(saved)


class _Metrics:
    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        return self.trainer.metrics.state_dict(self.trainer.runtime)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        t = self.trainer
        t.metrics.load_state_dict(t.runtime, state, mid_epoch=t.batches_done_in_epoch > 0)


def parts(trainer: Trainer) -> dict[str, Any]:
    """The Trainer's stateful parts besides the module and optimizers, in loading order."""
    callbacks = trainer.callbacks
    named = {
        "loop": _Loop(trainer),
        "schedulers": _Each([s for s, _ in trainer.lr_schedulers]),
        "precision": trainer.runtime.precision,
        "metrics": _Metrics(trainer),
        "callbacks": _Each(list(callbacks), [f"{type(c).__name__}-{i}" for i, c in enumerate(callbacks)]),
    }
    if trainer.train_loader is not None:
        named["loader"] = trainer.train_loader
    return named


def save(trainer: Trainer, path: Path, blocking: bool, then: Any = None) -> float:
    """Write the Trainer's checkpoint folder; every rank calls it. Returns the seconds it blocked."""
    rt = trainer.runtime
    objects = {name: part.state_dict() for name, part in parts(trainer).items()}
    objects["rng"] = rt.all_gather(capture_rng())
    objects["config"] = {k: str(v) for k, v in trainer.config.hparams().items()}
    objects["loggers"] = logger_states(trainer.loggers)  # rank 0's: its objects are the ones written
    trainer.fire("on_save_checkpoint", objects)
    loader = trainer.train_loader
    # The epoch counts from 1, as in the checkpoint's name and the progress lines.
    metadata = {"step": trainer.global_step, "epoch": trainer.current_epoch + 1,
                "global_batch": loader.sampler.batch_size if loader is not None else None,
                "metrics": {name: float(value) for name, value in trainer.callback_metrics.items()}}
    # rt.save syncs the ranks' buffers (BatchNorm statistics): rank 0's are saved.
    return rt.save(path, {**_model_and_optimizers(trainer), **objects}, blocking=blocking, metadata=metadata,
                   on_commit=then)


def _model_and_optimizers(trainer: Trainer) -> dict[str, Any]:
    """The model with its optimizers, as ``rt.save`` shards them (under the keys that earlier
    checkpoints hold: ``model``, its optimizers in their order)."""
    return {"model": trainer.module, **{f"optimizer-{i:03d}": o for i, o in enumerate(trainer.optimizers)}}


def logger_states(loggers: list[Any]) -> list[dict[str, Any]]:
    """What the loggers that keep a run (trackers' run ids) need to continue it after a resume."""
    return [{"type": type(logger).__name__, "state": logger.state_dict()}
            for logger in loggers if callable(getattr(logger, "state_dict", None))]


def resume(trainer: Trainer, path: Path) -> list[dict[str, Any]]:
    """Load the checkpoint folder ``path`` (already verified by ``agreed_checkpoint``) into the
    Trainer's parts; random states last, and only on the same number of processes. Returns the
    loggers' saved states (for ``resume_loggers``)."""
    rt = trainer.runtime
    saved = read_metadata(path).get("objects", [])
    state = rt.load(path, {**_model_and_optimizers(trainer), **dict.fromkeys(saved)}, verify=False)
    for name, part in parts(trainer).items():
        if name not in state:
            raise CheckpointError(f"{path}: holds no {name!r} state; it holds {sorted(state)}.")
        part.load_state_dict(state[name])
    trainer.fire("on_load_checkpoint", state)
    restore_rank_rng(rt, state["rng"])  # last: nothing may draw random numbers after it
    return list(state.get("loggers", []))
