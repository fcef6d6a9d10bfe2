"""Fault tolerance's pieces on one process: the settings, the loader's redrawn step, one replica group."""

from __future__ import annotations

import dataclasses
import importlib.util
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lockstep
from lockstep.env.fault_tolerance import FaultTolerance
from lockstep.errors import ConfigError, PreflightError, StateError
from lockstep.runtime.launch.plan import plan_replica_groups

pytestmark = pytest.mark.timeout(60)
HAS_TORCHFT = importlib.util.find_spec("torchft") is not None


def test_every_wait_derives_from_the_one_step_timeout():
    timeouts = FaultTolerance(step_timeout=30).timeouts()
    assert (timeouts.quorum, timeouts.collective, timeouts.connect) == (30.0, 30.0, 30.0)
    assert (timeouts.heartbeat, timeouts.join) == (1.5, 15.0)
    assert FaultTolerance(step_timeout=10).timeouts().heartbeat == 1.0  # at least 1 s
    assert FaultTolerance(step_timeout=600).timeouts().heartbeat == 5.0  # at most 5 s


@pytest.mark.parametrize("kwargs", [{"min_replicas": 0}, {"min_replicas": True}, {"step_timeout": 0},
                                    {"step_timeout": "30"}, {"start_with": 0}, {"start_with": 2.0}])
def test_bad_settings_are_refused_by_name(kwargs):
    with pytest.raises(ConfigError, match=next(iter(kwargs))):
        FaultTolerance(**kwargs)


def test_the_launcher_settings_are_read_from_the_environment():
    assert FaultTolerance.from_environ({}) is None
    config = FaultTolerance.from_environ({"LOCKSTEP_FAULT_TOLERANT": "1", "LOCKSTEP_MIN_REPLICAS": "2",
                                          "LOCKSTEP_STEP_TIMEOUT": "12.5", "LOCKSTEP_REPLICA_START_WITH": "4"})
    assert config == FaultTolerance(min_replicas=2, step_timeout=12.5, start_with=4)
    resolved = config.resolved({"LOCKSTEP_REPLICA_GROUP": "3", "LOCKSTEP_LIGHTHOUSE": "10.0.0.1:29510"})
    assert (resolved.replica_group, resolved.lighthouse) == (3, "http://10.0.0.1:29510")
    with pytest.raises(ConfigError, match="LOCKSTEP_REPLICA_GROUP"):
        config.resolved({"LOCKSTEP_LIGHTHOUSE": "h:1"})
    with pytest.raises(ConfigError, match="whole number"):
        config.resolved({"LOCKSTEP_REPLICA_GROUP": "two", "LOCKSTEP_LIGHTHOUSE": "h:1"})
    with pytest.raises(ConfigError, match="not a number"):
        FaultTolerance.from_environ({"LOCKSTEP_FAULT_TOLERANT": "1", "LOCKSTEP_MIN_REPLICAS": "x"})


def _args(**over):
    from lockstep.runtime.launch.request import RunRequest

    base = {"script": "train.py", "replicas": 2, "nodes": "1", "node_rank": 0, "master": None,
            "rdzv_endpoint": None, "min_replicas": 1, "step_timeout": 30.0, "devices": "4"}
    return RunRequest(**{**base, **over})


@pytest.mark.skipif(not HAS_TORCHFT, reason="torchft is not installed (the ft extra)")
def test_replica_groups_split_the_nodes_processes_and_gpus_evenly():
    assert plan_replica_groups(_args(), 4, None, gpus=False).devices == ["2", "2"]
    assert plan_replica_groups(_args(), 4, "1,3,5,7", gpus=True).devices == ["1,3", "5,7"]
    one = plan_replica_groups(_args(replicas=4), 4, None, gpus=True)
    assert (one.devices, one.first_index, one.hosts_lighthouse, one.lighthouse_host) == (
        ["0", "1", "2", "3"], 0, True, "127.0.0.1")
    # node 1 of 2 runs groups 2 and 3; node 0 (127.0.0.1 here) hosts the lighthouse at --master
    second = plan_replica_groups(_args(nodes="2", node_rank=1, master="127.0.0.1:29555", min_replicas=4), 4, None,
                                 gpus=False)
    assert (second.first_index, second.hosts_lighthouse, second.lighthouse_port) == (2, False, 29555)
    assert (one.job_groups, second.job_groups) == (4, 4)  # every group of the job, on every node
    for bad, match in (({"replicas": 3}, "must divide"), ({"min_replicas": 3}, "--min-replicas"),
                       ({"nodes": "1:2"}, "fixed number of nodes"), ({"step_timeout": 0.0}, "--step-timeout"),
                       ({"nodes": "2"}, "needs --master"), ({"nodes": "2", "node_rank": 2}, "--node-rank"),
                       ({"nodes": "2", "master": "127.0.0.1:1", "min_replicas": 5}, "give 1 to 4")):
        with pytest.raises(PreflightError, match=match):
            plan_replica_groups(_args(**bad), 4, None, gpus=False)


def test_a_loader_draws_the_step_its_gate_names_again_under_the_membership_of_then():
    """What a step that did not commit needs: the same global batch, split over the new members."""
    rt = lockstep.Runtime(accelerator="cpu", seed=0)
    data = torch.utils.data.TensorDataset(torch.arange(40))
    plan = {2: 1}  # before drawing step 2 (once), the gate names step 1 again and the membership grows to 2
    drawn = []

    def gate(loader, step):
        if step in plan:
            rt.membership.change(1, 2)
            return plan.pop(step)
        return step

    reference = [batch[0].tolist() for batch in rt.loader(data, batch_size=8, shuffle=True)]
    rt._loaders = dataclasses.replace(rt._loaders, gate=gate)
    loader = rt.loader(data, batch_size=8, shuffle=True)
    for (index,) in loader:
        drawn.append(index.tolist())
    assert drawn[:2] == reference[:2]
    assert drawn[2] == reference[1][4:]  # member 1 of 2: the second half
    assert drawn[3] == reference[2][4:] and len(drawn) == 6


@pytest.mark.skipif(not HAS_TORCHFT, reason="torchft is not installed (the ft extra)")
def test_one_replica_group_trains_as_a_plain_loop_and_asks_for_its_state_first():
    from lockstep.runtime.launch.replicas import Lighthouse

    house = Lighthouse(FaultTolerance(step_timeout=10))
    try:
        config = FaultTolerance(step_timeout=10, replica_group=0, lighthouse=house.address)
        rt = lockstep.Runtime(accelerator="cpu", seed=0, fault_tolerance=config)
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        plain = nn.Linear(4, 2)
        plain.load_state_dict(model.state_dict())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = rt.setup(model, optimizer)
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(24, 4, generator=g), torch.randint(0, 2, (24,), generator=g))
        loader = rt.loader(data, batch_size=8, shuffle=True)
        with pytest.raises(StateError, match="rt.resume"):
            next(iter(loader))
        state = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0}
        assert rt.resume("/nonexistent-checkpoints", state) is None
        committed, batches = [], []
        for x, y in loader:
            batches.append((x, y))
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
            committed.append(rt.step_committed)
        assert committed == [True] * 3 and rt.replication.fault_tolerant and rt.replication.step == 3
        reference = torch.optim.SGD(plain.parameters(), lr=0.1)
        for x, y in batches:
            F.cross_entropy(plain(x), y).backward()
            reference.step()
            reference.zero_grad()
        assert torch.allclose(lockstep.unwrap(model).weight, plain.weight, atol=1e-7)
        rt.close()
    finally:
        house.shutdown()


@pytest.mark.skipif(not HAS_TORCHFT, reason="torchft is not installed (the ft extra)")
@pytest.mark.parametrize("options", [{}, {"precision": "16-mixed", "gradient_clip_val": 100.0}],
                         ids=["32-true", "16-mixed-clipped"])
def test_a_trainer_step_that_does_not_commit_counts_nothing_and_draws_its_random_numbers_again(monkeypatch, options):
    """A replica group's step fails (a participant's error reaches its manager, as a lost peer's does):
    the batch comes again, and the fit ends as an uninterrupted one-process fit: its dropout masks (the
    random states are put back to the step's start), weights, samples seen and epoch loss (the failed
    try's logged loss is dropped). With 16-mixed and clipping, the failed step had unscaled its gradients
    (the grad scaler marks the optimizer): the next step unscales its own again."""
    from checks import dist as checks
    from checks import trainer as tc
    from lockstep.runtime.launch.replicas import Lighthouse

    def fit(fail_at: int | None) -> tuple[lockstep.Trainer, torch.Tensor]:
        failed = []

        class FailOnce(lockstep.Callback):
            def on_before_backward(self, trainer, module, loss):
                if trainer.global_step == fail_at and not failed:
                    failed.append(trainer.batches_done_in_epoch)
                    trainer.runtime.replication.manager.report_error(RuntimeError("a participant died"))

        module = tc.Classifier(dropout=0.5)
        trainer = tc.quiet_trainer(max_epochs=2, callbacks=[FailOnce()], **options)
        trainer.fit(module, checks.make_data(40), batch_size=8)
        assert failed == ([] if fail_at is None else [fail_at % 5])
        return trainer, checks.flat_weights(module)

    reference, weights = fit(None)
    house = Lighthouse(FaultTolerance(step_timeout=10))
    try:
        for name, value in {"LOCKSTEP_FAULT_TOLERANT": "1", "LOCKSTEP_REPLICA_GROUP": "0",
                            "LOCKSTEP_LIGHTHOUSE": house.address, "LOCKSTEP_STEP_TIMEOUT": "10"}.items():
            monkeypatch.setenv(name, value)
        trainer, ft_weights = fit(7)  # in the second epoch, whose loss is the one logged at the end
        assert trainer.runtime.replication.fault_tolerant and trainer.runtime.replication.step == 10
        trainer.runtime.close()
    finally:
        house.shutdown()
    assert (trainer.global_step, trainer.samples_seen) == (reference.global_step, reference.samples_seen) == (10, 80)
    assert torch.allclose(ft_weights, weights, atol=1e-6)
    assert trainer.callback_metrics["train_loss_epoch"] == pytest.approx(reference.callback_metrics["train_loss_epoch"],
                                                                         rel=1e-6)


@pytest.mark.skipif(not HAS_TORCHFT, reason="torchft is not installed (the ft extra)")
def test_a_group_left_out_of_one_quorum_does_not_leave_out_another_at_the_next():
    """The lighthouse's wait for live groups counts from the first that asked. Group c, left out of
    the last quorum, asked long before the others finished their step (0.7 s here): with a wait
    shorter than a step, a and c would form the quorum at once and b would be left out, then another
    group at every step after. Every live group is in it."""
    import threading
    from datetime import timedelta

    from torchft._torchft import LighthouseClient

    from lockstep.runtime.launch.replicas import Lighthouse

    house = Lighthouse(FaultTolerance(min_replicas=1, step_timeout=10))
    client = LighthouseClient(house.address, connect_timeout=timedelta(seconds=5))
    names, done, quorums = ["a", "b", "c"], threading.Event(), {}

    def beat() -> None:
        while not done.is_set():
            for name in names:
                client.heartbeat(name)
            time.sleep(0.1)

    def ask(name: str, after: float) -> None:
        time.sleep(after)
        quorum = client.quorum(replica_id=name, timeout=timedelta(seconds=20), address="", store_address="",
                               step=1, world_size=1, shrink_only=False)
        quorums[name] = sorted(member.replica_id for member in quorum.participants)

    beating = threading.Thread(target=beat, daemon=True)
    beating.start()
    try:
        time.sleep(0.3)  # every group heartbeats
        asking = [threading.Thread(target=ask, args=(name, after)) for name, after in (("c", 0.0), ("a", 0.7),
                                                                                        ("b", 0.8))]
        for thread in asking:
            thread.start()
        for thread in asking:
            thread.join(timeout=30)
    finally:
        done.set()
        beating.join(timeout=5)
        house.shutdown()
    assert quorums == {name: names for name in names}


class _Work:
    """An all-reduce that is still running at the first poll and done right after it."""

    def __init__(self) -> None:
        self.polls, self.asked = 0, 0

    def wait(self, timeout=None) -> bool:
        self.polls += 1
        if self.polls == 1:
            raise RuntimeError("Wait timeout")
        return True

    def is_completed(self) -> bool:
        self.asked += 1
        return self.asked > 1  # still running when the poll ran out, done right after


class _GoneStore:
    def check(self, keys):
        raise RuntimeError("Connection reset by peer")  # the store's host ended its job


def test_an_all_reduce_done_when_a_finished_peer_took_the_store_with_it_counts_as_done():
    """The first participant ends its job right after the step's all-reduce (its store goes with it):
    a slower participant whose all-reduce was done meanwhile takes it, not an alarm (it would not commit
    the step and train it again alone)."""
    from lockstep.runtime.fault_tolerance.alarm import Alarm

    alarm = Alarm(group_rank=0, connect_timeout=1, cuda=False)
    alarm._store, alarm._key = _GoneStore(), "failed-19"
    work = _Work()
    alarm.wait(work)  # no error
    assert work.polls == 2


class _Waiting(_Work):
    """An all-reduce that never ends."""

    def wait(self, timeout=None):
        self.polls += 1
        raise RuntimeError("Wait timeout")

    def is_completed(self):
        return False


class _Said:
    def check(self, keys):
        return keys == ["failed-19"]  # a participant said this step failed


@pytest.mark.parametrize("store, waits", [(_GoneStore(), 2), (_Said(), 1)])
def test_an_all_reduce_still_waiting_when_the_store_is_gone_or_a_failure_is_said_is_ended(store, waits):
    """A failure said in the store ends the wait at once; a store gone, after a grace for the
    all-reduce to end (its host may have ended after it), too."""
    from lockstep.errors import CollectiveError
    from lockstep.runtime.fault_tolerance.alarm import Alarm

    alarm = Alarm(group_rank=0, connect_timeout=1, cuda=False)
    alarm._store, alarm._key = store, "failed-19"
    work = _Waiting()
    with pytest.raises(CollectiveError, match="another participant's all-reduce of this step failed"):
        alarm.wait(work)
    assert work.polls == waits


def test_a_replica_that_is_not_one_of_the_jobs_groups_is_refused_by_name():
    """The lighthouse takes any replica id: one that is not ``lockstep_<group>:<uuid>`` in a quorum is refused
    with what to do, not an IndexError (its gradients would go into every group's step)."""
    from lockstep.errors import CollectiveError
    from lockstep.runtime.fault_tolerance.groups import _group_index

    assert _group_index("lockstep_3:0b6c3a52-1f0e-4c1e-9a43-2f1e9c3b7d10") == 3
    for forged in ("evil", "lockstep_x:1", "lockstep_1", "lockstep_1:uuid;rm", None, "\x1b[2Jlockstep_1:ab"):
        with pytest.raises(CollectiveError, match="not one of this job's groups joined the lighthouse"):
            _group_index(forged)


@pytest.mark.skipif(not HAS_TORCHFT, reason="the ft extra")
def test_a_step_that_does_not_commit_steps_none_of_the_optimizers():
    """Two optimizers, one replica group; the first step fails (a participant died): neither optimizer steps
    (the second once stepped: its vote was read only while the step was undecided); the step is drawn again."""
    from lockstep.runtime.launch.replicas import Lighthouse

    house = Lighthouse(FaultTolerance(step_timeout=10))
    try:
        config = FaultTolerance(step_timeout=10, replica_group=0, lighthouse=house.address)
        rt = lockstep.Runtime(accelerator="cpu", seed=0, fault_tolerance=config)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        first, second = (torch.optim.SGD(model[i].parameters(), lr=0.1) for i in (0, 1))
        model, first, second = rt.setup(model, first, second)
        generator = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(torch.randn(24, 4, generator=generator),
                                              torch.randint(0, 2, (24,), generator=generator))
        loader = rt.loader(data, batch_size=8, num_workers=0)
        rt.resume("/nonexistent-checkpoints", {"model": model, "first": first, "second": second, "loader": loader})
        plain = lockstep.unwrap(model)
        seen = []
        for x, y in loader:
            before = [p.detach().clone() for p in plain.parameters()]
            F.cross_entropy(model(x), y).backward()
            if not seen:
                rt.replication.manager.report_error(RuntimeError("a participant died"))
            first.step()
            second.step()
            first.zero_grad()
            second.zero_grad()
            changed = [not torch.equal(b, p) for b, p in zip(before, plain.parameters(), strict=True)]
            seen.append((rt.step_committed, changed))
        rt.close()
    finally:
        house.shutdown()
    assert seen[0] == (False, [False] * 4)
    assert all(committed and all(changed) for committed, changed in seen[1:]) and len(seen) == 4
