"""``TrainerConfig``: the Trainer's settings as one frozen value, validated once, logged as they are."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from numbers import Integral, Real
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lockstep.runtime import Policy, Runtime

from lockstep.errors import ConfigError
from lockstep.runtime import RuntimeConfig

# The settings that shape the loop's collectives or its result: the same on every rank.
_LOOP_SETTINGS = ("max_epochs", "max_steps", "accumulate_grad_batches", "gradient_clip_val", "val_check_interval",
                  "log_every_n_steps", "checkpoint_dir", "resume")


@dataclass(frozen=True)
class TrainerConfig:
    """What ``lockstep.Trainer``'s keyword arguments set, besides its callbacks, loggers and profiler.

    ``runtime`` holds the arguments that go to ``lockstep.Runtime``.
    """

    max_epochs: int | None = None
    max_steps: int | None = None
    num_nodes: int | None = None
    accumulate_grad_batches: int = 1
    gradient_clip_val: float | None = None
    val_check_interval: int | None = None
    log_every_n_steps: int = 50
    checkpoint_dir: Path | None = None
    resume: str | Path | None = None
    log_dir: Path | None = None
    num_workers: int | None = None
    compile: bool | dict[str, Any] | None = None
    activation_checkpointing: Policy | None = None
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    def __post_init__(self) -> None:
        for name in ("accumulate_grad_batches", "log_every_n_steps", "max_epochs", "max_steps", "val_check_interval",
                     "num_nodes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, Integral) or value < 1):
                fraction = (" lockstep's val_check_interval counts optimizer steps, across epochs; Lightning's "
                            "fraction of an epoch is not taken: for half of an epoch of N steps, pass N // 2."
                            if name == "val_check_interval" and isinstance(value, float) else "")
                raise ConfigError(f"{name}={value!r}: must be a whole number, at least 1.{fraction}")
        clip = self.gradient_clip_val
        if clip is not None and (isinstance(clip, bool) or not isinstance(clip, Real) or not clip >= 0):
            raise ConfigError(f"gradient_clip_val={clip!r}: the largest total norm of the gradients, a number above "
                              "0 (0 or None: no clipping).")
        if self.resume is not None and str(self.resume) == "auto" and self.checkpoint_dir is None:
            raise ConfigError("resume='auto' looks in checkpoint_dir: give checkpoint_dir=... too.")

    def check_runtime(self, rt: Runtime) -> None:
        """The Runtime the Trainer made runs what it was asked for: ``num_nodes`` as launched, and every rank
        given the same loop (a rank with another ``max_steps``, accumulation or logging interval would meet
        the others in other collectives and wait out the timeout; one with another clipping norm or
        checkpoint folder would train on apart). One small all-gather."""
        if self.num_nodes is not None and rt.num_nodes != self.num_nodes:
            raise ConfigError(f"Trainer(num_nodes={self.num_nodes}) but the launcher started {rt.num_nodes} "
                              "node(s): make them agree.")
        if rt.world_size == 1:
            return
        mine = [repr(getattr(self, name)) for name in _LOOP_SETTINGS]
        everyone = rt.all_gather(mine)
        differ = [f"{name} is " + ", ".join(f"{values[i]} on rank {rank}" for rank, values in enumerate(everyone))
                  for i, name in enumerate(_LOOP_SETTINGS) if any(values[i] != mine[i] for values in everyone)]
        if differ:
            raise ConfigError(f"the ranks were given different Trainer settings ({'; '.join(differ)}): give every "
                              "rank the same arguments (a value read from the rank, its host or its clock differs "
                              "between them).")

    def hparams(self) -> dict[str, Any]:
        """Every setting in one flat dict, named as the Trainer's arguments (for loggers and checkpoints)."""
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "runtime"}
        return {**own, **self.runtime.kwargs()}
