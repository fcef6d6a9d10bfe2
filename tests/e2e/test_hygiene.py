"""Nothing left running: however a job ends, every process it started ends within seconds.

The shared fixture in conftest.py also checks this after every test of the suite; these tests make
each way of ending a job happen, including the ones that run no clean-up code of their own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import session_processes

ROOT = Path(__file__).resolve().parents[2]
LOCKSTEP = [sys.executable, "-m", "lockstep.cli.main"]
pytestmark = [pytest.mark.timeout(120), pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")]


def _piped(args: list[str], timeout: float = 60) -> tuple[int, str, float]:
    """Run ``args`` with its output through a pipe, as ``python train.py | tee log`` does, and read
    to the end of the pipe: that end comes only once every process holding it has exited."""
    start = time.monotonic()
    job = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = job.communicate(timeout=timeout)
    finally:
        job.kill()
    return job.returncode, out, time.monotonic() - start


def _wait_for_pids(folder: Path, count: int, job: subprocess.Popen[str]) -> list[int]:
    deadline = time.monotonic() + 60
    while len(list(folder.glob("*.pid"))) < count:
        assert time.monotonic() < deadline and job.poll() is None, "the workers never started"
        time.sleep(0.1)
    return [int(p.read_text()) for p in folder.glob("*.pid")]


def _none_left_within(seconds: float, before: set[int]) -> dict[int, str]:
    deadline = time.monotonic() + seconds
    while True:
        left = {pid: cmd for pid, cmd in session_processes().items() if pid not in before}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


@pytest.mark.parametrize("mode", ["ok", "raise"])
def test_a_piped_launch_with_loader_workers_reaches_the_end_of_its_output(mode):
    # 16-22 s alone on a 2-core machine, up to 58 s beside another test: a pipe kept open for good (the
    # processes that held it never end) runs into the 100 s limit
    code, out, took = _piped([sys.executable, "tests/scripts/launch_loader.py", mode], timeout=100)
    assert (code == 0) == (mode == "ok"), out
    assert ("samples of rank 0: 32" in out) if mode == "ok" else ("rank 1 fails with its loader workers" in out)
    assert took < 90, f"the pipe stayed open {took:.1f}s"


@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL, signal.SIGINT])
def test_a_stopped_launcher_takes_its_workers_and_their_loader_workers_with_it(how, tmp_path):
    before = set(session_processes())
    # SIGINT as a terminal's Ctrl-C delivers it: a suite run in the background (`make check &`) starts
    # with SIGINT ignored, which its children would inherit.
    job = subprocess.Popen([sys.executable, "tests/scripts/launch_loader.py", "wait", str(tmp_path)], cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        _wait_for_pids(tmp_path, 2, job)
        assert len(session_processes()) - len(before) >= 6  # launcher, 2 ranks, 4 loader workers, servers
        job.send_signal(how)
        try:
            job.communicate(timeout=30)  # the end of the pipe: nobody holds it any more
        except subprocess.TimeoutExpired:
            running = {pid: cmd for pid, cmd in session_processes().items() if pid not in before}
            for pid in running:  # whoever holds the pipe, so that the output can be read
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            pytest.fail(f"the pipe stayed open 30s after {how.name}; still running: {running}\n"
                        f"the launcher's output:\n{job.communicate(timeout=30)[0]}")
        left = _none_left_within(10, before)
    finally:
        job.kill()
    assert not left, f"left running after {how.name}: {left}"


@pytest.mark.parametrize("route", ["lockstep run", "self-launch", "torch.distributed.launch"])
def test_workers_of_an_agent_killed_by_sigkill_stop_within_seconds(route, tmp_path):
    """The legacy launcher runs its workers under torch's elastic agent too: they trained on, orphaned."""
    before = set(session_processes())
    if route == "lockstep run":
        args, env = [*LOCKSTEP, "run", "--devices", "2", "--accelerator", "cpu"], os.environ
    elif route == "torch.distributed.launch":
        args, env = [sys.executable, "-m", "torch.distributed.launch", "--nproc-per-node", "2"], os.environ
    else:
        args, env = [sys.executable], {**os.environ, "SPIN_DEVICES": "2"}
    agent = subprocess.Popen([*args, "tests/scripts/spin.py", str(tmp_path)], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        workers = _wait_for_pids(tmp_path, 2, agent)
        agent.send_signal(signal.SIGKILL)  # the agent runs no clean-up of its own
        killed = time.monotonic()
        agent.communicate(timeout=30)
        left = _none_left_within(10, before)
        took = time.monotonic() - killed
    finally:
        agent.kill()
    assert not left, f"workers {workers} outlived their agent: {left}"
    assert took < 10


def test_an_elastic_run_leaves_no_temporary_folder(tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    job = subprocess.run([*LOCKSTEP, "run", "--devices", "2", "--accelerator", "cpu", "tests/scripts/spin.py",
                          str(tmp_path), "raise"], cwd=ROOT, env={**os.environ, "TMPDIR": str(temp)},
                         capture_output=True, text=True, timeout=90)
    assert job.returncode != 0 and "rank one gives up at step 5" in job.stderr  # read from the agent's log folder
    assert list(temp.iterdir()) == []
