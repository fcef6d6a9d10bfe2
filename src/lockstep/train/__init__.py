"""The Trainer layer: a loop with callbacks, loggers, checkpoints and profilers on the runtime."""

from lockstep.errors import CheckpointError
from lockstep.train.callbacks import Callback, EarlyStopping, LearningRateMonitor, ModelCheckpoint
from lockstep.train.loggers import CSVLogger, JSONLinesLogger, TensorBoardLogger
from lockstep.train.module import Module
from lockstep.train.profilers import AdvancedProfiler, PyTorchProfiler, SimpleProfiler
from lockstep.train.progress import ProgressBar, ThroughputMonitor
from lockstep.train.trackers import MLflowLogger, WandbLogger
from lockstep.train.trainer import Trainer

__all__ = ["AdvancedProfiler", "CSVLogger", "Callback", "CheckpointError", "EarlyStopping", "JSONLinesLogger",
           "LearningRateMonitor", "ModelCheckpoint", "Module", "ProgressBar", "PyTorchProfiler", "SimpleProfiler",
           "TensorBoardLogger", "ThroughputMonitor", "Trainer", "MLflowLogger", "WandbLogger"]
