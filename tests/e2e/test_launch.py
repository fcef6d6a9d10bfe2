"""lockstep.launch: rank 0's value back, a worker's exception surfaced fast, no process left."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

import lockstep
from checks import dist as checks
from lockstep.testing import run_ranks

pytestmark = pytest.mark.timeout(60)



def _sum_of_ranks(scale: float) -> torch.Tensor:
    rt = lockstep.Runtime(accelerator="cpu")
    return rt.all_reduce(torch.tensor([float(rt.rank)]) * scale, op="sum") + rt.rank * 100


def test_launch_returns_rank_zeros_value():
    value = lockstep.launch(_sum_of_ranks, nprocs=3, args=(2.0,))
    assert torch.equal(value, torch.tensor([6.0]))  # rank 0's, not rank 1's (106) or 2's (206)


def _fail_on_rank_one(pid_dir: str) -> None:
    rt = lockstep.Runtime(accelerator="cpu")
    with open(os.path.join(pid_dir, f"{rt.rank}.pid"), "w") as handle:
        handle.write(str(os.getpid()))
    if rt.rank == 1:
        time.sleep(0.5)
        raise ValueError("bad input on rank one")
    time.sleep(600)  # the others would wait forever: launch must stop them


def test_worker_exception_names_the_rank_fast_and_leaves_no_process(tmp_path):
    start = time.monotonic()
    with pytest.raises(lockstep.WorkerError, match=r"rank 1 of 3 failed: ValueError: bad input on rank one") as info:
        lockstep.launch(_fail_on_rank_one, nprocs=3, args=(str(tmp_path),))
    assert time.monotonic() - start < 10
    assert info.value.rank == 1
    assert isinstance(info.value.__cause__, ValueError)
    pids = [int(p.read_text()) for p in tmp_path.glob("*.pid")]
    assert len(pids) == 3
    assert not any(checks.pid_alive(pid) for pid in pids)


def _rank_zero_returns_early() -> str:
    rt = lockstep.Runtime(accelerator="cpu", timeout=5)
    if rt.rank == 0:
        return "returned"
    rt.all_reduce(torch.ones(1))  # rank 0 never comes: its function returned
    return "reduced"


def test_a_rank_whose_function_returned_is_named_as_ended_by_the_rank_still_waiting():
    with pytest.raises(lockstep.WorkerError, match="rank 1 of 2 failed") as info:
        lockstep.launch(_rank_zero_returns_early, nprocs=2)
    # before, rank 0 still sat in the launch's final barrier with its Runtime open: "never reached a collective"
    assert "Rank 0 ended the script while this rank still waits in a collective" in str(info.value), str(info.value)


def _raw_all_reduce_with_rank_one_late() -> None:
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(30)
    dist.all_reduce(torch.ones(1))  # the launch's own process group: no Runtime made


def test_lockstep_timeout_bounds_the_process_group_launch_makes_and_timeout_bounds_the_call(monkeypatch):
    """Before, the launch's group waited 300 s whatever LOCKSTEP_TIMEOUT said (36 s here, rank 1's lateness)."""
    monkeypatch.setenv("LOCKSTEP_TIMEOUT", "5")
    start = time.monotonic()
    with pytest.raises(lockstep.WorkerError, match="rank 0 of 2 failed"):
        lockstep.launch(_raw_all_reduce_with_rank_one_late, nprocs=2)
    assert time.monotonic() - start < 25
    monkeypatch.delenv("LOCKSTEP_TIMEOUT")
    start = time.monotonic()
    with pytest.raises(lockstep.WorkerError, match="did not finish within 3"):
        lockstep.launch(_raw_all_reduce_with_rank_one_late, nprocs=2, timeout=3)
    assert time.monotonic() - start < 25


def _what_the_worker_sees() -> tuple[str | None, bool, str, int]:
    environ = os.environ
    return environ.get("LOCKSTEP_TEST_VALUE"), "LOCKSTEP_TEST_GONE" in environ, os.getcwd(), torch.get_num_threads()


def test_each_launch_gives_the_workers_the_callers_environment_and_directory_at_that_moment(monkeypatch, tmp_path):
    """The fork server started with the first launch's environment; later launches must not see it."""
    monkeypatch.setenv("LOCKSTEP_TEST_VALUE", "first")
    monkeypatch.setenv("LOCKSTEP_TEST_GONE", "1")
    lockstep.launch(_what_the_worker_sees, nprocs=1)
    monkeypatch.setenv("LOCKSTEP_TEST_VALUE", "second")
    monkeypatch.delenv("LOCKSTEP_TEST_GONE")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(tmp_path)
    seen = run_ranks(_what_the_worker_sees, 2)
    assert seen == [("second", False, str(tmp_path), 1)] * 2


REDIRECTED = """
import os, sys
import lockstep

def hello(tag):
    os.write(1, f"worker says {tag}\\n".encode())  # one write: two workers' lines do not interleave

if __name__ == "__main__":
    lockstep.launch(hello, nprocs=1, args=("first",))
    os.dup2(os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
    lockstep.launch(hello, nprocs=2, args=("second",))
"""


def test_workers_write_to_the_standard_output_the_caller_has_at_the_launch(tmp_path):
    script, redirected = tmp_path / "launcher.py", tmp_path / "redirected.txt"
    script.write_text(REDIRECTED)
    first = subprocess.run([sys.executable, str(script), str(redirected)], capture_output=True, text=True, timeout=50)
    assert first.returncode == 0, first.stderr
    assert first.stdout == "worker says first\n"
    assert redirected.read_text() == "worker says second\n" * 2


def test_an_argument_that_cannot_be_pickled_is_named():
    import threading

    with pytest.raises(lockstep.ConfigError, match=r"args\[1\] cannot be \(TypeError: cannot pickle '_thread.lock"):
        lockstep.launch(_sum_of_ranks, nprocs=2, args=(2.0, threading.Lock()))


def test_launch_rejects_zero_processes():
    with pytest.raises(ValueError, match="at least one process"):
        lockstep.launch(_sum_of_ranks, nprocs=0)


ORPHANED = """
import os, sys, time
from pathlib import Path
import lockstep

def work(folder):
    Path(folder, str(os.getpid())).touch()
    time.sleep(120)

if __name__ == "__main__":
    lockstep.launch(work, nprocs=2, args=(sys.argv[1],))
"""


def _running(pid: int) -> bool:
    """Alive and not a zombie (a killed orphan waits for init to reap it)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone, also between the open and the read
        return False


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_workers_die_with_a_launcher_killed_by_sigkill(tmp_path):
    import signal

    script = tmp_path / "launcher.py"
    script.write_text(ORPHANED)
    launcher = subprocess.Popen([sys.executable, str(script), str(tmp_path)])
    deadline = time.monotonic() + 45
    while len([p for p in tmp_path.iterdir() if p.name.isdigit()]) < 2:
        assert time.monotonic() < deadline and launcher.poll() is None, "the workers never started"
        time.sleep(0.2)
    workers = [int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()]
    launcher.send_signal(signal.SIGKILL)  # no clean-up of its own runs
    launcher.wait(timeout=10)
    deadline = time.monotonic() + 10
    while any(_running(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_running(pid) for pid in workers), "workers outlived their launcher"


def _listening_addresses_of_this_process() -> set[str]:
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=10).stdout
    return {line.split()[3].rsplit(":", 1)[0] for line in out.splitlines() if f"pid={os.getpid()}," in line}


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_the_store_of_a_launch_listens_on_loopback_only():
    assert lockstep.launch(_listening_addresses_of_this_process, nprocs=2) == {"127.0.0.1"}  # rank 0 hosts it


def test_a_dataset_class_defined_in_the_script_reaches_the_loader_workers_of_launched_ranks():
    """A script's own Dataset class, read by 2 loader workers on each of 2 launched ranks (the
    workers are started with the standard pickler, which finds classes by name)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
    done = subprocess.run([sys.executable, "tests/scripts/launch_loader.py", "squares"], cwd=root,
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"samples of rank 0: {[i * i for i in range(12)]}" in done.stdout


@pytest.mark.timeout(120)
def test_lockstep_launch_without_the_main_guard_says_so_in_a_few_lines(tmp_path):
    """Each worker imports the script again; a script that calls lockstep.launch at import made each worker
    try to launch in turn (141 lines of multiprocessing's traceback, no word of the cause)."""
    script = tmp_path / "train.py"
    script.write_text("import lockstep\n\n\ndef main():\n    return lockstep.Runtime(accelerator='cpu').rank\n\n\n"
                      "print(lockstep.launch(main, nprocs=2))\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100)
    said = [line for line in (done.stdout + done.stderr).splitlines() if not line.startswith(("W1", "Failed to"))]
    assert done.returncode == 1 and 'if __name__ == "__main__":' in done.stderr, done.stderr
    assert len(said) <= 15 and "bootstrapping phase" not in done.stderr, "\n".join(said)


def test_a_script_read_from_stdin_launches_its_function():
    """A script piped to python (`python - < cell.py`, as a notebook runner may): its workers tried to import
    `<stdin>` as their __main__ and failed with FileNotFoundError, which the WorkerError did not name."""
    script = ("import torch, lockstep\n"
              "def fn(scale):\n"
              "    rt = lockstep.Runtime(accelerator='cpu')\n"
              "    return rt.all_reduce(torch.tensor([float(rt.rank + 1)]) * scale, op='sum')\n"
              "print('sum', float(lockstep.launch(fn, nprocs=2, args=(2.0,))))\n")
    done = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=50)
    assert done.returncode == 0 and "sum 6.0" in done.stdout, done.stderr[-3000:]
