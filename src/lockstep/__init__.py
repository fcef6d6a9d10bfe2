"""lockstep: one PyTorch training script on one device, all GPUs of a machine, or many machines."""

from lockstep.env import DistEnv, EnvError
from lockstep.runtime import (
    DDP,
    DP,
    FSDP,
    DistributedLoader,
    Runtime,
    SingleDevice,
    WorkerError,
    launch,
    seed_everything,
    unwrap,
)
from lockstep.train import (
    AdvancedProfiler,
    Callback,
    CheckpointError,
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

__version__ = "0.1.0"

__all__ = ["DDP", "DP", "FSDP", "AdvancedProfiler", "CSVLogger", "Callback", "CheckpointError", "DistEnv",
           "DistributedLoader", "EarlyStopping", "EnvError", "JSONLinesLogger", "LearningRateMonitor",
           "MLflowLogger", "ModelCheckpoint", "Module", "ProgressBar", "PyTorchProfiler", "Runtime",
           "SimpleProfiler", "SingleDevice", "TensorBoardLogger", "ThroughputMonitor", "Trainer", "WandbLogger",
           "WorkerError", "__version__", "launch", "seed_everything", "unwrap"]
