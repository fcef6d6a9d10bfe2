"""The environment contract between launchers and workers."""

from lockstep.env.distenv import DistEnv, EnvError
from lockstep.env.nodelist import expand_nodelist, expand_tasks_per_node
from lockstep.env.settings import (
    RUNTIME_VARIABLES,
    cache_dir_from_environ,
    checksums_from_environ,
    debug_from_environ,
    job_secret_from_environ,
    runtime_choices_from_environ,
    slurm_requeue_from_environ,
    timeout_from_environ,
    verify_from_environ,
)

__all__ = ["RUNTIME_VARIABLES", "DistEnv", "EnvError", "cache_dir_from_environ", "checksums_from_environ",
           "expand_nodelist", "expand_tasks_per_node",
           "debug_from_environ", "job_secret_from_environ", "runtime_choices_from_environ",
           "slurm_requeue_from_environ", "timeout_from_environ", "verify_from_environ"]
