"""Run settings that a launcher or the user passes through ``LOCKSTEP_*`` variables."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

from lockstep.errors import ConfigError

#: how long a collective, or the ranks' and the nodes' rendezvous, waits without LOCKSTEP_TIMEOUT or timeout=
DEFAULT_TIMEOUT_S = 300.0


def timeout_from_environ(environ: Mapping[str, str] | None = None) -> float | None:
    """``LOCKSTEP_TIMEOUT`` in seconds, or None when unset."""
    env = os.environ if environ is None else environ
    raw = env.get("LOCKSTEP_TIMEOUT")
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"LOCKSTEP_TIMEOUT={raw!r} is not a number of seconds.") from None
    if not 0 < value < float("inf"):  # nan and inf too: a collective's wait is a finite number of seconds
        raise ConfigError(f"LOCKSTEP_TIMEOUT={raw!r} must be a positive, finite number of seconds.")
    return value


def straggler_factor_from_environ(environ: Mapping[str, str] | None = None) -> float:
    """``LOCKSTEP_STRAGGLER_FACTOR``: how far above its peers' median a rank's own work must stay to be named
    a straggler (default 1.3; 0 turns the straggler report off)."""
    env = os.environ if environ is None else environ
    raw = env.get("LOCKSTEP_STRAGGLER_FACTOR", "").strip()
    if not raw:
        return 1.3
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if value != 0 and not value > 1:  # NaN, a word, or a factor that names every rank
        raise ConfigError(f"LOCKSTEP_STRAGGLER_FACTOR={raw!r}: give a factor above 1 (e.g. 1.3), or 0 to turn the "
                          "straggler report off.")
    return value


def straggler_summary_from_environ(environ: Mapping[str, str] | None = None) -> str | None:
    """Set by ``lockstep run``: the file where rank 0 writes the slowest rank named, for the run's last line."""
    env = os.environ if environ is None else environ
    return env.get("LOCKSTEP_STRAGGLER_SUMMARY") or None


RUNTIME_VARIABLES = {
    "accelerator": "LOCKSTEP_ACCELERATOR",
    "strategy": "LOCKSTEP_STRATEGY",
    "precision": "LOCKSTEP_PRECISION",
    "parallel": "LOCKSTEP_PARALLEL",
}


def runtime_choices_from_environ(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The choices ``lockstep run`` passes to the script (accelerator, strategy, precision, parallel).

    They fill in the ``Runtime`` arguments that the script leaves unset; arguments in code win.
    """
    env = os.environ if environ is None else environ
    return {name: env[var] for name, var in RUNTIME_VARIABLES.items() if env.get(var)}


def debug_from_environ(environ: Mapping[str, str] | None = None) -> bool:
    """``LOCKSTEP_DEBUG=1`` turns on the collective checks of debug mode."""
    env = os.environ if environ is None else environ
    raw = env.get("LOCKSTEP_DEBUG", "").strip().lower()
    if raw not in ("", "0", "false", "no", "off", "1", "true", "yes", "on"):
        raise ConfigError(f"LOCKSTEP_DEBUG={raw!r}: give 1 (debug mode on) or 0 (off).")
    return raw in ("1", "true", "yes", "on")


def slurm_requeue_from_environ(environ: Mapping[str, str] | None = None) -> str | None:
    """The SLURM job id to requeue on preemption, when the job script asked for it (``lockstep slurm``)."""
    env = os.environ if environ is None else environ
    if env.get("LOCKSTEP_REQUEUE", "") == "1" and env.get("SLURM_JOB_ID"):
        return env["SLURM_JOB_ID"]
    return None


def job_secret_from_environ(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The secret that signs the messages a job's launchers exchange: ``LOCKSTEP_JOB_SECRET``, else
    the SLURM job id (known to the cluster's users, not to other hosts), else None (unsigned)."""
    env = os.environ if environ is None else environ
    if env.get("LOCKSTEP_JOB_SECRET"):
        return env["LOCKSTEP_JOB_SECRET"].encode()
    if env.get("SLURM_JOB_ID"):
        return f"slurm-job-{env['SLURM_JOB_ID']}".encode()
    return None


def checksums_from_environ(environ: Mapping[str, str] | None = None) -> bool:
    """``LOCKSTEP_CHECKPOINT_CHECKSUMS=0`` turns checkpoint checksums off (on by default)."""
    env = os.environ if environ is None else environ
    return env.get("LOCKSTEP_CHECKPOINT_CHECKSUMS", "1").strip().lower() not in ("0", "false", "no", "off")


#: The exit status of a worker that stopped for a preemption after its checkpoint, on a route that cannot requeue
#: (Kubernetes): 128 + TERM, as if TERM had ended it, so that a restart policy keyed on the code sees a preemption.
PREEMPTED_EXIT = 143

#: Set by ``lockstep run --engine ray`` without ``--keep-checkpoints``: Ray keeps a copy of the checkpoints the
#: script keeps, each copy deleted once the script deleted its checkpoint (``checkpoint.ray_record``).
RAY_CHECKPOINTS = "LOCKSTEP_RAY_CHECKPOINTS"

VERIFY_VARIABLES = ("LOCKSTEP_VERIFY", "LOCKSTEP_VERIFY_STEPS", "LOCKSTEP_VERIFY_TRACE", "LOCKSTEP_VERIFY_FINGERPRINT")


def verify_from_environ(environ: Mapping[str, str] | None = None) -> tuple[str, int] | None:
    """Under ``lockstep verify``: the folder to record the first steps in, and how many (else None)."""
    env = os.environ if environ is None else environ
    folder, steps = env.get(VERIFY_VARIABLES[0], ""), env.get(VERIFY_VARIABLES[1], "5")
    if not folder:
        return None
    if not steps.isdigit() or int(steps) < 1:
        raise ConfigError(f"{VERIFY_VARIABLES[1]}={steps!r}: give a positive number of optimizer steps.")
    return folder, int(steps)


def verify_trace_from_environ(environ: Mapping[str, str] | None = None) -> int:
    """Under ``lockstep verify``'s second pass: the optimizer step whose module outputs to trace (0: none)."""
    env = os.environ if environ is None else environ
    step = env.get(VERIFY_VARIABLES[2], "0")
    if not step.isdigit():
        raise ConfigError(f"{VERIFY_VARIABLES[2]}={step!r}: give the optimizer step to trace.")
    return int(step)


def verify_fingerprints_from_environ(environ: Mapping[str, str] | None = None) -> bool:
    """Under ``lockstep verify`` of one layout against itself: trace fingerprints, not tensors."""
    env = os.environ if environ is None else environ
    return env.get(VERIFY_VARIABLES[3], "") == "1"


def cache_dir_from_environ(environ: Mapping[str, str] | None = None) -> Path:
    """lockstep's own files that outlive a job (measured peaks, folded tracebacks):
    ``LOCKSTEP_CACHE_DIR``, else ``$XDG_CACHE_HOME/lockstep``, else ``~/.cache/lockstep``."""
    environ = os.environ if environ is None else environ
    root = environ.get("LOCKSTEP_CACHE_DIR") or os.path.join(
        environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "lockstep")
    return Path(root)
