"""Fault tolerance without a restart (torchft): replica groups killed mid-run, the survivors train on.

Every run is compared with the one-process run of the same script (tests/scripts/ft_replica.py): each
committed step's samples, over all groups, are that run's global batch of the step; the final weights
are its weights within 1e-6, and bitwise equal across the groups that finished.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

if importlib.util.find_spec("torchft") is None:
    pytest.skip("torchft is not installed (the ft extra)", allow_module_level=True)

from checks.fault_tolerance import check_exact, committed_steps
from lockstep.env.fault_tolerance import FaultTolerance
from lockstep.runtime.launch.replicas import Lighthouse  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "scripts" / "ft_replica.py"
pytestmark = [pytest.mark.timeout(240), pytest.mark.alone]  # alone: quorum deadlines assume an idle machine


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The one-process run: no fault tolerance, no lighthouse."""
    out = tmp_path_factory.mktemp("reference") / "reference.pt"
    done = subprocess.run([sys.executable, str(SCRIPT), str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return torch.load(out)


@pytest.fixture
def lighthouse():
    house = Lighthouse(FaultTolerance(min_replicas=1, step_timeout=10))
    yield house
    house.shutdown()


def _group(tmp: Path, house: Lighthouse | str, index: int, *extra: str, name: str = "",
           environ: dict[str, str] | None = None) -> subprocess.Popen[str]:
    name = name or f"g{index}"
    env = {**os.environ, "LOCKSTEP_FAULT_TOLERANT": "1", "LOCKSTEP_REPLICA_GROUP": str(index),
           "LOCKSTEP_LIGHTHOUSE": house if isinstance(house, str) else house.address, "LOCKSTEP_STEP_TIMEOUT": "10",
           **(environ or {})}
    return subprocess.Popen([sys.executable, str(SCRIPT), str(tmp / f"{name}.pt"), "--log", str(tmp / f"{name}.log"),
                             *extra], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


def _finish(proc: subprocess.Popen[str], timeout: float = 150) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"a replica group did not end in {timeout} s:\n{out[-3000:]}") from None
    return proc.returncode, out


@pytest.mark.parametrize("when", ["start", "backward", "allreduce", "random"])
def test_three_groups_train_on_when_one_is_killed_and_a_replacement_joins(tmp_path, reference, lighthouse, when):
    # the survivors wait at step 5 for the replacement to ask for its quorum (it takes 5-20 s to start)
    slow = ("--slow", "0.4", "--marks", str(tmp_path / "marks"), "--hold-at", "5", "--hold-for", "4")
    groups = [_group(tmp_path, lighthouse, 0, *slow), _group(tmp_path, lighthouse, 1, *slow),
              _group(tmp_path, lighthouse, 2, *slow, "--die-at", "3", "--die-when", when, name="killed")]
    code, out = _finish(groups[2])
    assert code == -9, out[-2000:]
    killed_at = time.monotonic()
    replacement = _group(tmp_path, lighthouse, 2, *slow, name="replacement")
    (code0, out0), (code1, out1), (code2, out2) = _finish(groups[0]), _finish(groups[1]), _finish(replacement)
    assert (code0, code1, code2) == (0, 0, 0), out0[-2000:] + out1[-2000:] + out2[-2000:]
    results = check_exact(tmp_path, reference, ["g0", "g1", "replacement"])
    assert [r["pid"] for r in results[:2]] == [groups[0].pid, groups[1].pid]  # the survivors never restarted
    # The survivors say who left (with "the step stalled N s" unless its gradient arrived) and who joined.
    assert "left [" in out0 + out1 and "joined [" in out0 + out1, out0[-2000:] + out1[-2000:]
    # No survivor waits out the step timeout (10 s): about 1 s here, the heartbeat timeout and the join wait
    assert all(float(s) < 5.0 for s in re.findall(r"stalled ([\d.]+) s", out0 + out1)), out0 + out1
    assert "group 2 healed from group" in out2, out2[-2000:]
    assert "Traceback" not in out0 + out1 + out2
    print(f"kill ({when}) -> replacement done in {time.monotonic() - killed_at:.1f} s;", out0.strip().splitlines())


def test_groups_started_together_wait_for_a_late_one_at_their_first_quorum(tmp_path, reference, lighthouse):
    """What `lockstep run --fault-tolerant` sets (LOCKSTEP_REPLICA_START_WITH: every group of the job):
    group 2 starts 4 s after the others, and step 0 is still taken by all three; no group heals."""
    start_with = {"LOCKSTEP_REPLICA_START_WITH": "3"}
    groups = [_group(tmp_path, lighthouse, i, "--slow", "0.2", environ=start_with) for i in range(2)]
    time.sleep(4)
    groups.append(_group(tmp_path, lighthouse, 2, "--slow", "0.2", environ=start_with))
    outs = [_finish(g) for g in groups]
    assert [code for code, _ in outs] == [0, 0, 0], [out[-2000:] for _, out in outs]
    check_exact(tmp_path, reference, ["g0", "g1", "g2"])
    for index in range(3):
        first = json.loads((tmp_path / f"g{index}.log").read_text().splitlines()[0])
        assert (first["step"], first["size"]) == (0, 3), first
    assert not any("healed from" in out or "waited" in out for _, out in outs), [out[-2000:] for _, out in outs]


def test_groups_waiting_for_one_that_never_starts_train_on_after_the_step_timeout(tmp_path, reference):
    """Three groups expected, two started: they wait the step timeout (3 s) at their first quorum, give up
    together, say so, and train to the one-process weights."""
    house = Lighthouse(FaultTolerance(min_replicas=1, step_timeout=3))
    environ = {"LOCKSTEP_REPLICA_START_WITH": "3", "LOCKSTEP_STEP_TIMEOUT": "3"}
    try:
        started = time.monotonic()
        outs = [_finish(g, timeout=90) for g in [_group(tmp_path, house, i, environ=environ) for i in range(2)]]
    finally:
        house.shutdown()
    assert [code for code, _ in outs] == [0, 0], [out[-2000:] for _, out in outs]
    check_exact(tmp_path, reference, ["g0", "g1"])
    for index, (_, out) in enumerate(outs):
        said = rf"replica group {index} waited 3 s for 3 groups at its first quorum; it trains on from step 0 " \
               r"with groups \[(0, 1|1, 0)\]"
        assert re.search(said, out), out[-3000:]
    assert time.monotonic() - started > 3


def test_every_group_killed_then_started_again_resumes_from_the_newest_checkpoint(tmp_path, reference, lighthouse):
    saving = ("--checkpoints", str(tmp_path / "ckpt"), "--save-every", "4", "--slow", "0.1")
    first = [_group(tmp_path, lighthouse, i, *saving, "--die-at", "10", name=f"first{i}") for i in range(2)]
    killed = [_finish(g) for g in first]
    assert [code for code, _ in killed] == [-9, -9], killed
    again = [_group(tmp_path, lighthouse, i, *saving, name=f"again{i}") for i in range(2)]
    outs = [_finish(g) for g in again]
    assert [code for code, _ in outs] == [0, 0], outs
    results = check_exact(tmp_path, reference, ["again0", "again1"], "again*.log", first=8)  # from step=8
    # a group that starts later than the other joins by healing, at a later step
    assert min(min(r["record"]) for r in results if r["record"]) == 8
    before = committed_steps(tmp_path, "first*.log")  # steps 8 and 9 were committed before the kill, and again after
    assert sorted(before) == list(range(10))
    wrong = [step for step in before if sorted(before[step]) != sorted(reference["record"][step])]
    assert wrong == [], {"wrong steps": wrong, "logs": {log.name: log.read_text() for log in tmp_path.glob("*.log")},
                         "reference": {step: sorted(reference["record"][step]) for step in wrong},
                         "said": [out[-3000:] for _, out in killed + outs]}


def test_a_group_started_with_another_seed_is_refused_by_name_and_the_others_train_on(tmp_path, reference,
                                                                                    lighthouse):
    groups = [_group(tmp_path, lighthouse, 0, "--slow", "0.2"), _group(tmp_path, lighthouse, 1, "--seed", "7")]
    (code0, out0), (code1, out1) = _finish(groups[0]), _finish(groups[1])
    assert code1 != 0 and "replica group 1 was started with another seed than groups [0]" in out1, out1[-3000:]
    assert code0 == 0 and "replica group(s) [1] refused: another seed than groups [0]" in out0, out0[-3000:]
    result = torch.load(tmp_path / "g0.pt")
    assert float((result["weights"] - reference["weights"]).abs().max()) < 1e-6


def test_a_group_with_another_model_cannot_take_the_live_state_and_says_so(tmp_path, reference, lighthouse):
    """Group 1 (a wider model) starts once group 0 has committed a step; group 0 waits for it at step 3."""
    marks = ("--marks", str(tmp_path / "marks"))
    groups = [_group(tmp_path, lighthouse, 0, "--slow", "0.2", *marks, "--hold-at", "3", "--hold-for", "2")]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and '"committed": true' not in _read(tmp_path / "g0.log"):
        time.sleep(0.1)
    groups.append(_group(tmp_path, lighthouse, 1, "--hidden", "32", *marks))
    (code0, out0), (code1, out1) = _finish(groups[0]), _finish(groups[1])
    assert code1 != 0 and "replica group 1 could not load the state of a live group" in out1, out1[-3000:]
    assert "size mismatch" in out1, out1[-3000:]
    assert code0 == 0, out0[-3000:]
    result = torch.load(tmp_path / "g0.pt")
    assert float((result["weights"] - reference["weights"]).abs().max()) < 1e-6


def test_fewer_live_groups_than_the_minimum_ends_with_an_error_naming_it(tmp_path):
    house = Lighthouse(FaultTolerance(min_replicas=2, step_timeout=3))
    try:
        code, out = _finish(_group(tmp_path, house, 0, environ={"LOCKSTEP_MIN_REPLICAS": "2",
                                                                "LOCKSTEP_STEP_TIMEOUT": "3"}), timeout=60)
    finally:
        house.shutdown()
    assert code != 0
    assert "no quorum of at least 2 live group(s) formed within 3 s" in out, out[-3000:]


def test_batches_that_do_not_come_from_rt_loader_are_refused_instead_of_training_each_group_apart(tmp_path,
                                                                                                  lighthouse):
    """Before: no quorum was taken, so no step averaged the groups' gradients, and every step reused the first
    commit's answer while rt.step_committed read False: the groups trained apart (0.11 off after 10 steps) and the
    documented loop, which counts committed steps, never ended."""
    code, out = _finish(_group(tmp_path, lighthouse, 0, "--plain-loader"), timeout=60)
    assert code != 0 and "optimizer.step() with no step begun" in out, out[-3000:]
    assert "must come from a training loader made by rt.loader" in out


def test_a_lost_lighthouse_ends_every_group_with_an_error(tmp_path):
    """The lighthouse's host dies (SIGKILL): each group ends at its next quorum with an error that says
    so, and nothing is left running (a restart then resumes from the newest checkpoint)."""
    code = ("import time\nfrom lockstep.env.fault_tolerance import FaultTolerance\n"
            "from lockstep.runtime.launch.replicas import Lighthouse\n"
            "house = Lighthouse(FaultTolerance(step_timeout=3))\nprint(house.address, flush=True)\ntime.sleep(600)")
    host = subprocess.Popen([sys.executable, "-c", code],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        address = host.stdout.readline().strip()
        groups = [_group(tmp_path, address, i, "--slow", "0.5", environ={"LOCKSTEP_STEP_TIMEOUT": "3"})
                  for i in range(2)]
        while not list(tmp_path.glob("*.log")) or not any(p.read_text() for p in tmp_path.glob("*.log")):
            time.sleep(0.2)  # training has begun
    finally:
        host.kill()
        host.communicate()
    for group in groups:
        code, out = _finish(group, timeout=60)
        assert code != 0 and "no quorum" in out, out[-3000:]


def test_lockstep_run_fault_tolerant_replaces_a_killed_group_and_the_others_train_on(tmp_path, reference):
    """The user's path: `lockstep run --fault-tolerant` hosts the lighthouse, runs 3 groups, starts a
    replacement for the one SIGKILLed in its backward at step 3, and ends when every group has."""
    run = subprocess.run([sys.executable, "-m", "lockstep.cli.main", "run", "--fault-tolerant", "--replicas", "3",
                          "--devices", "3", "--accelerator", "cpu", "--step-timeout", "10", str(SCRIPT),
                          str(tmp_path / "g{group}.pt"), "--log", str(tmp_path / "g{group}.log"), "--slow", "0.6",
                          "--die-at", "3", "--die-when", "backward", "--die-group", "2",
                          "--marks", str(tmp_path / "marks"), "--hold-at", "5", "--hold-for", "4"],
                         cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert run.returncode == 0, run.stderr[-3000:]
    check_exact(tmp_path, reference, ["g0", "g1", "g2"])
    assert "replica group 2 ended" in run.stderr and "starting a replacement (1 of 3)" in run.stderr, run.stderr
    assert "every worker of replica group 2 was stopped; the other groups train on" in run.stderr, run.stderr
    assert "every worker of the job was stopped" not in run.stderr, run.stderr
    assert "left [2]" in run.stdout and "joined [2]" in run.stdout, run.stdout
    assert run.stdout.count("healed from") == 1, run.stdout  # the replacement; no live group is left out after


def test_a_slow_group_is_named_as_a_group_and_the_weights_stay_the_one_process_runs(tmp_path, reference):
    """Group 1 sleeps 0.2 s a step: every group's rank 0 knows it from the times carried in the cross-group
    all-reduce; the first participant names it, `lockstep run` ends with it; the weights are unchanged."""
    run = subprocess.run([sys.executable, "-m", "lockstep.cli.main", "run", "--fault-tolerant", "--replicas", "3",
                          "--devices", "3", "--accelerator", "cpu", "--step-timeout", "10", str(SCRIPT),
                          str(tmp_path / "g{group}.pt"), "--log", str(tmp_path / "g{group}.log"), "--slow", "0.2",
                          "--slow-group", "1"], cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert run.returncode == 0, run.stderr[-3000:]
    check_exact(tmp_path, reference, ["g0", "g1", "g2"])
    named = re.findall(r"replica group (\d) is a straggler: .* \(steps (\d+)-(\d+)\)", run.stdout)
    assert [group for group, _, _ in named] == ["1"] and int(named[0][2]) <= 10, run.stdout[-3000:]
    assert "lockstep run: straggler summary: replica group 1 is a straggler" in run.stderr, run.stderr[-3000:]
    for group in range(3):
        report = torch.load(tmp_path / f"g{group}.pt")["step_times"]
        assert report["group_stragglers"] == {1: "group"} and report["step_time/slowest_group"] == 1.0
        assert report["step_time/groups_max_over_median"] > 2  # 0.2 s against a few ms; more on a slow machine


def test_two_groups_of_two_fsdp_processes_heal_shard_by_shard_after_a_kill(tmp_path, reference):
    """FSDP inside each group of 2 processes: group 1 is SIGKILLed in its backward at step 3, its
    replacement takes each rank's shards from the same rank of group 0; every group's every rank ends
    at the one-process weights, and every step's samples are that run's."""
    run = subprocess.run([sys.executable, "-m", "lockstep.cli.main", "run", "--fault-tolerant", "--replicas", "2",
                          "--devices", "4", "--accelerator", "cpu", "--strategy", "fsdp", "--step-timeout", "10",
                          str(SCRIPT), str(tmp_path / "g{group}r{rank}.pt"),
                          "--log", str(tmp_path / "g{group}r{rank}.log"),
                          "--slow", "0.4", "--die-at", "3", "--die-when", "backward", "--die-group", "1",
                          "--marks", str(tmp_path / "marks"), "--hold-at", "5", "--hold-for", "3"],
                         cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert run.returncode == 0, run.stderr[-3000:]
    check_exact(tmp_path, reference, ["g0r0", "g0r1", "g1r0", "g1r1"])
    assert "replica group 1 ended" in run.stderr and "left [1]" in run.stdout and "joined [1]" in run.stdout


def test_a_trainer_fit_trains_on_when_a_group_is_killed_and_ends_at_the_one_process_weights(tmp_path):
    """The Trainer under `lockstep run --fault-tolerant`: no code of its own for it; group 1 is killed
    at step 3 of 12, its replacement joins, every group ends at the one-process fit's weights."""
    reference, run = _alone_then_two_groups("ft_trainer.py", tmp_path, "--slow", "1.0", "--die-at", "3",
                                            "--die-group", "1", "--marks", str(tmp_path / "marks"), "--hold-at", "5",
                                            "--hold-for", "3")
    results = [torch.load(tmp_path / f"g{g}.pt") for g in range(2)]
    assert [r["steps"] for r in results] == [12, 12]
    for result in results:
        assert float((result["weights"] - reference["weights"]).abs().max()) < 1e-6
    assert torch.equal(results[0]["weights"], results[1]["weights"])
    assert "replica group 1 ended" in run.stderr and "joined [1]" in run.stdout, run.stdout + run.stderr[-2000:]


def _kill_rpc(address: str, port: int) -> str:
    """torchft's ``ManagerService/Kill`` sent to ``address:port`` (an empty request); what came back. (A
    manager that takes it ends its group before it answers: the call then fails too, and the job's output
    says "got kill request".)"""
    import socket

    import grpc

    try:
        socket.create_connection((address, port), timeout=3).close()
    except ConnectionRefusedError:
        return "refused: connection"
    with grpc.insecure_channel(f"{address}:{port}") as channel:
        kill = channel.unary_unary("/torchft.ManagerService/Kill", request_serializer=lambda _: b"",
                                   response_deserializer=lambda raw: raw)
        try:
            kill(None, timeout=3)
        except grpc.RpcError as error:
            return f"refused: {error.code().name}"
        return "answered"


def _two_groups(tmp: Path) -> subprocess.Popen[str]:
    """`lockstep run --fault-tolerant` with two replica groups of one process, slowed to 0.5 s a step."""
    return subprocess.Popen([sys.executable, "-m", "lockstep.cli.main", "run", "--fault-tolerant", "--replicas", "2",
                             "--devices", "2", "--accelerator", "cpu", "--step-timeout", "10", str(SCRIPT),
                             str(tmp / "g{group}.pt"), "--log", str(tmp / "g{group}.log"), "--slow", "0.5"],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _until_committed(tmp: Path, run: subprocess.Popen[str], steps: int, timeout: float = 90) -> None:
    """Wait until ``steps`` steps committed (or the job ended, or ``timeout`` passed)."""
    deadline = time.monotonic() + timeout
    while len(committed_steps(tmp)) < steps and time.monotonic() < deadline and run.poll() is None:
        time.sleep(0.2)


def test_a_fault_tolerant_job_on_one_node_listens_on_loopback_only_and_a_forged_kill_reaches_no_group(tmp_path,
                                                                                                    reference):
    """Every socket of `lockstep run --fault-tolerant` on one node (the lighthouse, the stores, each group's
    torchft manager, whose gRPC service answers Kill from anyone) listens on loopback; a Kill sent to this
    machine's other address at each of those ports reaches no group, and the job ends at the one-process
    weights."""
    from checks.fault_tolerance import listening, process_tree
    from lockstep.runtime.comm.network import interfaces

    pytest.importorskip("grpc")
    run = _two_groups(tmp_path)
    try:
        _until_committed(tmp_path, run, 3)  # both groups up and stepping: every server of the job is listening
        sockets = listening(process_tree(run.pid))
        ports = sorted({port for _, _, port in sockets})
        assert len(ports) >= 4, sockets  # the lighthouse, the groups' stores and managers at least
        beyond = [(pid, host, port) for pid, host, port in sockets if not host.startswith("127.") and host != "::1"]
        assert beyond == [], f"listening beyond loopback: {beyond}"
        others = [address for address in interfaces().values() if address and not address.startswith("127.")]
        for address in others[:1]:
            answers = {port: _kill_rpc(address, port) for port in ports}
            assert set(answers.values()) == {"refused: connection"}, answers
        out, err = run.communicate(timeout=150)
    finally:
        if run.poll() is None:  # a failed check: the job is stopped (its groups die with their supervisor)
            run.kill()
            run.communicate()
    assert run.returncode == 0, err[-3000:]
    assert "got kill request" not in out + err and "replica group 0 ended" not in err, err[-3000:]
    check_exact(tmp_path, reference, ["g0", "g1"])


def test_a_taken_lighthouse_port_is_said_with_its_address_before_any_group_starts(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = subprocess.run([sys.executable, "-m", "lockstep.cli.main", "run", "--fault-tolerant", "--replicas", "2",
                              "--devices", "2", "--accelerator", "cpu", "--master", f"127.0.0.1:{port}", str(SCRIPT),
                              str(tmp_path / "g{group}.pt")], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2, run.stderr[-2000:]
    assert f"the lighthouse cannot listen on 127.0.0.1:{port} (Address already in use" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and not list(tmp_path.iterdir()), run.stderr


def test_a_replica_group_stopped_by_sigterm_stops_the_job_instead_of_being_replaced(tmp_path):
    """SIGTERM (or SIGINT) that reaches one group from outside means stop, not failure: the supervisor stops every
    group and exits non-zero; nothing is left running."""
    from checks.fault_tolerance import process_tree

    run = _two_groups(tmp_path)
    try:
        _until_committed(tmp_path, run, 2)
        agents = [pid for pid in process_tree(run.pid)
                  if b"--devices" in Path(f"/proc/{pid}/cmdline").read_bytes() and pid != run.pid]
        assert agents, "no group's agent found"
        os.kill(agents[0], signal.SIGTERM)
        out, err = run.communicate(timeout=60)
        time.sleep(1.0)  # the groups' agents and workers end with the supervisor
        left = [pid for pid in os.listdir("/proc") if pid.isdigit() and _cmdline_has(int(pid), str(tmp_path))]
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    assert run.returncode == 1, err[-3000:]
    assert re.search(r"replica group \d was stopped \(exit code 143\); stopping the job", err), err[-3000:]
    assert "starting a replacement" not in err and left == [], (left, err[-3000:])


def _cmdline_has(pid: int, text: str) -> bool:
    try:
        return text.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def test_an_expert_that_one_group_never_used_gets_the_other_groups_gradient(tmp_path):
    """Group 0's rows all go to expert a, group 1's to expert b: each group lacks the other expert's gradient.
    Both groups end at the one-process weights (the gradients were once summed by position: a's with b's)."""
    reference, _ = _alone_then_two_groups("ft_experts.py", tmp_path)
    assert reference["steps"] == 3
    for group in range(2):
        result = torch.load(tmp_path / f"g{group}.pt")
        assert result["steps"] == 3
        for expert in ("a", "b"):
            assert torch.allclose(result[expert], reference[expert], atol=1e-6, rtol=0), (group, expert, result)


def _alone_then_two_groups(name: str, tmp_path: Path, *options: str) -> tuple[dict, subprocess.CompletedProcess]:
    """tests/scripts/``name`` alone (the one-process reference, what it saved), then under ``lockstep run
    --fault-tolerant`` as 2 groups of one process each (``g{group}.pt``) with ``options``."""
    script = ROOT / "tests" / "scripts" / name
    alone = subprocess.run([sys.executable, str(script), str(tmp_path / "alone.pt")], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    assert alone.returncode == 0, alone.stderr[-3000:]
    run = subprocess.run([sys.executable, "-m", "lockstep.cli.main", "run", "--fault-tolerant", "--replicas", "2",
                          "--devices", "2", "--accelerator", "cpu", "--step-timeout", "10", str(script),
                          str(tmp_path / "g{group}.pt"), *options], cwd=ROOT, capture_output=True, text=True,
                         timeout=200)
    assert run.returncode == 0, run.stderr[-3000:]
    return torch.load(tmp_path / "alone.pt"), run
