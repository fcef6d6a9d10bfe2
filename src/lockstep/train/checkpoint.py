"""The Trainer's checkpoints: its stateful parts, finding the newest complete one, and resuming.

A checkpoint is a folder (``lockstep.runtime.checkpoint``, format 2): the module and optimizers as
shards, the other parts' states from rank 0. Single-file checkpoints of format 1 still resume.
"""

from __future__ import annotations

import random
import re
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from lockstep.runtime import Runtime, write_atomic
from lockstep.runtime.checkpoint import CheckpointError, ModelState, is_checkpoint_folder, read_metadata

if TYPE_CHECKING:
    from lockstep.train.trainer import Trainer

FORMAT = 1  # the single-file layout (still read); folders are format 2


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


def newest_valid(folder: Path) -> tuple[Path, int] | None:
    """The complete checkpoint in ``folder`` with the most training steps (ties: the newest), and
    that step. Folders are judged by their metadata alone; format-1 files are read whole."""
    if not folder.is_dir():
        return None
    best: tuple[int, float, Path] | None = None
    for path in folder.iterdir():
        try:
            if is_checkpoint_folder(path):
                step = int(read_metadata(path).get("step", _step_of(path)))
            elif path.suffix == ".ckpt" and path.is_file() and not path.name.startswith("."):
                step = int(load(path).get("loop", {}).get("global_step", _step_of(path)))
            else:
                continue
        except CheckpointError:
            continue  # e.g. truncated by a crash: fall back to an older one
        candidate = (step, path.stat().st_mtime, path)
        if best is None or candidate[:2] > best[:2]:
            best = candidate
    return None if best is None else (best[2], best[0])


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


def agreed_checkpoint(rt: Runtime, resume: str | Path, checkpoint_dir: Path | None) -> tuple[Path, int] | None:
    """The checkpoint to resume from (``"auto"``: the newest complete one in ``checkpoint_dir``) and
    its step, the same on every rank, or an error that says why not. Every rank must call it.

    Each rank looks on its own file system: one that the nodes do not share would otherwise
    resume some ranks and train the others from scratch.
    """
    found, problem = None, ""
    try:
        if str(resume) == "auto":
            assert checkpoint_dir is not None, "TrainerConfig checks that resume='auto' has a folder"
            found = newest_valid(checkpoint_dir)
        else:
            path = Path(resume)
            step = read_metadata(path).get("step", -1) if path.is_dir() else load(path)["loop"]["global_step"]
            found = path, int(step)
    except CheckpointError as error:
        problem = str(error)
    mine = problem or (f"{found[0].name} (step {found[1]})" if found else "none")
    seen = rt.all_gather((socket.gethostname(), mine))
    if len({what for _, what in seen}) > 1 or problem:
        lines = [f"  rank {r} on {host}: {what}" for r, (host, what) in enumerate(seen)]
        raise CheckpointError(
            "the ranks cannot resume from the same checkpoint:\n" + "\n".join(lines) + "\n"
            "Every rank writes its shards into the checkpoint folder: put checkpoint_dir (or the resume path) "
            "on a file system that every node shares."
        )
    return found


class _Loop:
    """The loop counters; loading them also says where the resumed epoch continues."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        t = self.trainer
        return {"epoch": t.current_epoch, "global_step": t.global_step,
                "batches_done_in_epoch": t.batches_done_in_epoch, "samples_seen": t.samples_seen}

    def load_state_dict(self, loop: dict[str, Any]) -> None:
        t = self.trainer
        t.current_epoch, t.global_step = int(loop["epoch"]), int(loop["global_step"])
        t.samples_seen, batches_done = int(loop["samples_seen"]), int(loop["batches_done_in_epoch"])
        if t.steps_per_epoch is not None and batches_done >= t.steps_per_epoch:
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
    trainer.fire("on_save_checkpoint", objects)
    loader = trainer.train_loader
    metadata = {"step": trainer.global_step, "epoch": trainer.current_epoch, "world_size": rt.world_size,
                "strategy": rt.strategy.name, "global_batch": loader.sampler.batch_size if loader else None}
    sharded = {"model": ModelState(trainer.module, trainer.optimizers)}
    return rt.checkpointer.save(path, sharded, objects, metadata, blocking=blocking, then=then)


def resume(trainer: Trainer, path: Path) -> None:
    """Load the checkpoint ``path`` (a folder, or a format-1 file) into the Trainer's parts; random
    states last, and only on the same number of processes."""
    rt = trainer.runtime
    if path.is_dir():
        sharded = {"model": ModelState(trainer.module, trainer.optimizers)}
        state = rt.checkpointer.load(path, sharded)
        named = parts(trainer)
        for name, part in named.items():
            if name not in state:
                raise CheckpointError(f"{path}: holds no {name!r} state; it holds {sorted(state)}.")
            part.load_state_dict(state[name])
    else:
        state = load(path)
        _resume_format_1(trainer, path, state)
    trainer.fire("on_load_checkpoint", state)
    restore_rank_rng(rt, state["rng"])  # last: nothing may draw random numbers after it


def _resume_format_1(trainer: Trainer, path: Path, state: dict[str, Any]) -> None:
    """A single-file checkpoint: whole module and per-optimizer states, saved by rank 0."""
    if trainer.runtime.strategy.collective_forward:
        raise CheckpointError(f"{path}: a single-file checkpoint (format 1) resumes under ddp or one process, "
                              "not FSDP: resume it with strategy='ddp', save, then switch.")
    load_module_state(trainer.module, state["module"], path)
    for optimizer, saved in zip(trainer.optimizers, state["optimizers"], strict=True):
        optimizer.load_state_dict(saved)
    named = parts(trainer)
    named["loop"].load_state_dict(state["loop"])
    named["schedulers"].load_state_dict(state["schedulers"])
    named["precision"].load_state_dict(state["precision"])
    named["metrics"].load_state_dict(state)
    named["callbacks"].load_state_dict(state["callbacks"])
