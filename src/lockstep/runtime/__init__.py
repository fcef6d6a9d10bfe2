"""The runtime layer: usable alone, with your own training loop."""

from lockstep.runtime.config import RuntimeConfig
from lockstep.runtime.data import DistributedLoader
from lockstep.runtime.files import write_atomic
from lockstep.runtime.fsdp import FSDP
from lockstep.runtime.runtime import Runtime
from lockstep.runtime.seed import seed_everything
from lockstep.runtime.spawn import WorkerError, launch
from lockstep.runtime.strategy import DDP, DP, SingleDevice
from lockstep.runtime.tree import batch_size_of
from lockstep.runtime.wrappers import unwrap

__all__ = ["DDP", "DP", "FSDP", "DistributedLoader", "Runtime", "RuntimeConfig", "SingleDevice", "WorkerError",
           "batch_size_of", "launch", "seed_everything", "unwrap", "write_atomic"]
