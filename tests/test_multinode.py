"""Two hosts as network namespaces joined by a veth pair; `lockstep run --nodes 2` in each."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

import dist_checks as checks
from lockstep import DistEnv, Runtime

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(180)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def two_hosts():
    """Namespaces A (10.213.7.1) and B (10.213.7.2), removed afterwards."""
    tag = uuid.uuid4().hex[:6]
    names = [f"ls{tag}a", f"ls{tag}b"]
    links = [f"v{tag}a", f"v{tag}b"]
    try:
        _ip("netns", "add", names[0])
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"cannot create network namespaces here (needs root and iproute2): {error}")
    try:
        _ip("netns", "add", names[1])
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for name, link, address in zip(names, links, ["10.213.7.1/24", "10.213.7.2/24"], strict=True):
            _ip("link", "set", link, "netns", name)
            _ip("-n", name, "addr", "add", address, "dev", link)
            _ip("-n", name, "link", "set", link, "up")
            _ip("-n", name, "link", "set", "lo", "up")
        yield list(zip(names, links, ["10.213.7.1", "10.213.7.2"], strict=True))
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)


def _start_nodes(two_hosts, port: int, script: str, *args: str) -> list[subprocess.Popen]:
    """`lockstep run --nodes 2` in each namespace, node 0's address as the master."""
    master = f"{two_hosts[0][2]}:{port}"
    jobs = []
    for node_rank, (namespace, link, _address) in enumerate(two_hosts):
        env = {**os.environ, "GLOO_SOCKET_IFNAME": link, "PYTHONUNBUFFERED": "1"}
        command = ["ip", "netns", "exec", namespace, sys.executable, "-m", "lockstep.cli.main", "run",
                   "--nodes", "2", "--node-rank", str(node_rank), "--master", master, "--devices", "2",
                   "--accelerator", "cpu", script, *args]
        jobs.append(subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True))
    return jobs


def test_two_nodes_of_two_processes_all_reduce_and_train(two_hosts, tmp_path):
    jobs = _start_nodes(two_hosts, 29517, "tests/scripts/two_nodes.py", str(tmp_path))
    outputs = []
    try:
        for job in jobs:
            outputs.append(job.communicate(timeout=150)[0])
    finally:
        for job in jobs:
            job.kill()
    assert [job.returncode for job in jobs] == [0, 0], "\n".join(outputs)
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    expected_ranks = [(0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    reference = checks.train_lockstep(Runtime(accelerator="cpu", seed=0, env=DistEnv()), checks.make_data(103),
                                      16, epochs=2, shuffle=True)
    for result in results:
        assert (result["world_size"], result["num_nodes"]) == (4, 2)
        assert result["ranks"] == expected_ranks
        assert result["total"] == 10.0
        assert torch.allclose(result["weights"], reference, atol=1e-5, rtol=0)


def test_sigkill_of_a_worker_on_node_1_stops_both_nodes_within_10_seconds(two_hosts, tmp_path):
    jobs = _start_nodes(two_hosts, 29518, "tests/scripts/spin.py", str(tmp_path))
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.pid"))) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = {int(p.stem): int(p.read_text()) for p in tmp_path.glob("*.pid")}
        assert sorted(pids) == [0, 1, 2, 3]
        killed_at = time.monotonic()
        os.kill(pids[3], signal.SIGKILL)  # local rank 1 of node 1
        outputs = [job.communicate(timeout=30)[0] for job in jobs]
        elapsed = time.monotonic() - killed_at
    finally:
        for job in jobs:
            job.kill()
    assert elapsed < 10, outputs
    assert all(job.returncode != 0 for job in jobs), outputs
    assert "rank 3 (local rank 1)" in outputs[1] and "signal SIGKILL" in outputs[1]
    assert "a worker on another node failed first" in outputs[0], outputs[0]
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
