"""lockstep: one PyTorch training script on one device, all GPUs of a machine, or many machines.

The names below load on first use: ``import lockstep`` costs next to nothing (the CLI's ``--help``
imports no torch), and ``lockstep.Runtime`` costs torch's own import and little more.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from lockstep.env import DistEnv
    from lockstep.errors import (
        CheckpointError,
        CollectiveError,
        EnvError,
        LockstepError,
        UnsafeCheckpointError,
        WorkerError,
    )
    from lockstep.runtime import (
        DDP,
        DP,
        FSDP,
        DistributedLoader,
        Runtime,
        SingleDevice,
        launch,
        seed_everything,
        unwrap,
    )
    from lockstep.train import (
        AdvancedProfiler,
        Callback,
        CSVLogger,
        EarlyStopping,
        JSONLinesLogger,
        LearningRateMonitor,
        MLflowLogger,
        ModelCheckpoint,
        Module,
        ProgressBar,
        PyTorchProfiler,
        SimpleProfiler,
        TensorBoardLogger,
        ThroughputMonitor,
        Trainer,
        WandbLogger,
    )

_WHERE = {
    **dict.fromkeys(["DistEnv"], "lockstep.env"),
    **dict.fromkeys(["CheckpointError", "CollectiveError", "EnvError", "LockstepError", "UnsafeCheckpointError",
                     "WorkerError"], "lockstep.errors"),
    **dict.fromkeys(["DDP", "DP", "FSDP", "DistributedLoader", "Runtime", "SingleDevice", "launch", "seed_everything",
                     "unwrap"], "lockstep.runtime"),
    **dict.fromkeys(["AdvancedProfiler", "CSVLogger", "Callback", "EarlyStopping", "JSONLinesLogger",
                     "LearningRateMonitor", "MLflowLogger", "ModelCheckpoint", "Module", "ProgressBar",
                     "PyTorchProfiler", "SimpleProfiler", "TensorBoardLogger", "ThroughputMonitor", "Trainer",
                     "WandbLogger"], "lockstep.train"),
}
_SUBPACKAGES = ("cli", "env", "errors", "runtime", "testing", "train")

__all__ = ["AdvancedProfiler", "CSVLogger", "Callback", "CheckpointError", "CollectiveError", "DDP", "DP", "DistEnv",
           "DistributedLoader", "EarlyStopping", "EnvError", "FSDP", "JSONLinesLogger", "LearningRateMonitor",
           "LockstepError", "MLflowLogger", "ModelCheckpoint", "Module", "ProgressBar", "PyTorchProfiler", "Runtime",
           "SimpleProfiler", "SingleDevice", "TensorBoardLogger", "ThroughputMonitor", "Trainer",
           "UnsafeCheckpointError", "WandbLogger", "WorkerError", "__version__", "launch", "seed_everything",
           "unwrap"]


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:
        return importlib.import_module(f"lockstep.{name}")
    if name not in _WHERE:
        raise AttributeError(f"module 'lockstep' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
