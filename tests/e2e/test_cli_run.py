"""`lockstep run` as a user runs it: a subprocess, real workers, real failures."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from checks import dist as checks
from lockstep import DistEnv, Runtime

ROOT = Path(__file__).resolve().parents[2]
LOCKSTEP = [sys.executable, "-m", "lockstep.cli.main"]
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def cli_start_s() -> float:
    """Seconds the command takes to start here: Python and the imports of `lockstep run`."""
    start = time.monotonic()
    subprocess.run([sys.executable, "-c", "import lockstep.cli.main"], cwd=ROOT, check=True, timeout=100)
    return time.monotonic() - start


def _lockstep(*args: str, timeout: float = 100) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LOCKSTEP, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)



@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    rt = Runtime(accelerator="cpu", seed=0, env=DistEnv())
    return checks.train_lockstep(rt, checks.make_data(103), 16, epochs=2, shuffle=True)


@pytest.mark.parametrize("devices", ["2", "4"])
def test_run_on_n_processes_equals_single_process(devices, reference, tmp_path):
    out = tmp_path / "result.pt"
    done = _lockstep("run", "--devices", devices, "--accelerator", "cpu", "--strategy", "ddp",
                     "--precision", "32-true", "tests/scripts/train_tiny.py", str(out))
    assert done.returncode == 0, done.stderr
    result = torch.load(out)
    assert (result["world_size"], result["accelerator"], result["precision"]) == (int(devices), "cpu", "32-true")
    assert torch.allclose(result["weights"], reference, atol=1e-5, rtol=0)


def test_torchrun_runs_the_same_script_to_the_same_weights(reference, tmp_path):
    out = tmp_path / "result.pt"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "tests/scripts/train_tiny.py",
         str(out)], cwd=ROOT, capture_output=True, text=True, timeout=100,
        env={**os.environ, "LOCKSTEP_ACCELERATOR": "cpu"})
    assert done.returncode == 0, done.stderr
    assert torch.allclose(torch.load(out)["weights"], reference, atol=1e-5, rtol=0)


def test_precision_passes_through_the_contract(tmp_path):
    out = tmp_path / "result.pt"
    done = _lockstep("run", "--devices", "2", "--accelerator", "cpu", "--precision", "bf16-mixed",
                     "tests/scripts/train_tiny.py", str(out))
    assert done.returncode == 0, done.stderr
    assert torch.load(out)["precision"] == "bf16-mixed"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["run", "--devices", "2", "missing.py"], "missing.py: no such script"),
        (["run", "--devices", "2", "tests/scripts"], "tests/scripts is a folder, not a script"),
        (["run", "-m", "no_such_module_here", "x"], "-m no_such_module_here: no such module"),
        (["run", "--devices", "0", "--accelerator", "cpu", "tests/scripts/spin.py"], "ask for at least one device"),
        (["run", "--devices", "0,2", "--accelerator", "cpu", "tests/scripts/spin.py"], "GPU indices need CUDA"),
        (["run", "--nodes", "2", "tests/scripts/spin.py"], "--nodes > 1 needs --master"),
        (["run", "--nodes", "2", "--node-rank", "2", "--master", "127.0.0.1:1", "tests/scripts/spin.py"],
         "--node-rank 2 does not fit --nodes 2"),
        (["run", "--master", "nohostport", "tests/scripts/spin.py"], "give HOST:PORT"),
    ],
)
def test_preflight_failures_say_what_to_fix_before_any_process_starts(args, message, cli_start_s):
    """Soon after the CLI's own start, before any process is started or any timeout (30 s and more) waited
    for: 2 to 6 s on an idle 2-core machine, 8 to 12 s on one that runs another test beside it (torch's
    import alone then takes several seconds)."""
    start = time.monotonic()
    done = _lockstep(*args)
    assert time.monotonic() - start < cli_start_s + 20
    assert done.returncode == 2
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_preflight_refuses_a_master_port_in_use():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = _lockstep("run", "--devices", "2", "--accelerator", "cpu", "--master", f"127.0.0.1:{port}",
                         "tests/scripts/spin.py", "/tmp")
    assert done.returncode == 2
    assert f"port {port} on 127.0.0.1 is in use" in done.stderr


def test_devices_in_code_disagreeing_with_the_launcher_names_both(tmp_path):
    script = tmp_path / "wants4.py"
    script.write_text("import lockstep\nlockstep.Runtime(accelerator='cpu', devices=4)\n")
    done = _lockstep("run", "--devices", "2", "--accelerator", "cpu", str(script))
    assert done.returncode == 1
    assert "devices=4 asks for 4 processes per node, but the launcher (torchrun) started 2" in done.stderr


def test_worker_exception_is_reported_once_with_rank_and_traceback(tmp_path):
    start = time.monotonic()
    done = _lockstep("run", "--devices", "2", "--accelerator", "cpu", "tests/scripts/spin.py", str(tmp_path), "raise")
    assert time.monotonic() - start < 30
    assert done.returncode == 1
    assert "lockstep: rank 1 (local rank 1)" in done.stderr
    assert done.stderr.count("RuntimeError: rank one gives up at step 5") >= 1
    # rank 1 failed, and its closing mark says so: rank 0's report (kept where its one line says) does not say
    # that rank 1 ended its script
    kept = [line.rsplit("This rank's traceback: ", 1)[1] for line in done.stderr.splitlines()
            if "This rank's traceback: " in line]
    for path in kept:
        report = Path(path).read_text()
        Path(path).unlink()
        assert "ended the script" not in report and "rank 1: last at failed with RuntimeError" in report, report
    assert not any(checks.pid_alive(int(p.read_text())) for p in tmp_path.glob("*.pid"))


def _listening_addresses(pid: int) -> set[str]:
    """Addresses on which process ``pid`` listens for TCP connections (from `ss`)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=10).stdout
    return {line.split()[3].rsplit(":", 1)[0] for line in out.splitlines() if f"pid={pid}," in line}


def test_sigkill_of_one_worker_ends_the_whole_job_within_10_seconds(tmp_path):
    job = subprocess.Popen([*LOCKSTEP, "run", "--devices", "3", "--accelerator", "cpu", "tests/scripts/spin.py",
                            str(tmp_path)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.pid"))) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = {int(p.stem): int(p.read_text()) for p in tmp_path.glob("*.pid")}
        assert len(pids) == 3
        assert _listening_addresses(job.pid) == {"127.0.0.1"}  # the rendezvous store: loopback only
        killed_at = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        _, stderr = job.communicate(timeout=30)
        assert time.monotonic() - killed_at < 10
    finally:
        job.kill()
    assert job.returncode != 0
    assert "rank 1 (local rank 1)" in stderr and "signal SIGKILL" in stderr
    assert not any(checks.pid_alive(pid) for pid in pids.values())


def test_root_cause_is_the_failure_the_agent_saw_first_when_timestamps_tie():
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from lockstep.runtime.launch.elastic import _root_cause

    def failure(local_rank: int, sig: signal.Signals) -> ProcessFailure:
        made = ProcessFailure(local_rank=local_rank, pid=100 + local_rank, exitcode=-sig, error_file="")
        made.timestamp = 1_700_000_000  # the same second for all: the agent's timestamps are whole seconds
        return made

    # The agent records the killed worker first, then the ones it stopped with SIGTERM.
    failures = {1: failure(1, signal.SIGKILL), 0: failure(0, signal.SIGTERM), 2: failure(2, signal.SIGTERM)}
    rank, first = _root_cause(failures)
    assert rank == 1 and first.exitcode == -signal.SIGKILL


def test_self_launch_lockstep_run_and_torchrun_agree(reference, tmp_path):
    """devices=2 in code: `python script` launches 2 workers itself; the launchers do not launch again."""
    results = {}
    commands = {
        "python": [sys.executable, "tests/scripts/self_launch.py"],
        "lockstep run": [*LOCKSTEP, "run", "--devices", "2", "--accelerator", "cpu", "tests/scripts/self_launch.py"],
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                     "tests/scripts/self_launch.py"],
    }
    for name, command in commands.items():
        out = tmp_path / f"{name}.pt"
        done = subprocess.run([*command, str(out)], cwd=ROOT, capture_output=True, text=True, timeout=100)
        assert done.returncode == 0, done.stderr
        starts = done.stdout.count("started pid=")
        assert starts == (3 if name == "python" else 2), (name, done.stdout)  # one launcher + 2 workers
        results[name] = torch.load(out)
        assert results[name]["world_size"] == 2
        assert torch.allclose(results[name]["weights"], reference, atol=1e-5, rtol=0), name


def test_a_script_read_from_stdin_that_asks_for_2_devices_is_told_to_save_it():
    script = 'import lockstep\nlockstep.Runtime(accelerator="cpu", devices=2)\n'
    done = subprocess.run([sys.executable, "-"], input=script, cwd=ROOT, capture_output=True, text=True, timeout=60)
    # before: a worker's FileNotFoundError for ./<stdin>
    assert done.returncode == 1 and "from a script read from <stdin>, which its workers cannot read again" in \
        done.stderr, done.stderr
    assert "FileNotFoundError" not in done.stderr


@pytest.mark.timeout(240)
def test_lockstep_run_inside_a_slurm_job_checkpoints_at_the_time_limit_warning_and_resumes_exactly(tmp_path):
    """SLURM's USR1 to the task (lockstep run's agent) reaches the workers, which checkpoint and stop; before, it
    ended the agent with its workers (USR1's default) and TERM killed the workers without a checkpoint."""
    slurm = {**os.environ, "SLURM_JOB_ID": "4343", "SLURM_JOB_NAME": "train", "SLURM_NTASKS": "1",
             "SLURM_JOB_NODELIST": "localhost", "SLURM_NNODES": "1"}

    def command(name: str) -> list[str]:
        return [*LOCKSTEP, "run", "--devices", "2", "--accelerator", "cpu", "tests/scripts/trainer_preempt.py",
                str(tmp_path / name), str(tmp_path / f"{name}.pt"), str(tmp_path / f"{name}.marker")]

    job = subprocess.Popen(command("cut"), cwd=ROOT, env=slurm, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "cut.marker").exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        job.send_signal(signal.SIGUSR1)  # the time limit's warning, to the task
        output, _ = job.communicate(timeout=90)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
    assert job.returncode == 0 and "lockstep: preempted at step" in output, output
    assert list((tmp_path / "cut").glob("*-preempted.ckpt")) and not (tmp_path / "cut.pt").exists()
    for name in ("cut", "whole"):  # the requeued job resumes; a job never preempted
        done = subprocess.run(command(name), cwd=ROOT, env=slurm, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
    resumed, whole = torch.load(tmp_path / "cut.pt"), torch.load(tmp_path / "whole.pt")
    assert resumed["steps"] == whole["steps"] == 21
    assert torch.equal(resumed["weights"], whole["weights"])


def test_a_node_of_two_whose_peer_never_starts_ends_within_the_rendezvous_timeout_naming_it(tmp_path):
    """torch's static rendezvous waited 15 minutes in silence (its store's wait for clients), then gave a bare
    DistStoreError; the timeout is LOCKSTEP_TIMEOUT's now, or --rdzv-conf timeout=, and the end says why."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    start = time.monotonic()
    done = _lockstep("run", "--nodes", "2", "--node-rank", "0", "--master", f"127.0.0.1:{port}", "--devices", "1",
                     "--rdzv-conf", "timeout=5", "tests/scripts/train_tiny.py", str(tmp_path / "out.pt"), timeout=60)
    assert done.returncode == 1 and time.monotonic() - start < 40, done.stderr
    assert "the 2 nodes did not all join the rendezvous at 127.0.0.1" in done.stderr, done.stderr
    assert "1/2 clients joined" in done.stderr
    other = _lockstep("run", "--nodes", "2", "--node-rank", "0", "--master", f"127.0.0.1:{port}",
                      "--rdzv-conf", "join_timeout=10", "tests/scripts/train_tiny.py", str(tmp_path / "out.pt"))
    assert other.returncode == 2 and "--rdzv-conf join_timeout: a fixed number of nodes" in other.stderr, other.stderr


def test_a_node_whose_node_0_never_starts_waits_quietly_answers_term_and_ends_naming_it(tmp_path):
    """Node 1's store clients (torch's rendezvous, the node watch) retried with a C++ stack trace each time,
    about 2 KB a second, and torch's wait did not answer TERM; now one line says what it waits for."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    node1 = ["run", "--nodes", "2", "--node-rank", "1", "--master", f"127.0.0.1:{port}", "--devices", "1",
             "--rdzv-conf", "timeout=8", "tests/scripts/train_tiny.py", str(tmp_path / "out.pt")]
    done = _lockstep(*node1, timeout=60)
    assert done.returncode == 1, done.stderr
    assert f"waiting for node 0's rendezvous store at 127.0.0.1:{port} (up to 8 s" in done.stderr, done.stderr
    assert f"(nothing listened at 127.0.0.1:{port} within 8 s)" in done.stderr, done.stderr
    assert "frame #" not in done.stderr and len(done.stderr) < 2000, done.stderr
    waiting = subprocess.Popen([*LOCKSTEP, *node1[:-3], "timeout=60", *node1[-2:]], cwd=ROOT, text=True,
                               stderr=subprocess.PIPE, start_new_session=True)
    try:
        time.sleep(4)
        waiting.send_signal(signal.SIGTERM)
        _, stderr = waiting.communicate(timeout=15)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(waiting.pid, signal.SIGKILL)
    assert waiting.returncode == 128 + signal.SIGTERM and "stopped by SIGTERM" in stderr, stderr


def test_two_nodes_started_with_other_node_counts_both_say_so_and_end(tmp_path):
    """Before: the job trained (node 1 took itself for one of 3 nodes), then both agents hung in torch's exit
    barrier; a Runtime whose start failed also broke its exit handler (no attribute '_checkpoints')."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    nodes = [subprocess.Popen([*LOCKSTEP, "run", "--nodes", count, "--node-rank", rank, "--master", f"127.0.0.1:{port}",
                               "--devices", "1", "--accelerator", "cpu", "tests/scripts/train_tiny.py",
                               str(tmp_path / "out.pt")],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for count, rank in (("2", "0"), ("3", "1"))]
    try:
        outputs = [node.communicate(timeout=90)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
    for node, output in zip(nodes, outputs, strict=True):
        assert node.returncode == 1, output
        assert "Parallel(), 2 node(s); rank 1: strategy 'ddp', precision '32-true', Parallel(), 3 node(s)" in output
        assert "Exception ignored" not in output and "SignalException" not in output, output


def test_legacy_torch_distributed_launch_with_local_rank(tmp_path):
    out = tmp_path / "legacy.pt"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.launch", "--nproc-per-node", "2",
         "tests/scripts/legacy_local_rank.py", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    assert torch.load(out) == {"total": 3.0, "launcher": "torch.distributed.launch", "world_size": 2}


def test_run_a_module_with_dash_m(reference, tmp_path):
    out = tmp_path / "result.pt"
    done = subprocess.run([*LOCKSTEP, "run", "--devices", "2", "--accelerator", "cpu", "-m", "train_tiny", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=100,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "tests" / "scripts")})
    assert done.returncode == 0, done.stderr
    assert torch.allclose(torch.load(out)["weights"], reference, atol=1e-5, rtol=0)


def test_the_help_of_run_names_every_strategy():
    from lockstep.cli.main import build_parser
    from lockstep.runtime.parallel.strategy import make_strategy

    commands = next(a for a in build_parser()._actions if a.dest == "command")
    text = " ".join(commands.choices["run"].format_help().split())
    for name in ("ddp", "fsdp", "dp", "single"):
        assert make_strategy(name, 1)[0].name and name in text


def test_lockstep_run_on_ray_with_no_cluster_at_ray_address_says_so_within_seconds(tmp_path):
    """Ray's own driver retries an unreachable address for minutes: `lockstep run --engine ray` tries it
    first, and ends with one line naming the address and what to set."""
    pytest.importorskip("ray")
    script = tmp_path / "train.py"
    script.write_text("print('never run')\n")
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "lockstep.cli.main", "run", "--engine", "ray", str(script)],
                          cwd=ROOT, env={**os.environ, "RAY_ADDRESS": f"127.0.0.1:{port}"}, capture_output=True,
                          text=True, timeout=60)
    took = time.monotonic() - started
    assert done.returncode == 1, done.stderr
    assert f"lockstep run: cannot reach the Ray cluster at 127.0.0.1:{port}: [Errno 111] Connection refused" \
        in done.stderr, done.stderr
    assert "never run" not in done.stdout and took < 30, took


LINE = r"rank=(\d) line=\d\d x+ end"


@pytest.mark.parametrize("route", ["run", "self-launch"])
def test_every_rank_s_lines_arrive_whole_through_a_pipe_even_unbuffered(route):
    """4 ranks print 50 lines each, a print in 4 pieces, under PYTHONUNBUFFERED (every piece its own write):
    all 200 lines whole, each with the length its rank gives it."""
    import re

    command = ([*LOCKSTEP, "run", "--devices", "4", "--accelerator", "cpu", "tests/scripts/print_lines.py"]
               if route == "run" else [sys.executable, "tests/scripts/print_lines.py", "self"])
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=100,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if "line=" in line]
    whole = [m for line in lines if (m := re.fullmatch(LINE, line)) and len(line) == 59 + 7 * int(m.group(1))]
    assert len(lines) == len(whole) == 200, [line for line in lines if not re.fullmatch(LINE, line)][:3]


def test_rank_prefix_and_show_ranks_choose_the_lines_and_begin_each_with_its_rank():
    import re

    done = _lockstep("run", "--devices", "4", "--accelerator", "cpu", "--rank-prefix", "--show-ranks", "3,1",
                     "tests/scripts/print_lines.py")
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 100 and all(re.fullmatch(r"\[rank ([13])\] rank=\1 line=\d\d x+ end", line)
                                     for line in lines), lines[:3]
    refused = _lockstep("run", "--devices", "2", "--show-ranks", "first", "tests/scripts/print_lines.py")
    assert refused.returncode == 2 and "--show-ranks 'first': give the ranks" in refused.stderr
