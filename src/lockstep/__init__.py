"""lockstep: one PyTorch training script on one device, all GPUs of a machine, or many machines."""

from lockstep.env import DistEnv, EnvError
from lockstep.runtime import (
    DDP,
    DP,
    DistributedLoader,
    Runtime,
    SingleDevice,
    WorkerError,
    launch,
    seed_everything,
    unwrap,
)

__version__ = "0.1.0"

__all__ = ["DDP", "DP", "DistEnv", "DistributedLoader", "EnvError", "Runtime", "SingleDevice",
           "WorkerError", "__version__", "launch", "seed_everything", "unwrap"]
