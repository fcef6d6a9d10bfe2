"""lockstep: one PyTorch training script on one device, all GPUs of a machine, or many machines.

The names below load on first use: ``import lockstep`` costs next to nothing (the CLI's ``--help``
imports no torch), and ``lockstep.Runtime`` costs torch's own import and little more.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lockstep._lazy import lazy_attributes

__version__ = "0.1.0"

if TYPE_CHECKING:
    from lockstep.env import DistEnv
    from lockstep.errors import (
        CheckpointError,
        CollectiveError,
        ConfigError,
        EnvError,
        LockstepError,
        MissingExtraError,
        RendezvousError,
        StateError,
        UnsafeCheckpointError,
        UsageError,
        WorkerError,
    )
    from lockstep.runtime import (
        DDP,
        DP,
        FSDP,
        DistributedLoader,
        FaultTolerance,
        Parallel,
        Runtime,
        SingleDevice,
        seed_everything,
        unwrap,
    )
    from lockstep.runtime.launch.ray_engine import run_script
    from lockstep.runtime.launch.spawn import launch
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
    **dict.fromkeys(["CheckpointError", "CollectiveError", "ConfigError", "EnvError", "LockstepError",
                     "MissingExtraError", "RendezvousError", "StateError", "UnsafeCheckpointError", "UsageError",
                     "WorkerError"], "lockstep.errors"),
    **dict.fromkeys(["DDP", "DP", "FSDP", "DistributedLoader", "FaultTolerance", "Parallel",
                     "Runtime", "SingleDevice", "seed_everything", "unwrap"],
                    "lockstep.runtime"),
    "launch": "lockstep.runtime.launch.spawn",  # lockstep.runtime.launch is the launcher-side subpackage
    "run_script": "lockstep.runtime.launch.ray_engine",
    **dict.fromkeys(["AdvancedProfiler", "CSVLogger", "Callback", "EarlyStopping", "JSONLinesLogger",
                     "LearningRateMonitor", "MLflowLogger", "ModelCheckpoint", "Module", "ProgressBar",
                     "PyTorchProfiler", "SimpleProfiler", "TensorBoardLogger", "ThroughputMonitor", "Trainer",
                     "WandbLogger"], "lockstep.train"),
}
_SUBPACKAGES = ("cli", "env", "errors", "runtime", "testing", "train")

__all__ = ["AdvancedProfiler", "CSVLogger", "Callback", "CheckpointError", "CollectiveError", "ConfigError", "DDP",
           "DP", "DistEnv", "DistributedLoader", "EarlyStopping", "EnvError", "FSDP", "FaultTolerance",
           "JSONLinesLogger", "LearningRateMonitor", "LockstepError", "MLflowLogger", "MissingExtraError",
           "ModelCheckpoint", "Module", "Parallel", "ProgressBar", "PyTorchProfiler", "RendezvousError", "Runtime",
           "SimpleProfiler", "SingleDevice", "StateError", "TensorBoardLogger", "ThroughputMonitor", "Trainer",
           "UnsafeCheckpointError", "UsageError", "WandbLogger", "WorkerError", "__version__", "launch",
           "run_script", "seed_everything", "unwrap"]


__getattr__, __dir__ = lazy_attributes("lockstep", _WHERE, globals(), _SUBPACKAGES)

# In a rank of a job of several, each printed line is written whole (lockstep.env.lines).
from lockstep.env.lines import whole_lines as _whole_lines  # noqa: E402

_whole_lines()
