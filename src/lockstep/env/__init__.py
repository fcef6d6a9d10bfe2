"""The environment contract between launchers and workers."""

from lockstep.env.distenv import DistEnv, EnvError
from lockstep.env.nodelist import expand_nodelist, expand_tasks_per_node
from lockstep.env.settings import timeout_from_environ

__all__ = ["DistEnv", "EnvError", "expand_nodelist", "expand_tasks_per_node", "timeout_from_environ"]
