"""``lockstep run``'s workers forked from its fork server (runtime/launch/fork_server.py): a worker sees what a
worker that torch's agent starts as a new interpreter sees, and the agent supervises it as it would that one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checks import dist as checks
from checks.fault_tolerance import process_tree

ROOT = Path(__file__).resolve().parents[2]
RUN = [sys.executable, "-m", "lockstep.cli.main", "run", "--devices", "2", "--accelerator", "cpu"]
pytestmark = [pytest.mark.timeout(150), pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux")]


def _facts(folder: Path, environment: dict[str, str], *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    for old in folder.glob("*.json"):
        old.unlink()
    done = subprocess.run([*RUN, "tests/scripts/worker_facts.py", str(folder), *args], cwd=ROOT, env=environment,
                          input="a line for rank 0\n", capture_output=True, text=True, timeout=120)
    return done, {path.stem: json.loads(path.read_text()) for path in folder.glob("*.json")}


def test_a_forked_worker_sees_what_a_worker_started_as_a_new_interpreter_sees(tmp_path):
    """The same script under the fork server and with the interpreter torchrun starts (``PYTHON_EXEC``): the
    same arguments, ``__main__``, import path, working folder, threads, environment, standard input and
    session; only the parent differs; each rank draws its own seeds (torch's, numpy's, Python's). An exit code
    passes through the client to the agent's report."""
    environment = {key: value for key, value in os.environ.items() if key != "PYTHON_EXEC"}
    forked_run, forked = _facts(tmp_path, environment)
    started_run, started = _facts(tmp_path, {**environment, "PYTHON_EXEC": sys.executable})
    assert forked_run.returncode == 0 and started_run.returncode == 0, forked_run.stderr + started_run.stderr
    assert sorted(forked) == sorted(started) == ["0", "1"]
    assert [forked[rank]["forked"] for rank in "01"] == [True, True]
    assert [started[rank]["forked"] for rank in "01"] == [False, False]
    for rank in "01":
        theirs = {**started[rank]["facts"], "python_exec": None}  # the interpreter chosen by hand is seen, as ever
        assert forked[rank]["facts"] == theirs, rank
    assert forked["0"]["facts"]["stdin"] == "a line for rank 0\n" and forked["0"]["facts"]["threads"] == 1
    assert forked["0"]["facts"]["blas_threads"] in (None, 1)  # numpy's, loaded in the server before the count was set
    assert sorted(forked_run.stdout.splitlines()) == sorted(started_run.stdout.splitlines())
    for runs in (forked, started):  # unseeded draws differ by rank, as each new interpreter draws its own seeds
        assert all(a != b for a, b in zip(runs["0"]["draws"], runs["1"]["draws"], strict=True)), runs
    failed, _ = _facts(tmp_path, environment, "3")
    assert failed.returncode == 1 and "failed with exit code 3" in failed.stderr, failed.stderr


def _client_of(rank: int, agent: int) -> int:
    """The agent's child that is rank ``rank``'s client (its environment names the rank)."""
    for pid in process_tree(agent):
        with open(f"/proc/{pid}/cmdline", "rb") as command, open(f"/proc/{pid}/environ", "rb") as environ:
            client = b"fork_server import client" in command.read()
            if client and f"RANK={rank}".encode() in environ.read().split(b"\0"):
                return pid
    raise AssertionError(f"no client of rank {rank} under the agent {agent}")


def test_a_killed_client_takes_its_worker_and_the_agent_names_its_rank(tmp_path):
    job = subprocess.Popen([*RUN, "tests/scripts/spin.py", str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.pid"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        workers = {int(p.stem): int(p.read_text()) for p in tmp_path.glob("*.pid")}
        assert len(workers) == 2
        os.kill(_client_of(1, job.pid), signal.SIGKILL)
        _, stderr = job.communicate(timeout=30)
    finally:
        job.kill()
    assert "rank 1 (local rank 1)" in stderr and "signal SIGKILL" in stderr, stderr
    assert not any(checks.pid_alive(pid) for pid in workers.values())
