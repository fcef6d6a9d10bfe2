"""The runtime layer: usable alone, with your own training loop.

``runtime.py`` is the facade (``Runtime``) over one room per concern (``data``, ``parallel`` with its
``pipeline`` room, ``fault_tolerance``, ``checkpoint``, ``comm``, ``faults``, ``launch``); each room's
``__init__`` says what it must not import, and docs/architecture.md is the one map of them. The names
below load on first use, so ``import lockstep.runtime`` costs nothing beyond torch's own import until
one is used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lockstep._lazy import lazy_attributes

if TYPE_CHECKING:
    from lockstep.env.fault_tolerance import FaultTolerance
    from lockstep.errors import CheckpointError, CollectiveError, WorkerError
    from lockstep.runtime.checkpoint.format import is_checkpoint_folder, read_metadata
    from lockstep.runtime.checkpoint.life import Checkpoint, complete_checkpoints
    from lockstep.runtime.config import RuntimeConfig
    from lockstep.runtime.data.loader import DistributedLoader
    from lockstep.runtime.data.streams import is_stream
    from lockstep.runtime.files import write_atomic
    from lockstep.runtime.launch.replicas import Lighthouse
    from lockstep.runtime.parallel.activation_checkpointing import Policy
    from lockstep.runtime.parallel.devices import Devices
    from lockstep.runtime.parallel.flop_count import FlopCount
    from lockstep.runtime.parallel.fsdp import FSDP
    from lockstep.runtime.parallel.mesh import Parallel
    from lockstep.runtime.parallel.strategy import DDP, DP, SingleDevice, Strategy
    from lockstep.runtime.parallel.wrappers import unwrap
    from lockstep.runtime.runtime import Runtime
    from lockstep.runtime.seed import RandomStates, seed_everything
    from lockstep.runtime.tree import batch_size_of

_WHERE = {
    "CheckpointError": "lockstep.errors", "CollectiveError": "lockstep.errors", "WorkerError": "lockstep.errors",
    "read_metadata": "lockstep.runtime.checkpoint.format", "is_checkpoint_folder": "lockstep.runtime.checkpoint.format",
    "Checkpoint": "lockstep.runtime.checkpoint.life", "complete_checkpoints": "lockstep.runtime.checkpoint.life",
    "RuntimeConfig": "lockstep.runtime.config",
    "DistributedLoader": "lockstep.runtime.data.loader", "is_stream": "lockstep.runtime.data.streams",
    "write_atomic": "lockstep.runtime.files", "FSDP": "lockstep.runtime.parallel.fsdp",
    "Parallel": "lockstep.runtime.parallel.mesh",
    "FlopCount": "lockstep.runtime.parallel.flop_count", "Devices": "lockstep.runtime.parallel.devices",
    "Policy": "lockstep.runtime.parallel.activation_checkpointing", "Strategy": "lockstep.runtime.parallel.strategy",
    "DDP": "lockstep.runtime.parallel.strategy", "DP": "lockstep.runtime.parallel.strategy",
    "SingleDevice": "lockstep.runtime.parallel.strategy",
    "FaultTolerance": "lockstep.env.fault_tolerance",
    "Lighthouse": "lockstep.runtime.launch.replicas",
    "unwrap": "lockstep.runtime.parallel.wrappers", "Runtime": "lockstep.runtime.runtime",
    "seed_everything": "lockstep.runtime.seed", "RandomStates": "lockstep.runtime.seed",
    "batch_size_of": "lockstep.runtime.tree",
}

__all__ = ["Checkpoint", "CheckpointError", "CollectiveError", "DDP", "DP", "Devices", "DistributedLoader", "FSDP",
           "FaultTolerance", "FlopCount", "Lighthouse", "Parallel", "Policy", "Runtime", "RuntimeConfig",
           "SingleDevice", "Strategy", "WorkerError", "batch_size_of", "complete_checkpoints", "is_checkpoint_folder",
           "is_stream", "RandomStates", "read_metadata", "seed_everything", "unwrap", "write_atomic"]


__getattr__, __dir__ = lazy_attributes("lockstep.runtime", _WHERE, globals())
