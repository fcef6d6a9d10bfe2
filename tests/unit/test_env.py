"""DistEnv parsing: one case per launcher, and the inconsistent environments it must refuse."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from lockstep.env import DistEnv, EnvError, expand_nodelist, expand_tasks_per_node


def test_nothing_is_a_single_process():
    env = DistEnv.from_environ({}, argv=[])
    assert (env.rank, env.world_size, env.local_world_size, env.launcher) == (0, 1, 1, "none")
    assert not env.is_distributed


def test_torchrun_variables():
    env = DistEnv.from_environ(
        {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
         "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29400",
         "TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_USE_AGENT_STORE": "True"},
        argv=[],
    )
    assert env == DistEnv(rank=5, local_rank=1, world_size=8, local_world_size=4, node_rank=1,
                          num_nodes=2, master_addr="10.1.2.3", master_port=29400,
                          launcher="torchrun", agent_store=True)


def test_plain_rank_variables_without_group_infer_node():
    env = DistEnv.from_environ(
        {"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
         "MASTER_PORT": "1234"}, argv=[])
    assert (env.node_rank, env.num_nodes, env.launcher) == (1, 2, "env")


def test_legacy_launch_local_rank_in_argv():
    base = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    env = DistEnv.from_environ(base, argv=["--local_rank=1", "--lr", "0.1"])
    assert (env.local_rank, env.local_world_size, env.launcher) == (1, 2, "torch.distributed.launch")
    env = DistEnv.from_environ(base, argv=["--local-rank", "1"])
    assert env.local_rank == 1


def test_legacy_local_rank_without_world_is_refused():
    with pytest.raises(EnvError, match="RANK and WORLD_SIZE are not set"):
        DistEnv.from_environ({}, argv=["--local_rank=0"])


def test_legacy_local_rank_disagreeing_with_env_is_refused():
    with pytest.raises(EnvError, match="disagrees with LOCAL_RANK"):
        DistEnv.from_environ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                              "MASTER_PORT": "1"}, argv=["--local_rank=1"])


SLURM = {
    "SLURM_JOB_ID": "123456", "SLURM_JOB_NAME": "train", "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_NTASKS": "8",
    "SLURM_STEP_NUM_TASKS": "8", "SLURM_JOB_NODELIST": "gpu[01-04]",
    "SLURM_STEP_NODELIST": "gpu[01-02,07],cpu3", "SLURM_STEP_TASKS_PER_NODE": "2(x4)",
}


def test_slurm_under_srun():
    env = DistEnv.from_environ(SLURM, argv=[])
    assert env == DistEnv(rank=5, local_rank=1, world_size=8, local_world_size=2, node_rank=1,
                          num_nodes=4, master_addr="gpu01", master_port=10000 + 123456 % 20000,
                          launcher="slurm")


def test_slurm_master_port_from_environment_wins():
    assert DistEnv.from_environ({**SLURM, "MASTER_PORT": "4242"}, argv=[]).master_port == 4242


def test_slurm_uneven_tasks_per_node():
    env = DistEnv.from_environ({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "3,3,1,1", "SLURM_NODEID": "2",
                                "SLURM_PROCID": "6", "SLURM_LOCALID": "0"}, argv=[])
    assert (env.local_world_size, env.node_rank) == (1, 2)


def test_slurm_several_tasks_without_srun_is_refused():
    batch_step = {k: v for k, v in SLURM.items() if k not in ("SLURM_STEP_ID",)}
    with pytest.raises(EnvError, match="without srun"):
        DistEnv.from_environ(batch_step, argv=[])


def test_slurm_one_task_without_srun_is_a_single_process():
    env = DistEnv.from_environ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}, argv=[])
    assert env.launcher == "none"


def test_slurm_interactive_shell_is_ignored_unless_srun_started_the_process(monkeypatch):
    import lockstep.env.distenv as distenv

    env = DistEnv.from_environ({**SLURM, "SLURM_JOB_NAME": "bash"}, argv=[])
    assert env.launcher == "none"  # `python train.py` typed in the salloc shell: one process
    # `srun -n 8 python train.py` typed there: srun's slurmstepd is the parent, and the step is a job of 8 ranks
    # (before: each task ran as a job of its own)
    monkeypatch.setattr(distenv, "_started_by_slurmstepd", lambda: True)
    for name in ("bash", "interactive"):
        env = DistEnv.from_environ({**SLURM, "SLURM_JOB_NAME": name}, argv=[])
        assert (env.launcher, env.rank, env.world_size) == ("slurm", 5, 8)


def test_slurm_tasks_per_node_disagreeing_with_ntasks():
    with pytest.raises(EnvError, match="--ntasks equal --nodes x --ntasks-per-node"):
        DistEnv.from_environ({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "2(x3)"}, argv=[])


def test_torchrun_inside_slurm_wins_over_slurm_and_preempts_with_the_schedulers_grace():
    env = DistEnv.from_environ({**SLURM, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
                                "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "1", "TORCHELASTIC_RUN_ID": "x"},
                               argv=[])
    assert env.launcher == "torchrun-slurm" and (env.rank, env.world_size) == (0, 2)
    # SLURM's USR1 and TERM become a checkpoint and a stop, and a requeue, as under srun
    assert env.capabilities.agent_watches and env.capabilities.preempts_with_grace and env.capabilities.requeues


def test_open_mpi():
    env = DistEnv.from_environ(
        {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
         "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "node1", "MASTER_PORT": "29501"}, argv=[])
    assert env == DistEnv(rank=3, local_rank=1, world_size=4, local_world_size=2, node_rank=1,
                          num_nodes=2, master_addr="node1", master_port=29501, launcher="mpi")


def test_mpich_single_node_defaults_to_loopback():
    env = DistEnv.from_environ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1",
                                "MPI_LOCALNRANKS": "2"}, argv=[])
    assert (env.rank, env.master_addr, env.master_port, env.launcher) == (1, "127.0.0.1", 29500, "mpi")


def test_mpi_multi_node_without_master_addr_is_refused():
    with pytest.raises(EnvError, match="MASTER_ADDR is not set"):
        DistEnv.from_environ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "4",
                              "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}, argv=[])


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({"RANK": "4", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "MASTER_PORT": "1"}, "rank 4 does not fit"),
        ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_PORT": "1"},
         "local rank 2 does not fit"),
        ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "MASTER_PORT": "1"},
         "4 processes on this node do not fit"),
        ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, "no master port"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not an integer"),
        ({"RANK": "0"}, "WORLD_SIZE is not set"),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_PORT": "70000"}, "not a valid TCP port"),
    ],
)
def test_inconsistent_environments_are_refused(environ, message):
    with pytest.raises(EnvError, match=message):
        DistEnv.from_environ(environ, argv=[])


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("gpu[01-04,07],cpu3", ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "cpu3"]),
        ("node1", ["node1"]),
        ("a[8-11]", ["a8", "a9", "a10", "a11"]),
        ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
        ("x-[1,3],y", ["x-1", "x-3", "y"]),
        ("n[009-011]", ["n009", "n010", "n011"]),
    ],
)
def test_nodelist_expansion(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["gpu[1-", "gpu[3-1]", "gpu]1["])
def test_bad_nodelists_are_refused(bad):
    with pytest.raises(ValueError, match="node list"):
        expand_nodelist(bad)


def test_tasks_per_node_expansion():
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    with pytest.raises(ValueError):
        expand_tasks_per_node("two")


def test_several_nodes_get_the_interface_that_reaches_the_master_unless_the_user_chose(monkeypatch, capsys):
    from lockstep.runtime.comm.process_group import choose_socket_interface

    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.setenv(name, "")  # so that the test's end restores what was there
        monkeypatch.delenv(name)
    two_nodes = DistEnv(rank=0, world_size=2, local_world_size=1, node_rank=0, num_nodes=2,
                        master_addr="127.0.0.1", master_port=29500, launcher="slurm")
    choose_socket_interface(two_nodes)
    assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["NCCL_SOCKET_IFNAME"] == "lo"
    assert "network interface lo (127.0.0.1) reaches 127.0.0.1" in capsys.readouterr().err
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    choose_socket_interface(two_nodes)
    assert (os.environ["GLOO_SOCKET_IFNAME"], os.environ["NCCL_SOCKET_IFNAME"]) == ("lo", "ib0")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    choose_socket_interface(DistEnv(rank=0, world_size=2, local_world_size=2, master_port=29500, launcher="torchrun"))
    assert "GLOO_SOCKET_IFNAME" not in os.environ  # one node: nothing to choose


def test_behaviour_follows_the_launchers_capabilities_never_its_name():
    """Each route DistEnv can name declares what it can do, and the runtime asks that, not the name."""
    import re
    from pathlib import Path

    import lockstep
    from lockstep.env.launchers import ROUTES, Capabilities

    named = set(re.findall(r'launcher(?:=| = )"([^"]+)"', Path(lockstep.env.distenv.__file__).read_text()))
    named |= {"torchrun", "kubernetes", "lockstep.launch", "env"}  # TORCHELASTIC_RUN_ID, LOCKSTEP_LAUNCHER
    assert named <= set(ROUTES), named - set(ROUTES)
    assert DistEnv().capabilities.started_alone and not DistEnv(launcher="torchrun").capabilities.started_alone
    assert DistEnv(launcher="torchrun").capabilities.agent_watches
    assert DistEnv(launcher="slurm").capabilities.preempts_with_grace
    assert DistEnv(launcher="a-new-route").capabilities == Capabilities()  # unknown: no capability assumed
    runtime = Path(lockstep.__file__).parent / "runtime"
    keyed = [f"{p.name}:{n}" for p in runtime.rglob("*.py") for n, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"launcher\s*(==|!=|in\b)", line)]
    assert keyed == [], keyed


def test_a_route_that_preempts_with_grace_but_cannot_requeue_stops_without_requeueing(monkeypatch):
    """Preemption (a signal, a grace period) and requeueing are separate capabilities: a route with
    the first only (a container orchestrator that restarts the job itself) gets the agreed stop, and
    rt.requeue asks no scheduler, even where a SLURM job's requeue settings are in the environment."""
    import signal

    import lockstep
    from lockstep.env.launchers import ROUTES, Capabilities

    monkeypatch.setitem(ROUTES, "an-orchestrator", Capabilities(preempts_with_grace=True))
    monkeypatch.setenv("LOCKSTEP_REQUEUE", "1")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)}
    try:
        for route, job in (("an-orchestrator", None), ("slurm", "4242")):
            rt = lockstep.Runtime(accelerator="cpu", env=DistEnv(launcher=route))
            assert rt.preemption is not None and rt.preemption.requeue_job == job, route
            rt.close()
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)


def test_torch_elastic_in_a_kubernetes_pod_is_the_kubernetes_route_which_preempts_with_grace():
    elastic = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "TORCHELASTIC_RUN_ID": "x",
               "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert DistEnv.from_environ(elastic).launcher == "torchrun"
    pod = DistEnv.from_environ({**elastic, "KUBERNETES_SERVICE_HOST": "10.96.0.1"})
    assert pod.launcher == "kubernetes" and pod.capabilities.agent_watches
    assert pod.capabilities.preempts_with_grace and not pod.capabilities.requeues
    assert pod.capabilities.scheduler == "Kubernetes"


def _run_args(argv):
    """``lockstep run ARGV`` as the request its engine plans."""
    import argparse

    from lockstep.cli.run import add_parser
    from lockstep.runtime.launch.request import RunRequest

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return RunRequest.from_options(parser.parse_args(["run", *argv]))


def test_the_scripts_own_options_after_script_are_its_own_also_where_they_abbreviate_a_lockstep_option():
    """``--n 5`` after SCRIPT is the script's, not an ambiguous prefix of --nodes/--node-rank/--name; exact
    names of lockstep's options after SCRIPT were already the script's."""
    for argv in (["--n", "5"], ["--nod", "2", "--r", "x"], ["--nodes", "5"], ["--", "--devices", "3"]):
        request = _run_args(["--devices", "2", "train.py", *argv])
        given = argv[1:] if argv[0] == "--" else argv  # argparse drops a "--" after SCRIPT
        assert (request.script, list(request.script_args), request.devices) == ("train.py", given, "2"), argv


def test_lockstep_run_takes_kubeflow_trainers_pet_variables_for_the_options_not_given():
    from lockstep.errors import PreflightError
    from lockstep.runtime.launch.request import with_orchestrator_defaults as defaults

    pet = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "4", "PET_NODE_RANK": "1",
           "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29500"}
    args, notes = defaults(_run_args(["train.py"]), pet)
    assert (args.nodes, args.node_rank, args.devices, args.master) == ("2", 1, "4", "job-node-0-0.job:29500")
    assert notes == ["from Kubeflow Trainer's PET_* variables: --nodes 2 --node-rank 1 --devices 4 "
                     "--master job-node-0-0.job:29500"]
    # the command line wins
    given, _ = defaults(_run_args(["--devices", "2", "--master", "10.0.0.1:1234", "train.py"]),
                        {**pet, "PET_NPROC_PER_NODE": "auto"})
    assert (given.nodes, given.devices, given.master) == ("2", "2", "10.0.0.1:1234")
    # one node: loopback, no master from the variables
    one, _ = defaults(_run_args(["train.py"]), {**pet, "PET_NNODES": "1", "PET_NODE_RANK": "0"})
    assert (one.nodes, one.node_rank, one.master) == ("1", 0, None)
    plain, notes = defaults(_run_args(["train.py"]), {})  # outside Kubernetes: the usual defaults
    assert notes == [] and (plain.nodes, plain.node_rank, plain.devices) == ("1", 0, "auto")
    with pytest.raises(PreflightError, match="PET_NODE_RANK"):
        defaults(_run_args(["train.py"]), {"PET_NODE_RANK": "one"})



def test_lockstep_run_as_one_of_several_srun_tasks_on_a_node_is_refused():
    from lockstep.errors import PreflightError
    from lockstep.runtime.launch.request import with_orchestrator_defaults as defaults

    step = {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "1"}
    with pytest.raises(PreflightError, match="srun started 2 tasks on 1 node"):  # before: two jobs of one process
        defaults(_run_args(["train.py"]), step)
    one_per_node = {**step, "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NUM_NODES": "2"}
    assert defaults(_run_args(["train.py"]), one_per_node)[0].script == "train.py"


def test_lockstep_run_on_several_nodes_takes_master_addr_and_port_for_a_master_not_given():
    from lockstep.runtime.launch.request import with_orchestrator_defaults as defaults

    exported = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29600"}
    args, notes = defaults(_run_args(["--nodes", "2", "--node-rank", "1", "train.py"]), exported)
    assert args.master == "10.0.0.1:29600" and notes == ["from MASTER_ADDR and MASTER_PORT: --master 10.0.0.1:29600"]
    given, notes = defaults(_run_args(["--nodes", "2", "--master", "10.0.0.2:1234", "train.py"]), exported)
    assert given.master == "10.0.0.2:1234" and notes == []  # the command line wins
    one, notes = defaults(_run_args(["train.py"]), exported)  # one node: loopback, a free port
    assert one.master is None and notes == []


def test_a_ray_train_worker_is_the_ray_route_with_its_node_rank_and_the_nodes_of_its_placement_group(monkeypatch):
    """Ray sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK in each worker (a process of a Ray
    node: RAY_RAYLET_PID). With 3 workers on one node and 1 on another, the worker alone on node 1 cannot
    derive the node count from its own numbers (4 // 1 = 4): it is the placement group's."""
    import lockstep.env.distenv as distenv

    worker = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "NODE_RANK": "1",
              "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "RAY_RAYLET_PID": "123"}
    monkeypatch.setattr(distenv, "_ray_nodes", lambda: 2)
    env = DistEnv.from_environ(worker)
    assert (env.launcher, env.rank, env.local_rank, env.node_rank, env.num_nodes) == ("ray", 3, 0, 1, 2)
    assert env.capabilities.records_checkpoints and not env.capabilities.agent_watches
    assert DistEnv.from_environ({k: v for k, v in worker.items() if k != "RAY_RAYLET_PID"}).launcher == "env"
    monkeypatch.setattr(distenv, "_ray_nodes", lambda: None)  # outside a placement group: its own numbers
    assert DistEnv.from_environ(worker).num_nodes == 4


@pytest.mark.timeout(120)
def test_ray_variables_in_a_process_that_imported_ray_but_is_no_connected_worker_start_no_ray_cluster():
    """Asked for its placement group outside a connected worker, Ray starts a local cluster of its own (nine
    processes, minutes in a test session): the node count then comes from the variables alone."""
    probe = ("import os, ray\n"
             "from lockstep import DistEnv\n"
             "env = DistEnv.from_environ({'RANK': '0', 'WORLD_SIZE': '2', 'LOCAL_RANK': '0', 'LOCAL_WORLD_SIZE': '1', "
             "'NODE_RANK': '0', 'RAY_RAYLET_PID': '1', 'MASTER_ADDR': '10.0.0.1', 'MASTER_PORT': '29500'})\n"
             "print(env.launcher, env.num_nodes, ray.is_initialized())")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["ray", "2", "False"], done.stderr


def test_lockstep_run_on_ray_plans_its_workers_and_refuses_what_ray_does_not_take(tmp_path):
    from lockstep.errors import PreflightError
    from lockstep.runtime.launch.ray_engine import plan_ray_job

    script = tmp_path / "train.py"
    script.write_text("")
    fixed = plan_ray_job(_run_args(["--engine", "ray", "--nodes", "2", str(script), "x"]), 3, {})
    assert (fixed.workers, fixed.max_failures, fixed.script_args) == (6, 0, ["x"])
    # a new run each time (an earlier run of the script is not continued with other settings), unless --name
    assert re.fullmatch(r"train-\d{8}-\d{6}", fixed.name) and not fixed.named, fixed.name
    elastic = plan_ray_job(_run_args(["--engine", "ray", "--nodes", "1:2", "--resize-interval", "5",
                                      "--storage", "st", "--name", "exp", str(script)]), 2, {})
    assert (elastic.workers, elastic.max_failures, elastic.resize_interval) == ((2, 4), 3, 5.0)
    assert (elastic.name, elastic.named, elastic.storage) == ("exp", True, str(Path("st").resolve()))
    refused = {"--node-rank": ["--node-rank", "1"], "--master": ["--master", "h:1"],
               "--fault-tolerant": ["--fault-tolerant"], "--resize-interval": ["--resize-interval", "5"],
               "--nodes": ["--nodes", "2:1"]}
    for option, argv in refused.items():
        with pytest.raises(PreflightError, match=option):
            plan_ray_job(_run_args(["--engine", "ray", *argv, str(script)]), 2, {})
    with pytest.raises(PreflightError, match="at least 1 worker"):
        plan_ray_job(_run_args(["--engine", "ray", str(script)]), 0, {})
    with pytest.raises(PreflightError, match="--keep-checkpoints 0: give 1 or more"):
        plan_ray_job(_run_args(["--engine", "ray", "--keep-checkpoints", "0", str(script)]), 2, {})
    # retention: the script's own by default (a variable the workers read), or Ray's num_to_keep
    assert fixed.keep_checkpoints is None and fixed.environment == {"LOCKSTEP_RAY_CHECKPOINTS": "as-the-script"}
    kept = plan_ray_job(_run_args(["--engine", "ray", "--keep-checkpoints", "3", str(script)]), 2, {"A": "1"})
    assert kept.keep_checkpoints == 3 and kept.environment == {"A": "1"}


def test_a_ray_job_too_large_for_the_cluster_and_its_workers_failures_are_said_in_one_line(tmp_path):
    """A fixed count beyond the cluster's CPUs waited without end (Ray retries its start timeout); a script's
    non-zero exit came back as a TypeError (WorkerError could not be unpickled); a lost node's failure line
    ended with Ray's 'Training failed due to worker errors:' and nothing after it."""
    import pickle

    from lockstep.errors import WorkerError
    from lockstep.runtime.launch.ray_engine import _failures, _too_few_resources, plan_ray_job

    script = tmp_path / "train.py"
    script.write_text("")
    fixed = plan_ray_job(_run_args(["--engine", "ray", "--nodes", "2", str(script)]), 4, {})
    assert _too_few_resources(fixed, False, {"CPU": 4.0}) == "4 CPUs for 8 workers"
    assert _too_few_resources(fixed, True, {"CPU": 16.0, "GPU": 2.0}) == "2 GPUs for 8 workers"
    assert _too_few_resources(fixed, False, {"CPU": 8.0}) == ""
    elastic = plan_ray_job(_run_args(["--engine", "ray", "--nodes", "1:2", str(script)]), 4, {})
    assert _too_few_resources(elastic, False, {"CPU": 1.0}) == ""  # an elastic job waits for its nodes
    exited = pickle.loads(pickle.dumps(WorkerError("rank 1: train.py exited with status 3", 1)))
    assert (str(exited), exited.rank) == ("rank 1: train.py exited with status 3", 1)

    class WorkerGroupError(RuntimeError):  # Ray's: its message cut short, the failures by rank beside it
        def __init__(self) -> None:
            super().__init__("Training failed due to worker errors:\n")
            self.worker_failures = {3: RuntimeError("ActorDiedError: the worker on 127.0.0.3 died"), 0: exited}

    assert _failures(WorkerGroupError()) == ("rank 0: rank 1: train.py exited with status 3; rank 3: "
                                             "ActorDiedError: the worker on 127.0.0.3 died")
    # degrees that do not fit the workers: refused before any Ray worker starts (before: after 20 s, on them)
    done = subprocess.run([sys.executable, "-m", "lockstep.cli.main", "run", "--engine", "ray", "--parallel", "tp=3",
                           "--devices", "2", "--accelerator", "cpu", str(script)], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "RAY_ADDRESS": "127.0.0.1:1"})
    assert done.returncode == 2 and "--parallel tp=3: Parallel(tp=3) needs a world size divisible" in done.stderr


def test_ray_workers_get_the_caller_s_environment_less_the_variables_of_its_own_host():
    from lockstep.runtime.launch.ray_engine import forwarded_environment

    caller = {"WANDB_MODE": "offline", "HF_HOME": "/data/hf", "MY_FLAG": "1", "LOCKSTEP_TIMEOUT": "60",
              "PATH": "/usr/bin", "HOME": "/root", "CUDA_VISIBLE_DEVICES": "0", "RANK": "3", "RAY_ADDRESS": "h:1",
              "SLURM_JOB_ID": "7", "LOCKSTEP_JOB_SECRET": "s", "VIRTUAL_ENV": "/venv", "CONDA_PREFIX": "/c"}
    assert forwarded_environment(caller) == {"WANDB_MODE": "offline", "HF_HOME": "/data/hf", "MY_FLAG": "1",
                                             "LOCKSTEP_TIMEOUT": "60"}


@pytest.mark.timeout(120)
def test_lockstep_run_chooses_one_engine_and_refuses_the_replica_options_without_fault_tolerant(tmp_path):
    """--replicas, --min-replicas and --step-timeout set the replica groups of a fault-tolerant job: given
    without --fault-tolerant (to the torch or the Ray engine), they are refused before anything starts."""
    from lockstep.cli.run import _Checks
    from lockstep.errors import PreflightError
    from lockstep.runtime.launch.engines import RayTrain, ReplicaGroups, TorchElastic, engine_for
    from lockstep.runtime.launch.request import with_orchestrator_defaults

    script = tmp_path / "train.py"
    script.write_text("")
    kinds = {(): TorchElastic, ("--fault-tolerant",): ReplicaGroups, ("--engine", "ray"): RayTrain}
    for argv, kind in kinds.items():
        assert type(engine_for(_run_args([*argv, str(script)]), _Checks(), print)) is kind
    for engine in ((), ("--engine", "ray")):
        for option, value in (("--replicas", "3"), ("--min-replicas", "2"), ("--step-timeout", "-1")):
            request, _ = with_orchestrator_defaults(_run_args([*engine, option, value, str(script)]), {})
            with pytest.raises(PreflightError, match=f"{option} without --fault-tolerant"):
                engine_for(request, _Checks(), print).plan(request)
    ray_ft, _ = with_orchestrator_defaults(_run_args(["--engine", "ray", "--fault-tolerant", "--replicas", "3",
                                                      str(script)]), {})
    with pytest.raises(PreflightError, match="--fault-tolerant is for the torch engine"):
        engine_for(ray_ft, _Checks(), print).plan(ray_ft)
    done = subprocess.run([sys.executable, "-m", "lockstep.cli.main", "run", "--step-timeout", "5", str(script)],
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 2 and "--step-timeout without --fault-tolerant" in done.stderr, done.stderr
    for engine in ((), ("--fault-tolerant",)):  # Ray's options given to another engine
        for option, value in (("--storage", "st"), ("--keep-checkpoints", "2"), ("--resize-interval", "5")):
            request, _ = with_orchestrator_defaults(_run_args([*engine, option, value, str(script)]), {})
            with pytest.raises(PreflightError, match=f"{option} without --engine ray"):
                engine_for(request, _Checks(), print).plan(request)


def test_a_rank_s_stream_writes_whole_lines_with_its_prefix_also_after_a_carriage_return(tmp_path):
    """The stream ``lockstep.env.lines`` puts in place of stdout: one write per line, the prefix at each line's
    start (also where a progress bar's carriage return starts it again), a partial line held until its end."""
    import io
    import os

    from lockstep.env import lines
    from lockstep.errors import ConfigError

    path = tmp_path / "out"
    with open(path, "w") as target:
        writes: list[bytes] = []
        real_write = os.write

        def counting(fd: int, data) -> int:
            writes.append(bytes(data))
            return real_write(fd, data)

        stream = lines._lined(target, "[rank 2] ")  # type: ignore[arg-type]
        os.write = counting  # type: ignore[assignment]
        try:
            for piece in ("a", " ", "b", "\n"):
                stream.write(piece)
            stream.write("50%\r100%\nlast")
            stream.flush()
        finally:
            os.write = real_write  # type: ignore[assignment]
    assert path.read_bytes() == b"[rank 2] a b\n[rank 2] 50%\r[rank 2] 100%\n[rank 2] last"
    assert writes[0] == b"[rank 2] a b\n"  # the print's four pieces: one write
    with pytest.raises(ConfigError, match="LOCKSTEP_SHOW_RANKS 'a,b': give the ranks"):
        lines.shown_ranks("a,b")
    assert lines.shown_ranks(" 3,0,") == {0, 3}
    assert isinstance(stream, io.TextIOWrapper)


@pytest.mark.parametrize("env", [
    {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "0", "LOCAL_RANK": "0", "MASTER_PORT": "1234"},
    {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "0",
     "OMPI_COMM_WORLD_LOCAL_RANK": "0"},
])
def test_zero_processes_on_a_node_is_said_not_divided_by(env):
    """Before: a ZeroDivisionError from lockstep env, lockstep doctor and every Runtime."""
    with pytest.raises(EnvError, match="0 processes on this node|_LOCAL_SIZE=0: the processes on this node"):
        DistEnv.from_environ(env, argv=[])
