"""SLURM on a real two-node cluster (one slurmctld and two slurmd on this host, tests/slurm/cluster.sh)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from checks import dist as checks
from lockstep import DistEnv, Runtime
from lockstep.env import expand_nodelist

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "tests" / "slurm" / "cluster.sh"
pytestmark = [pytest.mark.timeout(300), pytest.mark.alone]  # alone: the cluster listens on fixed ports


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    folder = tmp_path_factory.mktemp("slurm")
    started = subprocess.run(["bash", str(CLUSTER), "start", str(folder)], capture_output=True, text=True,
                             timeout=240)
    if started.returncode != 0:
        subprocess.run(["bash", str(CLUSTER), "stop", str(folder)], capture_output=True, timeout=60)
        pytest.skip(f"a local Slurm cluster cannot start here: {started.stderr.strip()[-300:]}")
    env = {**os.environ, "SLURM_CONF": str(folder / "slurm.conf")}
    yield env, folder
    subprocess.run(["bash", str(CLUSTER), "stop", str(folder)], capture_output=True, timeout=60)


def _submit(env, folder: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "lockstep.cli.main", "slurm", "--accelerator", "cpu", "--dir",
                           str(folder), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()[2]  # "submitted job N"


def _state(env, job: str) -> str:
    out = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True).stdout
    return next((w.split("=")[1] for w in out.split() if w.startswith("JobState=")), "GONE")


def _wait_until_done(env, job: str, limit: float, hurry_requeue: bool = False) -> None:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        state = _state(env, job)
        if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "GONE"):
            return
        if hurry_requeue and state == "PENDING":  # Slurm delays a requeued job; let it start now
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, capture_output=True)
        time.sleep(1)
    raise AssertionError(f"job {job} still {_state(env, job)} after {limit}s")


def _wait_for(marker: Path, limit: float = 120) -> None:
    end = time.monotonic() + limit
    while not marker.exists() and time.monotonic() < end:
        time.sleep(0.3)
    assert marker.exists(), "the job never reached step 5"


def _reference() -> torch.Tensor:
    return checks.train_lockstep(Runtime(accelerator="cpu", seed=0, env=DistEnv()), checks.make_data(103), 16, 2, True)


@pytest.mark.parametrize("nodelist", ["n[1-2]", "gpu[01-04,07],cpu3", "r[1-2]n[01-02]", "a[8-11],b", "n[009-011]"])
def test_nodelist_expansion_matches_scontrol(cluster, nodelist):
    env, _ = cluster
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], env=env, capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 0, out.stderr
    assert expand_nodelist(nodelist) == out.stdout.split()


def test_two_nodes_by_two_tasks_train_like_one_process(cluster, tmp_path):
    env, _ = cluster
    job = _submit(env, tmp_path, "--nodes", "2", "--devices", "2", "tests/scripts/train_tiny.py",
                  str(tmp_path / "r.pt"))
    _wait_until_done(env, job, 120)
    output = next(tmp_path.glob("*.out")).read_text()
    result = torch.load(tmp_path / "r.pt")
    assert result["world_size"] == 4, output
    assert torch.allclose(result["weights"], _reference(), atol=1e-5, rtol=0)
    script = (tmp_path / "train_tiny.sbatch").read_text()
    assert "#SBATCH --ntasks-per-node=2" in script and "#SBATCH --signal=B:USR1@90" in script


def test_a_rank_slow_in_its_data_is_named_under_srun(cluster, tmp_path):
    """The straggler report on SLURM's route, 2 nodes of 2 tasks: rank 0 names rank 2 (the second node's
    first task), whose __getitem__ sleeps."""
    env, _ = cluster
    job = _submit(env, tmp_path, "--nodes", "2", "--devices", "2", "tests/scripts/stragglers.py", "data", "16")
    _wait_until_done(env, job, 120)
    output = next(tmp_path.glob("*.out")).read_text()
    assert re.search(r"lockstep: rank 2 \(host \S+, local rank 0\) is a straggler: .*for each batch", output), output
    assert 'report {"step_time/max_over_median"' in output and '"stragglers": {"2": "data"}' in output, output


def _preempted_2x2_job(env, tmp_path: Path, script: str, state: str) -> tuple[str, str]:
    """Submit ``script STATE OUT MARKER`` on 2 x 2 tasks, USR1 it after step 5, wait through the requeue."""
    marker = tmp_path / "marker"
    job = _submit(env, tmp_path, "--requeue", "--nodes", "2", "--devices", "2", script, state, str(tmp_path / "out.pt"),
                  str(marker))
    _wait_for(marker)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, check=True, timeout=30)
    _wait_until_done(env, job, 240, hurry_requeue=True)
    return job, next(tmp_path.glob("*.out")).read_text()


def test_usr1_checkpoints_requeues_and_resumes_to_the_uninterrupted_result(cluster, tmp_path):
    env, _ = cluster
    _, output = _preempted_2x2_job(env, tmp_path, "tests/scripts/trainer_preempt.py", str(tmp_path / "ckpt"))
    assert "USR1 received" in output and "requeued" in output and "resumed from" in output, output
    resumed = torch.load(tmp_path / "out.pt")
    assert resumed["restarts"] == "1" and resumed["steps"] == 21
    # the same job, uninterrupted, on the same 2 x 2 layout
    reference = _submit(env, tmp_path / "whole", "--requeue", "--nodes", "2", "--devices", "2",
                        "tests/scripts/trainer_preempt.py",
                        str(tmp_path / "w"), str(tmp_path / "w.pt"), str(tmp_path / "w-marker"))
    _wait_until_done(env, reference, 120)
    whole = torch.load(tmp_path / "w.pt")
    assert whole["restarts"] == "0" and whole["steps"] == 21
    assert torch.equal(whole["weights"], resumed["weights"])  # bitwise: DDP keeps one bucket layout


def test_a_runtime_loop_checkpoints_on_usr1_requeues_and_resumes_to_the_reference(cluster, tmp_path):
    """rt.should_stop() / rt.requeue() in a user's own loop, as docs/slurm.md shows it."""
    env, _ = cluster
    job, output = _preempted_2x2_job(env, tmp_path, "tests/scripts/loop_preempt.py", str(tmp_path / "state.pt"))
    assert "preempted at step" in output and f"job {job} requeued" in output and "resumed from step" in output, output
    result = torch.load(tmp_path / "out.pt")
    assert result["restarts"] == "1" and result["steps"] == 14
    assert torch.allclose(result["weights"], _reference(), atol=1e-5, rtol=0)


@pytest.mark.parametrize(("script", "option", "said"), [
    ("tests/scripts/loop_preempt.py", None, "requeue on: tests/scripts/loop_preempt.py checkpoints on the signal "
                                            "(it uses should_stop)"),
    ("tests/scripts/train_tiny.py", None, "requeue off: tests/scripts/train_tiny.py does not checkpoint on the signal"),
    ("tests/scripts/train_tiny.py", "--requeue", "requeue on, as asked"),
    ("tests/scripts/loop_preempt.py", "--no-requeue", "requeue off, as asked"),
])
def test_lockstep_slurm_requeues_only_a_script_that_checkpoints_or_when_asked(script, option, said):
    done = subprocess.run([sys.executable, "-m", "lockstep.cli.main", "slurm", "--dry-run", "--accelerator", "cpu",
                           *([option] if option else []), script], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"lockstep slurm: {said}" in done.stderr
    requeue = said.startswith("requeue on")
    assert ("#SBATCH --requeue" in done.stdout) is requeue and ("#SBATCH --no-requeue" in done.stdout) is not requeue
    assert f"export LOCKSTEP_REQUEUE={int(requeue)}" in done.stdout


def test_tasks_per_node_disagreeing_with_devices_fails_fast_naming_the_sbatch_line(cluster, tmp_path):
    env, _ = cluster
    start = time.monotonic()
    job = _submit(env, tmp_path, "--nodes", "1", "--devices", "1", "tests/scripts/self_launch.py",
                  str(tmp_path / "x.pt"))
    _wait_until_done(env, job, 60)
    assert time.monotonic() - start < 15
    output = next(tmp_path.glob("*.out")).read_text()
    assert "this SLURM job runs 1 task(s) on this node: change `#SBATCH --ntasks-per-node=1` to " \
           "`#SBATCH --ntasks-per-node=2`" in output
    assert _state(env, job) in ("FAILED", "GONE")


@pytest.mark.parametrize("signal_name", ["USR1", "TERM"])
def test_without_requeue_a_signal_still_checkpoints_and_exits_cleanly(cluster, tmp_path, signal_name):
    env, _ = cluster
    marker = tmp_path / "marker"
    job = _submit(env, tmp_path, "--no-requeue", "--nodes", "2", "--devices", "2", "tests/scripts/trainer_preempt.py",
                  str(tmp_path / "ckpt"), str(tmp_path / "out.pt"), str(marker))
    _wait_for(marker)
    subprocess.run(["scancel", f"--signal={signal_name}", "--batch", job], env=env, check=True, timeout=30)
    _wait_until_done(env, job, 120)
    output = next(tmp_path.glob("*.out")).read_text()
    assert "preempted at step" in output and "not requeued" in output, output
    assert not (tmp_path / "out.pt").exists()  # training stopped early, on purpose
    saved = list((tmp_path / "ckpt").glob("*-preempted.ckpt"))
    assert len(saved) == 1
    from lockstep.runtime.checkpoint.format import read_metadata

    assert 6 <= read_metadata(saved[0])["step"] < 21


@pytest.mark.parametrize("mode", ["nopoll", "poll"])
def test_scancel_ends_a_loop_that_never_polls_within_the_grace_period_and_a_polling_one_checkpoints(
        cluster, tmp_path, mode):
    """scancel sends TERM, and SIGKILL only after KillWait (30 s here)."""
    env, _ = cluster
    submitted = subprocess.run(
        ["sbatch", "--parsable", "--nodes=1", "--ntasks=2", f"--output={tmp_path}/job.out",
         f"--wrap=srun {sys.executable} tests/scripts/loop_term.py {tmp_path} {mode}"],
        cwd=ROOT, env={**env, "LOCKSTEP_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}, capture_output=True,
        text=True, timeout=60)
    assert submitted.returncode == 0, submitted.stderr
    job = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("*.pid"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = [int(path.read_text()) for path in tmp_path.glob("*.pid")]
    assert len(pids) == 2, (tmp_path / "job.out").read_text()
    time.sleep(1.0)  # a few steps in
    subprocess.run(["scancel", job], env=env, check=True, timeout=30)
    cancelled = time.monotonic()
    while any(checks.pid_alive(pid) for pid in pids) and time.monotonic() - cancelled < 40:
        time.sleep(0.1)
    took = time.monotonic() - cancelled
    _wait_until_done(env, job, 60)
    output = (tmp_path / "job.out").read_text()
    print(f"{mode}: the tasks ended {took:.1f}s after scancel")
    if mode == "nopoll":
        assert took < 12, output  # the 5 s grace, then TERM as without lockstep
        assert "nothing called rt.should_stop() within 5s: ending the process as SIGTERM does" in output, output
        assert not (tmp_path / "checkpoint.pt").exists()
    else:
        assert took < 12, output
        assert "checkpointed at step" in output, output
        assert torch.load(tmp_path / "checkpoint.pt")["step"] >= 5
