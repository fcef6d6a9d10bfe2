"""Shared test fixtures: no test may leave a process running.

Every process the suite starts, directly or not (workers, DataLoader workers, forkservers, agents,
processes in network namespaces), inherits ``LOCKSTEP_TEST_SESSION``, which ``/proc/PID/environ``
shows even after its parent is gone. After each test, any such process that the test started and
that still runs after a grace period fails the test (and is then killed, so that the next test
starts clean). The suite's own forkserver and resource tracker (children of pytest that serve every
launch) are the only long-lived ones allowed, with wandb's service, which wandb starts once per
process and ends when that process (here pytest) ends.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest

# The ranks that run_ranks starts are forked from one forkserver per test session. It imports, once,
# what many rank functions import (a Hugging Face model takes 4 s to import on 2 cores): without it,
# every rank of every launch imported them anew (FSDP, DCP and DTensor take 2-3 s more), minutes of
# the suite's time.
PRELOADED = ["lockstep.runtime.launch.spawn", "torch.distributed.fsdp", "torch.distributed.tensor.parallel",
             "torch.distributed.checkpoint", "transformers", "transformers.models.llama.modeling_llama",
             "transformers.models.gpt2.modeling_gpt2", "torchao.float8", "datasets"]


# Where torch sees a GPU, torchao's import reads the device (and so starts CUDA): a forkserver that
# imported it would fork ranks that cannot use CUDA ("Cannot re-initialize CUDA in forked subprocess").
# There it preloads torch's own modules only.
STARTS_CUDA = ("transformers", "torchao", "datasets")

# torch.compile's worker processes live as long as the process that compiled: in the test process they
# would outlive each test (and fail its leftover check). One compile thread compiles in the process.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


def pytest_configure(config: pytest.Config) -> None:
    if sys.platform.startswith("linux"):
        import torch

        cuda = torch.cuda.is_available()
        multiprocessing.set_forkserver_preload(
            [name for name in PRELOADED if not (cuda and name.startswith(STARTS_CUDA))])
        multiprocessing.forkserver.ensure_running()


# ``make check`` runs the tests in two passes. First every test not marked ``alone`` on two pytest-xdist
# workers (``--dist load``: each test goes to whichever worker is free; each network-namespace test makes
# its own nodes). Then the tests marked ``alone``, one at a time on an otherwise idle machine: their
# deadlines (a quorum's, a step's) assume one, and the local SLURM cluster listens on fixed ports (Ray's
# workers take ports from 10002 up, where SLURM jobs put their master). xdist's ``xdist_group`` would keep
# the Ray tests on one worker, but it does not take effect under pytest 9.2 (xdist 3.8 renames
# ``item._nodeid``, which pytest 9.2 no longer reads): two Ray tests may run at once.


TOKEN = f"LOCKSTEP_TEST_SESSION={uuid.uuid4().hex}".encode()
os.environ["LOCKSTEP_TEST_SESSION"] = TOKEN.split(b"=", 1)[1].decode()
LEFTOVER_GRACE_S = 10.0
_SERVERS = (b"multiprocessing.forkserver", b"multiprocessing.resource_tracker")


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError:
        return b""


def session_processes() -> dict[int, str]:
    """Running (not zombie) processes started by this test session, other than pytest and the
    launch servers it owns: pid -> command line."""
    me = os.getpid()
    found = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        if TOKEN not in _read(f"/proc/{pid}/environ").split(b"\0"):
            continue
        stat = _read(f"/proc/{pid}/stat")
        if not stat:
            continue
        state, ppid = stat.rsplit(b")", 1)[1].split()[:2]
        cmdline = _read(f"/proc/{pid}/cmdline")
        if state == b"Z" or (int(ppid) == me and any(s in cmdline for s in _SERVERS)):
            continue
        if b"wandb-core" in cmdline and f"--pid\0{me}\0".encode() in cmdline + b"\0":
            continue
        found[pid] = cmdline.replace(b"\0", b" ").decode(errors="replace")[:200]
    return found


@pytest.fixture(autouse=True)
def no_process_left_behind():
    if not os.path.isdir("/proc"):
        yield
        return
    before = set(session_processes())
    yield
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    left = {pid: cmd for pid, cmd in session_processes().items() if pid not in before}
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = {pid: cmd for pid, cmd in session_processes().items() if pid not in before}
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if left:
        lines = "\n".join(f"  {pid}: {cmd}" for pid, cmd in sorted(left.items()))
        pytest.fail(f"the test left {len(left)} process(es) running {LEFTOVER_GRACE_S:g}s after it ended:\n{lines}")


@pytest.fixture(autouse=True)
def private_cache(tmp_path_factory, monkeypatch):
    """Each test reads and writes its own lockstep cache (measured peaks), never the user's."""
    monkeypatch.setenv("LOCKSTEP_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
