"""lockstep on a real Ray cluster of two nodes on this machine (a head on 127.0.0.2 and a node on
127.0.0.3, each in a session of its own, token-authenticated), through `lockstep run --engine ray`:
the runtime API and the Trainer end at the one-process weights, Ray's Result.checkpoint is a lockstep
checkpoint, a run resumes from Ray's copy, and an elastic job that loses a node and gets it back
re-forms twice and still ends at the one-process weights. Every process of both nodes is stopped by
its session id afterwards, and none may remain."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import lockstep
from checks import dist as checks
from checks import trainer as tc

ROOT = Path(__file__).resolve().parents[2]
HEAD, NODE = "127.0.0.2", "127.0.0.3"
RAY = Path(sys.executable).with_name("ray")

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                 reason="ray is not installed (the ray extra)"),
              pytest.mark.skipif(not RAY.exists(), reason="the ray command is not next to this Python")]


def _session(sid: int) -> list[int]:
    """The live (not zombie) processes of session ``sid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                found.append(int(stat.parent.name))
    return found


def _signal_session(sid: int, sig: int) -> None:
    for pid in _session(sid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


class RayCluster:
    """A head and a worker node (``cpus``: how many workers each takes); ``kill_node`` SIGKILLs every
    process of the worker node (its raylet and its workers, which keep the node's session),
    ``start_node`` starts it again."""

    def __init__(self, folder: Path, cpus: tuple[int, int]) -> None:
        self.folder, self.cpus = folder, cpus
        self.temp = Path(tempfile.mkdtemp(prefix="lsray", dir="/tmp"))  # short: Ray's sockets live under it
        token = folder / "token"
        token.write_text(secrets.token_hex(32))
        # A lost node is noticed after 5 missed health checks 1 s apart (Ray's default: 3 s apart).
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token),
                    "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1", "RAY_health_check_period_ms": "1000",
                    "RAY_health_check_failure_threshold": "5"}
        self.port = 6400 + os.getpid() % 500
        self.address = f"{HEAD}:{self.port}"
        self.nodes: list[subprocess.Popen] = []
        self.head = self._start(["--head", f"--node-ip-address={HEAD}", f"--port={self.port}",
                                 "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={self.temp}",
                                 f"--num-cpus={cpus[0]}"], "head")
        self.node = self.start_node()

    def _start(self, options: list[str], name: str) -> subprocess.Popen:
        log = self.folder / f"{name}-{len(self.nodes)}.log"
        job = subprocess.Popen([str(RAY), "start", *options, "--block"], env=self.env,
                               stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
        self.nodes.append(job)
        deadline = time.monotonic() + 60
        while "Ray runtime started" not in log.read_text():
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        return job

    def start_node(self) -> subprocess.Popen:
        self.node = self._start([f"--address={self.address}", f"--node-ip-address={NODE}",
                                 f"--num-cpus={self.cpus[1]}"], "node")
        return self.node

    def node_id(self) -> str:
        """The Ray node id of the worker node."""
        code = (f"import ray; ray.init(address={self.address!r}, logging_level='ERROR'); "
                f"print([n['NodeID'] for n in ray.nodes() if n['Alive'] and n['NodeManagerAddress'] == {NODE!r}][0])")
        done = subprocess.run([sys.executable, "-c", code], env=self.env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()[-1]

    def drain_node(self, deadline_s: int) -> None:
        """What a cloud does before it reclaims a spot instance: the node is drained for preemption."""
        done = subprocess.run([str(RAY), "drain-node", f"--address={self.address}", f"--node-id={self.node_id()}",
                               "--reason=DRAIN_NODE_REASON_PREEMPTION", "--reason-message=spot instance reclaimed",
                               f"--deadline-remaining-seconds={deadline_s}"],
                              env=self.env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr

    def kill_node(self) -> None:
        _signal_session(self.node.pid, signal.SIGKILL)
        self.node.wait(timeout=30)

    def stop(self) -> list[str]:
        """Stop both nodes (the worker node first: its drain talks to the head); what remains, if any."""
        for job in reversed(self.nodes):
            _signal_session(job.pid, signal.SIGTERM)
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline and any(_session(job.pid) for job in self.nodes):
            time.sleep(0.2)
        for job in self.nodes:  # `ray start --block` may wait on a head that is already gone
            _signal_session(job.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                job.wait(timeout=10)
        time.sleep(0.5)
        left = [f"{pid}: {Path(f'/proc/{pid}/cmdline').read_bytes()[:120]!r}"
                for job in self.nodes for pid in _session(job.pid) if Path(f"/proc/{pid}").exists()]
        shutil.rmtree(self.temp, ignore_errors=True)
        return left

    def run(self, *args: str, timeout: float, **variables: str) -> subprocess.Popen:
        """`lockstep run --engine ray ARGS` against this cluster, from this machine."""
        command = [sys.executable, "-m", "lockstep.cli.main", "run", "--engine", "ray", "--accelerator", "cpu", *args]
        return subprocess.Popen(command, cwd=ROOT, env={**self.env, "RAY_ADDRESS": self.address, **variables},
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture
def ray_cluster(request, tmp_path) -> Iterator[RayCluster]:
    """The CPUs of the head and of the node: (2, 2) unless the test is parametrized with others."""
    cluster = RayCluster(tmp_path, getattr(request, "param", (2, 2)))
    try:
        yield cluster
    finally:
        left = cluster.stop()
    assert left == [], f"processes of the Ray nodes still running: {left}"


def _finish(job: subprocess.Popen, timeout: float) -> str:
    """The driver's output, without Ray's colours and its repeated worker lines."""
    try:
        output = job.communicate(timeout=timeout)[0]
    finally:
        job.kill()
        job.wait()
    lines = re.sub(r"\x1b\[[0-9;]*m", "", output).splitlines()
    return "\n".join(line for i, line in enumerate(lines) if line.strip() and line not in lines[max(0, i - 30):i])


def _one_process(epochs: int) -> torch.Tensor:
    return checks.train_lockstep(lockstep.Runtime(accelerator="cpu", seed=0), checks.make_data(103), 16,
                                 epochs=epochs, shuffle=True)


def _ray_checkpoint(output: str) -> str:
    found = re.search(r"Ray's newest checkpoint: (\S+)", output)
    assert found, output[-4000:]
    return found.group(1)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("ray_cluster", [(3, 1)], indirect=True)
def test_on_a_two_node_ray_cluster_the_runtime_api_matches_one_process_and_resumes_from_rays_copy(ray_cluster,
                                                                                                 tmp_path):
    """On a head of 3 CPUs and a node of 1, 4 workers are placed 3 and 1 (an uneven placement):
    - the caller's environment reaches the workers, less the variables of its own host;
    - the runtime API, its checkpoints reported to Ray; Ray's Result.checkpoint passes
      `lockstep checkpoint verify`;
    - the same run name again with an empty checkpoint folder and one epoch more: it resumes from Ray's
      copy in its storage and still ends at the one-process weights; without --name, a new run;
    - a Ray user's own TorchTrainer whose training function is a plain Runtime loop.
    The Trainer on Ray: the elastic test below."""
    storage = tmp_path / "store"
    job = ray_cluster.run("--devices", "4", "--storage", str(storage), "--name", "loop", "tests/scripts/ray_loop.py",
                          str(tmp_path / "ckpt"), str(tmp_path / "out.pt"), str(tmp_path / "progress"), timeout=150,
                          RUN_LABEL="caller-42", PATH=f"/caller/bin:{os.environ['PATH']}",
                          CALLER_PATH=f"/caller/bin:{os.environ['PATH']}")
    first = _finish(job, 150)
    assert job.returncode == 0, first[-6000:]
    assert "started on 4 processes on 2 node(s)" in first, first[-6000:]
    # the caller's variables reach the workers, but not those of its own host (its PATH)
    assert "the caller's RUN_LABEL: caller-42; PATH from the caller: False" in first, first[-6000:]
    result = torch.load(tmp_path / "out.pt")
    assert (result["steps"], result["world_size"]) == (14, 4)
    difference = (result["weights"] - _one_process(2)).abs().max().item()
    print(f"runtime API, 4 Ray workers on 2 nodes (3 + 1): largest difference from one process {difference:.2e}")
    assert difference <= 1e-5
    newest = _ray_checkpoint(first)
    assert Path(newest).parent == storage / "loop", newest
    verified = subprocess.run([sys.executable, "-m", "lockstep.cli.main", "checkpoint", "verify", newest],
                              capture_output=True, text=True, timeout=120)
    assert verified.returncode == 0 and "intact" in verified.stdout, verified.stdout + verified.stderr

    job = ray_cluster.run("--devices", "4", "--storage", str(storage), "--name", "loop", "tests/scripts/ray_loop.py",
                          str(tmp_path / "empty"), str(tmp_path / "out3.pt"), str(tmp_path / "progress3"), "3",
                          timeout=150)
    again = _finish(job, 150)
    assert job.returncode == 0, again[-6000:]
    assert f"resumed from {newest} at step 12 on 4 processes" in again, again[-6000:]
    result = torch.load(tmp_path / "out3.pt")
    difference = (result["weights"] - _one_process(3)).abs().max().item()
    print(f"resumed from Ray's copy on 4 workers: largest difference from one process {difference:.2e}")
    assert result["steps"] == 21 and difference <= 1e-5
    # without --name: a new run, which resumes nothing (before, the default name was the script's, so any later run
    # of the script continued the last one, with its own settings and a fresh checkpoint folder alike)
    job = ray_cluster.run("--devices", "4", "--storage", str(storage), "tests/scripts/ray_loop.py",
                          str(tmp_path / "fresh"), str(tmp_path / "out4.pt"), str(tmp_path / "progress4"), timeout=150)
    fresh = _finish(job, 150)
    assert job.returncode == 0 and "resumed from" not in fresh, fresh[-6000:]
    assert re.search(r"run 'ray_loop-\d{8}-\d{6}' \(a new run; after a failure of this command, --name", fresh)
    assert torch.load(tmp_path / "out4.pt")["steps"] == 14

    own = subprocess.run([sys.executable, "tests/scripts/ray_own_trainer.py", str(tmp_path / "own.pt"), "4",
                          str(storage)], cwd=ROOT, env={**ray_cluster.env, "RAY_ADDRESS": ray_cluster.address},
                         capture_output=True, text=True, timeout=150)
    assert own.returncode == 0, own.stdout[-3000:] + own.stderr[-3000:]
    result = torch.load(tmp_path / "own.pt")
    difference = (result["weights"] - _one_process(2)).abs().max().item()
    print(f"a plain Runtime loop in one's own TorchTrainer: largest difference from one process {difference:.2e}")
    assert (result["launcher"], result["world_size"], result["num_nodes"]) == ("ray", 4, 2) and difference <= 1e-5



@pytest.mark.timeout(300)
def test_on_ray_rank_0_names_a_rank_slow_in_its_data(ray_cluster):
    """The straggler report on Ray's route: 3 workers on 2 nodes, rank 2's __getitem__ sleeps."""
    job = ray_cluster.run("--devices", "3", "tests/scripts/stragglers.py", "data", "16", timeout=150)
    output = _finish(job, 150)
    assert job.returncode == 0, output[-6000:]
    assert re.search(r"lockstep: rank 2 \(host \S+, local rank \d\) is a straggler: .*for each batch", output), \
        output[-6000:]
    assert '"stragglers": {"2": "data"}' in output, output[-6000:]


def _progress(path: Path) -> list[tuple[int, int, float]]:
    if not path.exists():
        return []
    return [(int(s), int(w), float(t)) for s, w, t in (line.split() for line in path.read_text().splitlines())]


def _wait_until(condition, job: subprocess.Popen, what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if job.poll() is not None or time.monotonic() > deadline:
            output = _finish(job, 5)
            raise AssertionError(f"{what}: not reached\n{output[-6000:]}")
        time.sleep(0.2)


@pytest.mark.timeout(500)
def test_an_elastic_ray_trainer_job_loses_a_node_then_gets_it_back_and_ends_at_the_one_process_weights(
        ray_cluster, tmp_path):
    """`--nodes 1:2 --devices 2` (Ray's num_workers=(2, 4)): the worker node is killed mid-run (every
    process of it, SIGKILL), Ray re-forms the job on the head's 2 workers, lockstep resumes the
    4-process checkpoint on 2; the node is started again, Ray grows the job back to 4 workers, lockstep
    resumes on 4; the Trainer (resume="auto") ends at the one-process weights. Ray's worker-group start
    timeout is 10 s (its default, 60 s, is spent waiting for the lost node's workers) and the resize
    interval 5 s. (The runtime API's loop re-forms in the drain test below.)"""
    progress, epochs = tmp_path / "progress", 16
    job = ray_cluster.run("--devices", "2", "--nodes", "1:2", "--resize-interval", "5", "--storage",
                          str(tmp_path / "store"), "--name", "elastic_train", "tests/scripts/elastic_train.py",
                          str(tmp_path / "ckpt"),
                          str(tmp_path / "out.pt"), str(progress), str(epochs), timeout=400,
                          RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S="10")
    try:
        _wait_until(lambda: any(s >= 8 and w == 4 for s, w, _ in _progress(progress)), job, "step 8 on 4 workers", 150)
        ray_cluster.kill_node()
        killed = time.time()
        _wait_until(lambda: any(w == 2 for _, w, _ in _progress(progress)), job, "the job on 2 workers", 150)
        ray_cluster.start_node()
        restarted = time.time()
        _wait_until(lambda: _progress(progress)[-1][1] == 4, job, "the job on 4 workers again", 150)
        output = _finish(job, 300)
    finally:
        job.kill()
        job.wait()
    assert job.returncode == 0, output[-6000:]
    steps_seen = _progress(progress)
    sizes = [w for i, (_, w, _) in enumerate(steps_seen) if i == 0 or steps_seen[i - 1][1] != w]
    assert sizes == [4, 2, 4], sizes
    changes = [(steps_seen[i - 1][2], t, w) for i, (_, w, t) in enumerate(steps_seen)
               if i and steps_seen[i - 1][1] != w]
    print(f"4 -> 2 workers: {changes[0][1] - killed:.1f} s from the node's kill to the first step on 2 "
          f"({changes[0][1] - changes[0][0]:.1f} s without a step)")
    print(f"2 -> 4 workers: {changes[1][1] - restarted:.1f} s from the node's start to the first step on 4 "
          f"({changes[1][1] - changes[1][0]:.1f} s without a step)")
    assert output.count("resumed from") >= 2, output[-6000:]
    # the script keeps 2 checkpoints (save_top_k=2); Ray's storage holds the copies of those, across restarts
    kept = sorted(p.name for p in (tmp_path / "ckpt").rglob("*")
                  if (p / "lockstep.json").is_file() and not p.is_symlink())
    copies = sorted(p.name for p in (tmp_path / "store" / "elastic_train").iterdir() if (p / "lockstep.json").is_file())
    assert len(kept) == 2 and copies == kept, (kept, copies)
    result = torch.load(tmp_path / "out.pt")
    difference = (result["weights"] - tc.fit_weights(epochs=epochs)).abs().max().item()
    print(f"Trainer: largest difference from one process: {difference:.2e}")
    assert (result["steps"], result["world_size"]) == (7 * epochs, 4) and difference <= 1e-5


@pytest.mark.timeout(400)
def test_a_ray_node_drained_for_preemption_gets_a_checkpoint_at_once_and_the_restarted_job_resumes_exactly(
        ray_cluster, tmp_path):
    """An elastic job of 4 workers on 2 nodes; the worker node is drained for preemption with a 60 s deadline
    (a spot reclaim, as a cloud announces it): `rt.should_checkpoint()` turns Ray's notice into one
    checkpoint on every rank at the same step, and training goes on; then the node goes (SIGKILL of all its
    processes), Ray re-forms the job on the head's 2 workers, which resume from the newest checkpoint
    (the notice's or a later one) and end at the one-process weights."""
    progress, ckpt = tmp_path / "progress", tmp_path / "ckpt"
    job = ray_cluster.run("--devices", "2", "--nodes", "1:2", "--storage", str(tmp_path / "store"),
                          "tests/scripts/ray_loop.py", str(ckpt), str(tmp_path / "out.pt"), str(progress), "12",
                          timeout=300, RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S="10",
                          RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S="1")
    try:
        _wait_until(lambda: any(s >= 5 and w == 4 for s, w, _ in _progress(progress)), job, "step 5 on 4 workers", 150)
        ray_cluster.drain_node(deadline_s=60)
        drained = time.time()
        _wait_until(lambda: any((p / "lockstep.json").exists() for p in ckpt.glob("*-preempted")), job,
                    "the checkpoint of the notice", 60)
        saved = time.time()
        ray_cluster.kill_node()
        output = _finish(job, 250)
    finally:
        job.kill()
        job.wait()
    assert job.returncode == 0, output[-6000:]
    print(f"the notice's checkpoint was committed {saved - drained:.1f} s after the drain")
    noticed = [int(p.name.split("=")[1].split("-")[0]) for p in ckpt.glob("*-preempted")]
    # One checkpoint per notice, committed: every rank wrote its part at the same step. (The line rank 0
    # prints then is not looked for: rank 0 may sit on the drained node, whose log stream dies with it.)
    assert len(noticed) == 1, noticed
    steps = _progress(progress)
    assert [w for i, (_, w, _) in enumerate(steps) if i == 0 or steps[i - 1][1] != w] == [4, 2]
    resumed = re.search(r"resumed from \S+ at step (\d+) on 2 processes", output)
    assert resumed and int(resumed.group(1)) >= noticed[0], output[-6000:]
    result = torch.load(tmp_path / "out.pt")
    difference = (result["weights"] - _one_process(12)).abs().max().item()
    print(f"largest difference from one process: {difference:.2e}")
    assert (result["steps"], result["world_size"]) == (84, 2) and difference <= 1e-5
