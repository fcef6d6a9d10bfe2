"""Two hosts as network namespaces joined by a veth pair; `lockstep run --nodes 2` in each."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

import lockstep
from checks import dist as checks
from checks import trainer as tc
from checks.fault_tolerance import check_exact, listening
from lockstep import DistEnv, Runtime

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(180)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def two_hosts():
    """Namespaces A (10.213.7.1) and B (10.213.7.2), removed afterwards.

    In both, this host's name resolves to 127.0.1.1, as Debian and Ubuntu write /etc/hosts (``ip
    netns exec`` mounts /etc/netns/NAME/hosts over /etc/hosts): Gloo's default interface is then
    loopback, and only the launcher's choice of interface lets the nodes connect.
    """
    tag = uuid.uuid4().hex[:6]
    names = [f"ls{tag}a", f"ls{tag}b"]
    links = [f"v{tag}a", f"v{tag}b"]
    try:
        _ip("netns", "add", names[0])
    except (OSError, subprocess.CalledProcessError) as error:
        pytest.skip(f"cannot create network namespaces here (needs root and iproute2): {error}")
    try:
        for name in names:
            folder = Path("/etc/netns") / name
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 {socket.gethostname()}\n")
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
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)


def _start_nodes(two_hosts, port: int, script: str, *args: str, **variables: str) -> list[subprocess.Popen]:
    """`lockstep run --nodes 2` in each namespace, node 0's address as the master; no interface is set."""
    master = f"{two_hosts[0][2]}:{port}"
    jobs = []
    for node_rank, (namespace, _link, _address) in enumerate(two_hosts):
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **variables}
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            env.pop(name, None)
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
    for (_namespace, link, address), output in zip(two_hosts, outputs, strict=True):
        assert f"network interface {link} ({address}) reaches {two_hosts[0][2]}" in output, output
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
    assert ("a worker on another node failed first" in outputs[0]
            or "stopped its workers: node 1 (" in outputs[0] and "rank 3 (local rank 1)" in outputs[0]), outputs[0]
    for pid in pids.values():
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


# Each run: (stage, failing node, what the failing node's output says).
FAILURES = [("import", 1, "node fails before creating the Runtime"), ("init", 1, "Gloo connectFullMesh failed"),
            ("collective", 1, "node fails before the first collective"), ("training", 1, "at training step 5"),
            ("import", 0, "node fails before creating the Runtime"), ("init", 0, "Gloo connectFullMesh failed"),
            ("collective", 0, "node fails before the first collective"), ("training", 0, "at training step 5")]


@pytest.mark.timeout(600)
def test_a_node_that_fails_at_any_stage_stops_every_node_within_the_timeout(two_hosts):
    """The job's timeout is 20 s: every node must exit non-zero within 35 s, naming the cause."""
    for run, (stage, failing, cause) in enumerate(FAILURES):
        started = time.monotonic()
        jobs = _start_nodes(two_hosts, 29530 + run, "tests/scripts/fail_at.py", stage, str(failing),
                            LOCKSTEP_TIMEOUT="20")
        try:
            outputs = [job.communicate(timeout=35 + started - time.monotonic())[0] for job in jobs]
        finally:
            for job in jobs:
                job.kill()
        took = time.monotonic() - started
        print(f"run {run}: {stage} fails on node {failing}; both nodes exited after {took:.1f}s")
        context = f"run {run} ({stage} on node {failing}), {took:.1f}s:\n" + "\n".join(outputs)
        assert all(job.returncode != 0 for job in jobs), context
        other = outputs[1 - failing]
        assert cause in outputs[failing], context
        # The other node names the failing node and rank (with "init" both nodes fail alike, either may
        # be first), and the error once lockstep recorded it: a script that fails before creating its
        # Runtime leaves its traceback in its own node's output only.
        assert stage == "init" or f"node {failing} (" in other and "failed with exit code 1" in other, context
        assert stage == "import" or cause in other, context
        for namespace, _link, _address in two_hosts:
            left = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=10)
            assert left.stdout.split() == [], f"processes left in {namespace}: {left.stdout}\n{context}"


def test_a_node_with_no_route_to_the_master_is_refused_before_the_rendezvous_naming_its_interfaces(two_hosts):
    """Node B has no route to 10.99.0.1: the launcher and an srun-style Runtime both refuse at once."""
    namespace = two_hosts[1][0]
    launcher = subprocess.run(
        ["ip", "netns", "exec", namespace, sys.executable, "-m", "lockstep.cli.main", "run", "--nodes", "2",
         "--node-rank", "1", "--master", "10.99.0.1:29500", "--devices", "1", "--accelerator", "cpu",
         "tests/scripts/spin.py", "/nonexistent"],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert launcher.returncode == 2, launcher.stderr
    assert "no network interface of this node reaches 10.99.0.1" in launcher.stderr
    assert f"interfaces seen: lo (127.0.0.1), {two_hosts[1][1]} ({two_hosts[1][2]})" in launcher.stderr
    runtime = subprocess.run(
        ["ip", "netns", "exec", namespace, sys.executable, "-c",
         "from lockstep import DistEnv\nfrom lockstep.runtime.comm.process_group import choose_socket_interface\n"
         "choose_socket_interface(DistEnv(rank=2, world_size=4, local_world_size=2, node_rank=1, num_nodes=2,"
         " master_addr='10.99.0.1', master_port=29500, launcher='slurm'))"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
        env={k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")})
    assert runtime.returncode == 1
    assert "rank 2: no network interface of this node reaches 10.99.0.1" in runtime.stderr, runtime.stderr
    assert "Set GLOO_SOCKET_IFNAME" in runtime.stderr


def _elastic_node(two_hosts, node: int, port: int, folder: Path, hold_at: int = 0) -> subprocess.Popen:
    """`lockstep run --nodes 1:2` on host ``node``; the rendezvous is on host 0. ``hold_at``: a run on 2
    processes waits at that step for a node to join (tests/scripts/elastic_train.py)."""
    namespace = two_hosts[node][0]
    env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
    env["ELASTIC_HOLD_AT"] = str(hold_at)
    command = ["ip", "netns", "exec", namespace, sys.executable, "-m", "lockstep.cli.main", "run",
               "--nodes", "1:2", "--master", f"{two_hosts[0][2]}:{port}", "--devices", "2", "--accelerator", "cpu",
               "--rdzv-conf", "last_call_timeout=3", "tests/scripts/elastic_train.py", str(folder / "ckpt"),
               str(folder / "out.pt"), str(folder / "progress")]
    return subprocess.Popen(command, cwd=ROOT, env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _wait_for_step(folder: Path, step: int, world_size: int, jobs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and all(job.poll() is None for job in jobs):
        lines = (folder / "progress").read_text().splitlines() if (folder / "progress").exists() else []
        if any(line.split()[:2] == [str(step), str(world_size)] for line in lines):
            return
        time.sleep(0.1)
    raise AssertionError(f"step {step} on {world_size} processes not reached:\n"
                         + "\n".join(job.communicate(timeout=30)[0] if job.poll() is not None else "running"
                                     for job in jobs))


def _finish(jobs: list[subprocess.Popen], timeout: float) -> list[str]:
    try:
        return [job.communicate(timeout=timeout)[0] for job in jobs]
    finally:
        for job in jobs:
            job.kill()


def _assert_exact_run(folder: Path, world_sizes: list[int], final_world_size: int) -> None:
    """The run went through ``world_sizes``, took all 21 steps, and ends at the single-process weights."""
    from checks import trainer as tc

    sizes = [int(line.split()[1]) for line in (folder / "progress").read_text().splitlines()]
    assert [size for i, size in enumerate(sizes) if i == 0 or sizes[i - 1] != size] == world_sizes
    result = torch.load(folder / "out.pt")
    assert (result["steps"], result["world_size"]) == (21, final_world_size)
    difference = (result["weights"] - tc.fit_weights(epochs=3)).abs().max().item()
    print(f"largest weight difference from the uninterrupted single-process run: {difference:.2e}")
    assert difference <= 1e-5


@pytest.mark.timeout(150)
def test_elastic_job_loses_a_node_goes_on_with_the_other_and_ends_at_the_uninterrupted_weights(two_hosts, tmp_path):
    started = time.monotonic()
    jobs = [_elastic_node(two_hosts, node, 29560, tmp_path) for node in (0, 1)]
    try:
        _wait_for_step(tmp_path, 8, 4, jobs)  # checkpoints at steps 3 and 6; step 8 is mid-epoch
        pids = subprocess.run(["ip", "netns", "pids", two_hosts[1][0]], capture_output=True, text=True,
                              timeout=10).stdout.split()
        for pid in pids:  # the whole node: its launcher and its workers
            os.kill(int(pid), signal.SIGKILL)
        killed_at = time.monotonic()
        survivor = _finish(jobs[:1], 90)[0]
    finally:
        _finish(jobs, 1)
    print(f"node 1 killed {killed_at - started:.1f}s after the start; node 0 finished "
          f"{time.monotonic() - killed_at:.1f}s later")
    assert jobs[0].returncode == 0, survivor
    assert f"the job re-formed: node {socket.gethostname()} ({two_hosts[1][2]}) left; world size 4 -> 2" in survivor
    assert "resumed from" in survivor and "after step 6." in survivor, survivor
    _assert_exact_run(tmp_path, [4, 2], 2)


@pytest.mark.timeout(150)
def test_elastic_job_admits_a_node_that_starts_later_and_ends_at_the_uninterrupted_weights(two_hosts, tmp_path):
    jobs = [_elastic_node(two_hosts, 0, 29561, tmp_path, hold_at=7)]
    try:
        _wait_for_step(tmp_path, 4, 2, jobs)
        jobs.append(_elastic_node(two_hosts, 1, 29561, tmp_path))
        outputs = _finish(jobs, 100)
    finally:
        _finish(jobs, 1)
    assert [job.returncode for job in jobs] == [0, 0], "\n".join(outputs)
    assert f"the job re-formed: node {socket.gethostname()} ({two_hosts[1][2]}) joined; world size 2 -> 4" in outputs[0]
    assert "resumed from" in outputs[0], outputs[0]
    _assert_exact_run(tmp_path, [2, 4], 4)


def test_a_node_cut_off_by_its_link_is_noticed_by_heartbeat_well_before_the_collective_timeout(two_hosts, tmp_path):
    """No connection closes when a link goes down: only the heartbeats see it. The collectives' timeout
    is 60 s; node 0 stops within the 10 s heartbeat window plus the agent's shutdown, and node 1, which
    lost the store, within its window plus the 10 s grace of a shutdown that cannot reach the store."""
    jobs = _start_nodes(two_hosts, 29519, "tests/scripts/spin.py", str(tmp_path))
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.pid"))) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(list(tmp_path.glob("*.pid"))) == 4
        _ip("-n", two_hosts[1][0], "link", "set", two_hosts[1][1], "down")
        cut_at = time.monotonic()
        outputs, took = [], []
        for job in jobs:
            outputs.append(job.communicate(timeout=45)[0])
            took.append(time.monotonic() - cut_at)
    finally:
        _finish(jobs, 1)
    print(f"link down; node 0 exited after {took[0]:.1f}s, node 1 after {took[1]:.1f}s")
    assert all(job.returncode != 0 for job in jobs), outputs
    assert took[0] < 20, outputs[0]
    assert "stopped its workers: node 1 (" in outputs[0] and "sent no heartbeat for" in outputs[0], outputs[0]
    assert "lost the connection to the rendezvous store" in outputs[1], outputs[1]
    for namespace, _link, _address in two_hosts:
        left = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=10)
        assert left.stdout.split() == [], f"processes left in {namespace}"


FORGE = """
import sys
from datetime import timedelta
import torch.distributed as dist
store = dist.TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False, timeout=timedelta(seconds=10))
store.set("lockstep/nodes/failed", "node 1 (forged): rank 3 failed with exit code 1")
print("forged", flush=True)
"""


def test_a_forged_node_failure_in_the_store_does_not_stop_a_two_node_job(two_hosts, tmp_path):
    """Another program that reaches the rendezvous port writes the failure notice: without the job's
    secret it carries no valid signature, and both nodes train on to the end."""
    port = 29519
    jobs = _start_nodes(two_hosts, port, "tests/scripts/spin.py", str(tmp_path), LOCKSTEP_JOB_SECRET="s3cret",
                        SPIN_SECONDS="12")
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.pid"))) < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(list(tmp_path.glob("*.pid"))) == 4
        forger = subprocess.run(["ip", "netns", "exec", two_hosts[1][0], sys.executable, "-c", FORGE,
                                 two_hosts[0][2], str(port)], capture_output=True, text=True, timeout=30)
        assert forger.stdout.strip() == "forged", forger.stderr
        outputs = [job.communicate(timeout=60)[0] for job in jobs]
    finally:
        for job in jobs:
            job.kill()
    assert [job.returncode for job in jobs] == [0, 0], "\n".join(outputs)
    assert any("ignored a message in the rendezvous store" in output for output in outputs), outputs


def _fault_tolerant_node(two_hosts, node_rank: int, port: int, out: Path, name: str,
                         processes: int) -> subprocess.Popen:
    """`lockstep run --fault-tolerant` on one of the two hosts: one replica group (group ``node_rank``) of
    ``processes`` processes (FSDP when several), node 0 hosting the lighthouse at its address; no
    interface is set."""
    namespace = two_hosts[node_rank][0]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.pop(variable, None)
    command = ["ip", "netns", "exec", namespace, sys.executable, "-m", "lockstep.cli.main", "run", "--fault-tolerant",
               "--nodes", "2", "--node-rank", str(node_rank), "--master", f"{two_hosts[0][2]}:{port}",
               "--replicas", "1", "--devices", str(processes), "--accelerator", "cpu", "--step-timeout", "10",
               *(["--strategy", "fsdp"] if processes > 1 else []), str(ROOT / "tests" / "scripts" / "ft_replica.py"),
               str(out / f"{name}r{{rank}}.pt"), "--log", str(out / f"{name}r{{rank}}.log"), "--slow", "0.4",
               "--marks", str(out / "marks"), "--hold-at", "8", "--hold-for", "3"]  # waits for node 1 started again
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


@pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="torchft is not installed (the ft extra)")
@pytest.mark.alone
@pytest.mark.parametrize("processes", [1, 2])
def test_fault_tolerant_groups_on_two_nodes_train_on_when_a_whole_node_dies_and_it_rejoins(two_hosts, tmp_path,
                                                                                          processes):
    """A replica group on each of two hosts (one process, or two with FSDP inside), node 0 hosting the
    lighthouse: every process of node 1 is
    SIGKILLed mid-run (the node is lost); node 0's group trains on alone on the whole global batch; node 1
    started again joins by healing from node 0 over the network; both end at the one-process weights,
    every committed step's samples are the one-process run's."""
    reference_out = tmp_path / "reference.pt"
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "scripts" / "ft_replica.py"), str(reference_out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    reference = torch.load(reference_out)
    port = 29521 + processes
    nodes = [_fault_tolerant_node(two_hosts, 0, port, tmp_path, "g0", processes),
             _fault_tolerant_node(two_hosts, 1, port, tmp_path, "lost1", processes)]
    again = None
    try:
        deadline = time.monotonic() + 90
        log = tmp_path / "lost1r0.log"
        while time.monotonic() < deadline and (not log.exists() or log.read_text().count('"committed": true') < 3):
            time.sleep(0.1)
        assert log.exists() and log.read_text().count('"committed": true') >= 3, "node 1 never trained"
        for namespace, _, address in two_hosts:  # each node's sockets: on its address towards node 0, or loopback
            node_pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True,
                                       timeout=10).stdout.split()
            sockets = listening([int(pid) for pid in node_pids])
            assert sockets and all(host in (address, "127.0.0.1") for _, host, _ in sockets), (namespace, sockets)
        pids = subprocess.run(["ip", "netns", "pids", two_hosts[1][0]], capture_output=True, text=True,
                              timeout=10).stdout.split()
        for pid in pids:  # the whole node: its launcher, the group's agent, the worker
            os.kill(int(pid), signal.SIGKILL)
        nodes[1].communicate(timeout=30)
        again = _fault_tolerant_node(two_hosts, 1, port, tmp_path, "again1", processes)
        outputs = [nodes[0].communicate(timeout=150)[0], again.communicate(timeout=150)[0]]
    finally:
        for job in [*nodes, *([again] if again is not None else [])]:
            job.kill()
    assert [nodes[0].returncode, again.returncode] == [0, 0], "\n".join(outputs)
    check_exact(tmp_path, reference, [f"{name}r{rank}" for name in ("g0", "again1") for rank in range(processes)])
    assert "left [1]" in outputs[0] and "joined [1]" in outputs[0], outputs[0]
    assert "group 1 healed from group 0" in outputs[1], outputs[1]
    assert "starting a replacement" not in outputs[0], outputs[0]  # node 0's group never died
    assert subprocess.run(["ip", "netns", "pids", two_hosts[1][0]], capture_output=True, text=True,
                          timeout=10).stdout.split() == []
    print([line for line in outputs[0].splitlines() if "fault tolerance" in line])


def _kubeflow_pod(two_hosts, node_rank: int, *args: str) -> subprocess.Popen:
    """`lockstep run SCRIPT ...` with no option, as a Kubeflow TrainJob's entrypoint: the pod of node
    ``node_rank`` gets what Kubeflow Trainer's torch runtime injects (PET_*), node 0's address by its
    headless-service name, and the variable every Kubernetes pod has."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PET_NNODES": "2", "PET_NPROC_PER_NODE": "2",
           "PET_NODE_RANK": str(node_rank), "PET_MASTER_ADDR": KUBEFLOW_MASTER, "PET_MASTER_PORT": "29530",
           "KUBERNETES_SERVICE_HOST": "10.96.0.1", "TRAINER_DROPOUT": "0"}
    for variable in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.pop(variable, None)
    command = ["ip", "netns", "exec", two_hosts[node_rank][0], sys.executable, "-m", "lockstep.cli.main", "run",
               *args]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _outputs(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Each process's output once all have ended; past ``timeout`` every one is killed and the test fails
    with all their outputs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.2)
    late = [p for p in procs if p.poll() is None]
    for p in late:
        p.kill()
    outputs = [p.communicate(timeout=30)[0] for p in procs]
    assert not late, f"not ended in {timeout} s:\n" + "\n----\n".join(o[-4000:] for o in outputs)
    return outputs


KUBEFLOW_JOB = "lsjob"
KUBEFLOW_MASTER = f"{KUBEFLOW_JOB}-node-0-0.{KUBEFLOW_JOB}"  # <job>-node-0-0.<job>, as Kubeflow Trainer names it


def _kubeflow_hosts(two_hosts) -> None:
    """Node 0's headless-service name in each pod's hosts file, as Kubernetes' DNS would answer it."""
    for namespace, _link, _address in two_hosts:
        hosts = Path("/etc/netns") / namespace / "hosts"
        if KUBEFLOW_MASTER not in hosts.read_text():
            hosts.write_text(hosts.read_text() + f"{two_hosts[0][2]} {KUBEFLOW_MASTER}\n")


def test_a_kubeflow_trainjob_names_the_rank_on_the_other_pod_that_is_slow_in_its_data(two_hosts):
    """The straggler report on Kubernetes' route: 2 pods of 2 processes, rank 2 (pod 1's first) sleeps in
    __getitem__; rank 0, on pod 0, names it and pod 0's `lockstep run` ends with it."""
    _kubeflow_hosts(two_hosts)
    pods = [_kubeflow_pod(two_hosts, rank, "tests/scripts/stragglers.py", "data", "16") for rank in range(2)]
    outputs = _outputs(pods, 120)
    assert [p.returncode for p in pods] == [0, 0], "\n----\n".join(o[-4000:] for o in outputs)
    named = r"rank 2 \(host \S+, local rank 0\) is a straggler: .*for each batch"
    assert re.search("lockstep: " + named, outputs[0]), outputs[0][-4000:]
    assert re.search("lockstep run: straggler summary: " + named, outputs[0]), outputs[0][-4000:]


@pytest.mark.parametrize("lost", ["evicted", "killed"])
def test_a_kubeflow_trainjob_pod_lost_then_every_pod_restarted_resumes_exactly(two_hosts, tmp_path, lost):
    """Two pods (network namespaces) with Kubeflow Trainer's PET_* variables and the headless-service name
    of node 0 in their hosts file run `lockstep run trainer_preempt.py` with no option.

    - evicted: TERM to pod 1's launcher (the container's first process) after step 5: every rank stops
      at the same step, the preempted checkpoint is written, and both pods end with 143 (pod 0, whose
      workers stopped themselves, as pod 1, which got the TERM), as a JobSet keyed on the code needs;
    - killed: every process of pod 1 SIGKILLed after the first epoch's checkpoint: pod 0 ends too.

    Started again (JobSet's restart-all), the job resumes from the newest checkpoint and ends at the
    one-process fit's weights."""
    _kubeflow_hosts(two_hosts)
    script = "tests/scripts/trainer_preempt.py"
    ckpt, out, marker = tmp_path / "ckpt", tmp_path / "out.pt", tmp_path / "marker"
    pods = [_kubeflow_pod(two_hosts, rank, script, str(ckpt), str(out), str(marker)) for rank in range(2)]
    again: list[subprocess.Popen] = []
    try:
        deadline = time.monotonic() + 120
        ready = (lambda: marker.exists()) if lost == "evicted" else (lambda: bool(list(ckpt.glob("epoch=1-*"))))
        while not ready() and time.monotonic() < deadline and all(p.poll() is None for p in pods):
            time.sleep(0.1)
        assert ready(), "\n".join(p.communicate(timeout=30)[0] for p in pods)
        signalled = time.monotonic()
        if lost == "evicted":
            pods[1].send_signal(signal.SIGTERM)  # the eviction: TERM to the container's first process
        else:
            pids = subprocess.run(["ip", "netns", "pids", two_hosts[1][0]], capture_output=True, text=True,
                                  timeout=10).stdout.split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        first = [p.communicate(timeout=90)[0] for p in pods]
        print(f"{lost}: both pods ended {time.monotonic() - signalled:.1f} s after pod 1 was {lost}")
        newest = sorted(ckpt.glob("*-preempted.ckpt" if lost == "evicted" else "epoch=*"))
        again = [_kubeflow_pod(two_hosts, rank, script, str(ckpt), str(out), str(marker)) for rank in range(2)]
        second = _outputs(again, 150)
    finally:
        for job in [*pods, *again]:
            job.kill()
    assert all(p.returncode != 0 for p in pods), first
    assert "from Kubeflow Trainer's PET_* variables: --nodes 2 --node-rank 0 --devices 2 --master" in first[0], first
    if lost == "evicted":
        assert "preempted at step" in first[0] and "so that Kubernetes starts it again" in first[0], first[0]
        assert "lockstep run: stopped by SIGTERM" in first[1] and "Traceback" not in first[1], first[1]
        assert [p.returncode for p in pods] == [143, 143], first
        assert "the workers stopped for a preemption after its checkpoint; exiting with 143" in first[0], first[0]
        assert len(newest) == 1, newest
    assert [p.returncode for p in again] == [0, 0], "\n".join(second)
    assert f"resumed from {newest[-1]}" in second[0], second[0]
    module = tc.Classifier(dropout=0.0)
    tc.quiet_trainer(max_epochs=3, strategy=lockstep.DDP(find_unused_parameters=True)).fit(
        module, checks.make_data(103), batch_size=16)
    result = torch.load(out)
    assert result["steps"] == 21
    assert torch.allclose(result["weights"], checks.flat_weights(module), atol=1e-5, rtol=0)
