"""Checkpoints: a killed run resumes to the bitwise-same model; damaged files never win."""

from __future__ import annotations

import json
import pickle
import shutil

import pytest
import torch

from checks import trainer as tc
from lockstep.errors import CheckpointError, NoSuchCheckpointError
from lockstep.runtime import complete_checkpoints
from lockstep.runtime.checkpoint.format import read_metadata

pytestmark = pytest.mark.timeout(180)


def test_complete_checkpoints_reads_folder_metadata_and_ignores_partial_saves_and_links(tmp_path):
    def folder(name: str, step: int | None) -> None:
        (tmp_path / name).mkdir()
        if step is not None:
            (tmp_path / name / "lockstep.json").write_text(json.dumps({"format": 2, "step": step}))

    folder("epoch=0-step=00000005.ckpt", 5)
    folder("epoch=1-step=00000009.ckpt", 9)
    folder(".epoch=2-step=00000012.ckpt.partial", 12)  # a save that was interrupted: never renamed
    folder("epoch=3-step=00000015.ckpt", None)  # no metadata: not complete
    (tmp_path / "epoch=4-step=00000020.ckpt").mkdir()
    (tmp_path / "epoch=4-step=00000020.ckpt" / "lockstep.json").write_text("{not json")  # damaged metadata
    (tmp_path / "last.ckpt").symlink_to("epoch=1-step=00000009.ckpt")
    found = complete_checkpoints(tmp_path)
    assert [(c.path, c.step) for c in found] == [(tmp_path / "epoch=1-step=00000009.ckpt", 9),
                                                 (tmp_path / "epoch=0-step=00000005.ckpt", 5)]


def test_unusable_checkpoints_say_why(tmp_path):
    (tmp_path / "newer").mkdir()
    (tmp_path / "newer" / "lockstep.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(CheckpointError, match="written by a newer lockstep .* format 99"):
        read_metadata(tmp_path / "newer")
    with pytest.raises(CheckpointError, match="missing: no such file or folder"):
        read_metadata(tmp_path / "missing")
    (tmp_path / "interrupted").mkdir()
    (tmp_path / "interrupted" / "lockstep.json").write_text("{cut sho")
    with pytest.raises(CheckpointError, match="not a complete lockstep checkpoint"):
        read_metadata(tmp_path / "interrupted")
    trainer = tc.quiet_trainer(max_steps=2, resume=tmp_path / "missing")
    with pytest.raises(NoSuchCheckpointError, match=r"resume='.*missing': no such checkpoint\.$"):
        trainer.fit(tc.Classifier(), tc.checks.make_data(32), batch_size=16)
    rt = trainer.runtime
    with pytest.raises(NoSuchCheckpointError, match=r"missing: no such checkpoint\.$"):
        rt.latest_checkpoint(tmp_path / "missing", exact=True)
    for verify in (True, False):  # a path that is not there is missing, not "damaged"
        with pytest.raises(CheckpointError, match=r"missing: no such file or folder\. A lockstep checkpoint is a"):
            rt.load(tmp_path / "missing", {"model": rt.setup(torch.nn.Linear(2, 2))}, verify=verify)


def test_a_checkpoint_from_another_model_is_refused_by_name(tmp_path):
    trainer = tc.quiet_trainer(max_steps=2, checkpoint_dir=tmp_path)
    module = tc.Classifier()
    trainer.fit(module, tc.checks.make_data(32), batch_size=16)
    trainer.save_checkpoint(tmp_path / "small.ckpt")

    class Wider(tc.Classifier):
        def __init__(self):
            super().__init__()
            self.net[0] = torch.nn.Linear(8, 64)
            self.net[3] = torch.nn.Linear(64, 4)

    other = tc.quiet_trainer(max_steps=4, resume=tmp_path / "small.ckpt")
    with pytest.raises(CheckpointError, match="Size mismatch .* for model.model.net.0.weight.*different model"):
        other.fit(Wider(), tc.checks.make_data(32), batch_size=16)


@pytest.mark.parametrize("damage", ["metadata cut", "metadata garbage", "shard cut"])
def test_a_damaged_file_loaded_without_its_checksums_is_called_damaged_not_another_model(tmp_path, damage):
    """With the checksums skipped (verify=False, or a folder without them), a damaged file is refused as
    damaged, with the command that names it; not blamed on the model (which is the same)."""
    import lockstep

    rt = lockstep.Runtime(accelerator="cpu", env=lockstep.DistEnv())
    model = rt.setup(torch.nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rt.save(tmp_path / "ck", {"model": model, "optimizer": optimizer})
    name = ".metadata" if damage.startswith("metadata") else next(p.name for p in (tmp_path / "ck").iterdir()
                                                                   if p.suffix == ".distcp")
    file = tmp_path / "ck" / name
    content = file.read_bytes()
    file.write_bytes(b"hello" if damage == "metadata garbage" else content[: len(content) // 2])
    with pytest.raises(CheckpointError, match=r"damaged, not loaded: a file of it cannot be read .*lockstep "
                                              r"checkpoint verify") as refused:
        rt.load(tmp_path / "ck", {"model": model, "optimizer": optimizer}, verify=False)
    assert "different model" not in str(refused.value)
    with pytest.raises(CheckpointError, match=f"damaged, not loaded:\n  .*{name}"):
        rt.load(tmp_path / "ck", {"model": model, "optimizer": optimizer})  # the checksums name the file
    from lockstep.runtime.checkpoint.checkpointer import _load_error

    refused = _load_error(tmp_path / "ck", pickle.UnpicklingError("Weights only load failed. Unsupported global: X"))
    assert "damaged, not loaded" not in str(refused)  # read whole, refused by the weights-only load: not damage


def test_a_load_reads_the_checkpoints_metadata_file_once(tmp_path, monkeypatch):
    """DCP's .metadata (every tensor's name, shape and place: megabytes for a large model) is read once per
    load, although lockstep asks for it before DCP's own load does."""
    import lockstep
    from lockstep.runtime.checkpoint import integrity

    rt = lockstep.Runtime(accelerator="cpu", env=lockstep.DistEnv())
    model = rt.setup(torch.nn.Linear(4, 2))
    rt.save(tmp_path / "ck", {"model": model})
    read = integrity.read_dcp_metadata
    files: list[str] = []
    monkeypatch.setattr(integrity, "read_dcp_metadata", lambda folder, name: files.append(name) or read(folder, name))
    with torch.no_grad():
        saved = model.weight.clone()
        model.weight.zero_()
    rt.load(tmp_path / "ck", {"model": model}, verify=False)
    assert files == [".metadata"] and torch.equal(model.weight, saved)


def test_checkpoint_dir_alone_writes_checkpoints_and_resume_auto_continues(tmp_path):
    """The README's Trainer(checkpoint_dir=..., resume="auto") as written, with no ModelCheckpoint."""
    first = tc.quiet_trainer(max_epochs=2, checkpoint_dir=tmp_path, resume="auto")
    first.fit(tc.Classifier(), tc.checks.make_data(32), batch_size=16)
    assert (tmp_path / "epoch=2-step=00000004.ckpt" / "lockstep.json").is_file()
    assert (tmp_path / "last.ckpt").resolve() == (tmp_path / "epoch=2-step=00000004.ckpt").resolve()
    assert not (tmp_path / "epoch=1-step=00000002.ckpt").exists()  # the default keeps the newest, plus last
    module = tc.Classifier()
    second = tc.quiet_trainer(max_epochs=3, checkpoint_dir=tmp_path, resume="auto")
    second.fit(module, tc.checks.make_data(32), batch_size=16)
    assert second.global_step == 6  # resumed at step 4, then one more epoch
    whole = tc.quiet_trainer(max_epochs=3)
    reference = tc.Classifier()
    whole.fit(reference, tc.checks.make_data(32), batch_size=16)
    assert torch.equal(tc.checks.flat_weights(module), tc.checks.flat_weights(reference))


def test_one_process_saves_in_the_background_and_commits_on_wait(tmp_path):
    import lockstep

    rt = lockstep.Runtime(accelerator="cpu", env=lockstep.DistEnv())
    torch.manual_seed(0)
    model = rt.setup(torch.nn.Linear(64, 64))
    optimizer = torch.optim.AdamW(model.parameters())
    rt.backward(model(torch.randn(4, 64)).square().mean())
    optimizer.step()
    rt.save(tmp_path / "ckpt", {"model": model, "optimizer": optimizer, "step": 5}, blocking=False)
    assert rt._checkpoints.saving  # a background thread writes
    rt.wait_for_save()
    assert json.loads((tmp_path / "ckpt" / "lockstep.json").read_text())["format"] == 2
    fresh = rt.setup(torch.nn.Linear(64, 64))
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    state = rt.load(tmp_path / "ckpt", {"model": fresh, "optimizer": fresh_optimizer, "step": 0})
    assert state["step"] == 5 and torch.equal(fresh.weight, model.weight)
    moments = [o.state_dict()["state"][0]["exp_avg"] for o in (fresh_optimizer, optimizer)]
    assert torch.equal(*moments)



class _StreamClassifier(tc.Classifier):
    def training_step(self, batch, batch_idx):
        _, x, y = batch
        return super().training_step((x, y), batch_idx)

    def validation_step(self, batch, batch_idx):
        _, x, y = batch
        return super().validation_step((x, y), batch_idx)


def _ended_by_max_steps(tmp_path, stream: bool, steps: int, resume: str | None = None):
    """A fit of ``steps`` steps that ``max_steps`` ends inside an epoch (10 steps an epoch), with
    dropout (the random states must resume too) and validation data."""
    from checks import data as data_checks

    module = (_StreamClassifier if stream else tc.Classifier)(dropout=0.2)
    train = data_checks.IndexedStream(160) if stream else tc.checks.make_data(160)
    val = data_checks.IndexedStream(40) if stream else tc.checks.make_data(40)
    trainer = tc.quiet_trainer(max_steps=steps, checkpoint_dir=tmp_path, resume=resume, loggers=("csv",))
    trainer.fit(module, train, val, batch_size=16)
    return trainer, module


@pytest.mark.parametrize("stream", [False, True], ids=["map", "stream"])
def test_a_fit_ended_by_max_steps_inside_an_epoch_is_validated_and_saved_at_its_last_step(tmp_path, stream):
    """Map data cut in its second epoch; a stream cut within its first pass (the LLM case)."""
    from checks import data as data_checks

    cut, epoch = (7, 1) if stream else (15, 2)
    trainer, module = _ended_by_max_steps(tmp_path / "cut", stream, steps=cut)
    final = tmp_path / "cut" / "last.ckpt"
    metadata = read_metadata(final)
    assert metadata["step"] == cut and final.resolve().name == f"epoch={epoch}-step={cut:08d}.ckpt"
    assert metadata["epoch"] == epoch  # as in the name: epochs count from 1
    # its val_loss is that of the final weights, over the whole validation set
    val = data_checks.IndexedStream(40) if stream else tc.checks.make_data(40)
    again = tc.quiet_trainer().validate(module, val, batch_size=16)
    assert metadata["metrics"]["val_loss"] == pytest.approx(again["val_loss"], rel=1e-6)
    # one row per step in metrics.csv, the last step's validation on it
    rows = (tmp_path / "cut" / "metrics.csv").read_text().splitlines()
    assert [row.split(",")[0] for row in rows[1:]] == (["7"] if stream else ["10", "15"])

    # the resume from that checkpoint continues exactly: cut + more steps equal all the steps at once
    _, resumed = _ended_by_max_steps(tmp_path / "cut", stream, steps=25, resume="auto")
    _, whole = _ended_by_max_steps(tmp_path / "whole", stream, steps=25)
    assert torch.equal(tc.checks.flat_weights(resumed), tc.checks.flat_weights(whole))
    assert read_metadata(tmp_path / "cut" / "last.ckpt")["step"] == 25


def _own_loop(folder, steps: int, resume: bool, save_every: int = 0) -> tuple[int, dict[str, torch.Tensor]]:
    """A loop of the user's own on the runtime API: rt.loader, rt.save every few steps, rt.resume."""
    import lockstep

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(40, 6), torch.randn(40, 1))
    rt = lockstep.Runtime(accelerator="cpu", seed=3, env=lockstep.DistEnv())
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
    model, optimizer = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))
    loader = rt.loader(data, batch_size=8, shuffle=True)
    state = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0, "torch_rng": torch.get_rng_state()}
    found = rt.resume(folder, state) if resume else None
    start = step = found.step if found is not None else 0
    assert step == state["step"]
    if found is not None:
        torch.set_rng_state(state["torch_rng"])
    while step < steps:
        for x, y in loader:
            rt.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if save_every and step % save_every == 0:
                state.update(step=step, torch_rng=torch.get_rng_state())
                rt.save(folder / f"step={step:04d}", state, metadata={"step": step})
            if step == steps:
                break
    rt.close()
    return start, {k: v.clone() for k, v in model.state_dict().items()}


def test_the_runtime_api_resumes_from_the_newest_intact_checkpoint_of_a_folder_bitwise(tmp_path):
    """rt.resume (what the Trainer's resume='auto' does, for a loop of one's own): the newest checkpoint
    in the folder whose files are intact, skipping a damaged newer one; the resumed run ends bit-equal
    to an uninterrupted one."""
    import lockstep

    _, uninterrupted = _own_loop(tmp_path / "a", steps=12, resume=False)
    _own_loop(tmp_path / "b", steps=9, resume=False, save_every=3)  # interrupted after step 9
    damaged = tmp_path / "b" / "step=0009"
    shard = next(p for p in damaged.iterdir() if p.suffix == ".distcp")
    shard.write_bytes(b"\0" + shard.read_bytes()[1:])  # one byte flipped: its checksum no longer matches
    rt = lockstep.Runtime(accelerator="cpu", env=lockstep.DistEnv())
    assert rt.latest_checkpoint(tmp_path / "b").path.name == "step=0006"  # 9 is damaged
    assert rt.latest_checkpoint(tmp_path / "empty") is None  # nothing there: start from scratch
    with pytest.raises(CheckpointError, match="damaged, not resumed from"):
        rt.latest_checkpoint(damaged)  # a checkpoint named itself is never skipped over
    rt.close()
    start, resumed = _own_loop(tmp_path / "b", steps=12, resume=True)
    assert start == 6
    assert all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted)


def _epochs(folder, epochs: int, resume: str | None = None):
    """A fit of whole epochs (4 steps each) whose only checkpoint is the one fit saves at its end."""
    module = tc.Classifier(dropout=0.2)
    saver = tc.lockstep.ModelCheckpoint(every_n_epochs=5)  # never by the epoch rule within these fits
    trainer = tc.quiet_trainer(max_epochs=epochs, checkpoint_dir=folder, resume=resume, callbacks=[saver])
    trainer.fit(module, tc.checks.make_data(64), batch_size=16)
    return trainer, module


def test_a_fit_saved_after_its_last_epoch_ended_resumes_at_the_next_epoch_not_one_later(tmp_path):
    """The final checkpoint of a fit that ends with an epoch is written after that epoch's end ran (and
    its counter moved on): the resumed fit starts the next epoch, and ends at the uninterrupted weights."""
    _epochs(tmp_path / "cut", epochs=2)
    assert read_metadata(tmp_path / "cut" / "last.ckpt")["step"] == 8
    trainer, resumed = _epochs(tmp_path / "cut", epochs=4, resume="auto")
    _, whole = _epochs(tmp_path / "whole", epochs=4)
    assert trainer.global_step == 16 and trainer.current_epoch == 4
    assert torch.equal(tc.checks.flat_weights(resumed), tc.checks.flat_weights(whole))


class _Record:
    """Stands in for Ray Train's record (checkpoint/ray_record.py): what it was told, and its newest."""

    newest_path = None

    def __init__(self, rank, say) -> None:
        self.reports: list[tuple[str, int]] = []

    def report(self, path, metadata) -> None:
        assert (path / "lockstep.json").exists(), "reported before its commit"
        self.reports.append((path.name, metadata["step"]))

    def newest(self):
        return self.newest_path


def test_under_an_engine_that_records_checkpoints_each_commit_is_reported_and_its_newest_can_win(tmp_path,
                                                                                                monkeypatch):
    """A route that records checkpoints (Ray Train) is told of each committed checkpoint, in order: a
    blocking save at once, a background one when it is next waited for (every rank at the same point,
    as Ray's report is a barrier). At a resume its newest checkpoint (Ray's copy, perhaps of a folder
    this node never saw) is taken when it trained further than the folder's newest, and loads exactly."""
    import lockstep
    import lockstep.runtime.runtime as runtime_module

    monkeypatch.setattr(runtime_module, "RayRecord", _Record)
    env = lockstep.DistEnv(launcher="ray")
    assert env.capabilities.records_checkpoints and not lockstep.DistEnv().capabilities.records_checkpoints
    rt = lockstep.Runtime(accelerator="cpu", env=env, seed=0)
    model = rt.setup(tc.checks.make_model())
    record = rt._checkpoints.record
    assert isinstance(record, _Record)
    rt.save(tmp_path / "a" / "step=1", {"model": model}, metadata={"step": 1})
    assert record.reports == [("step=1", 1)]
    rt.save(tmp_path / "a" / "step=2", {"model": model}, blocking=False, metadata={"step": 2})
    assert record.reports == [("step=1", 1)]  # not yet: reported when waited for
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(1.0)
    rt.save(tmp_path / "elsewhere" / "step=5", {"model": model}, metadata={"step": 5})  # waits for step 2 first
    assert record.reports == [("step=1", 1), ("step=2", 2), ("step=5", 5)]
    rt.save(tmp_path / "a" / "step=3", {"model": model}, blocking=False, metadata={"step": 3})
    rt.wait_for_save()
    assert record.reports[-1] == ("step=3", 3)
    trained = {k: v.clone() for k, v in lockstep.unwrap(model).state_dict().items()}

    record.newest_path = tmp_path / "elsewhere" / "step=5"  # trained further than the folder's step 3
    fresh = rt.setup(tc.checks.make_model(seed=7))
    found = rt.resume(tmp_path / "a", {"model": fresh})
    assert found is not None and found.path == tmp_path / "elsewhere" / "step=5"
    assert all(torch.equal(v, trained[k]) for k, v in lockstep.unwrap(fresh).state_dict().items())
    record.newest_path = tmp_path / "a" / "step=2"  # older than the folder's newest: the folder wins
    assert rt.latest_checkpoint(tmp_path / "a").path.name == "step=3"
    record.newest_path = tmp_path / "missing"  # a record that holds nothing readable: the folder's, said
    assert rt.latest_checkpoint(tmp_path / "a").path.name == "step=3"
    rt.close()


def test_the_trainer_answers_an_engines_reclaim_notice_with_one_checkpoint_and_trains_on(tmp_path, monkeypatch,
                                                                                        capsys):
    """Under an engine that warns before it reclaims a node (Ray Train's drain notice), the Trainer saves one
    checkpoint at the step the notice is first seen (not again while the same notice stands; again for a
    second node), reports it, and the fit goes on to the uninterrupted weights; resuming from the notice's
    checkpoint also ends there."""
    import lockstep
    import lockstep.env.distenv as distenv
    import lockstep.runtime.runtime as runtime_module
    from lockstep.runtime.faults.preemption import ReclaimNotice

    monkeypatch.setattr(runtime_module, "RayRecord", _Record)
    monkeypatch.setattr(distenv, "_ray_nodes", lambda: None)  # no Ray is asked anything, whatever was imported
    for name, value in {"RAY_RAYLET_PID": "1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)  # a Ray Train worker of one
    told = {"nodes": 0}
    monkeypatch.setattr(ReclaimNotice, "count", lambda self: told["nodes"])

    class Notice(lockstep.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            told["nodes"] = 1 if trainer.global_step >= 3 else 0
            told["nodes"] += trainer.global_step >= 6

    def fit(folder, callbacks):
        module = tc.Classifier(dropout=0.2)
        trainer = tc.quiet_trainer(max_epochs=2, checkpoint_dir=folder, resume="auto", callbacks=callbacks)
        trainer.fit(module, tc.checks.make_data(64), batch_size=16)
        return trainer, tc.checks.flat_weights(module)

    uninterrupted = tc.checks.flat_weights(_epochs(tmp_path / "plain", 2)[1])
    trainer, weights = fit(tmp_path / "ray", [Notice()])
    assert trainer.runtime.env.launcher == "ray"
    noticed = sorted(p.name for p in (tmp_path / "ray").glob("*-preempted.ckpt"))
    assert noticed == ["epoch=1-step=00000003-preempted.ckpt", "epoch=2-step=00000006-preempted.ckpt"]
    assert [step for _, step in trainer.runtime._checkpoints.record.reports] == [3, 4, 6, 8]  # and the epochs'
    assert torch.equal(weights, uninterrupted)
    for later in (tmp_path / "ray").iterdir():  # the node went right after the first notice's checkpoint
        if later.is_symlink() or not later.is_dir():
            later.unlink()  # last.ckpt
        elif later.name != noticed[0]:
            shutil.rmtree(later)
    told["nodes"] = 0
    capsys.readouterr()
    _, resumed = fit(tmp_path / "ray", [])
    assert f"resumed from {tmp_path / 'ray' / noticed[0]}" in capsys.readouterr().out
    assert torch.equal(resumed, uninterrupted)


def test_a_checkpoint_whose_optimizer_groups_list_their_parameters_as_before_still_loads(tmp_path, monkeypatch):
    """Checkpoints store each optimizer hyperparameter per parameter name (pipeline stages each hold other
    parameters); one written before that, with a list of names per group, loads as it was written."""
    import json

    import lockstep
    import lockstep.runtime.checkpoint.parts as parts

    rt = lockstep.Runtime(accelerator="cpu", seed=0)
    model, optimizer = rt.setup(model := torch.nn.Linear(4, 3), torch.optim.Adam(model.parameters(), lr=0.1))
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    init = parts.ModelState.__init__
    with monkeypatch.context() as before:
        before.setattr(parts, "OPTIMIZERS_BY_PARAMETER", "by_group")
        before.setattr(parts.ModelState, "__init__", lambda self, m, o=(), by_parameter=True: init(self, m, o, False))
        rt.save(tmp_path / "old", {"model": model, "optimizer": optimizer})
    assert json.loads((tmp_path / "old" / "lockstep.json").read_text())["optimizer_layout"] == "by_group"
    fresh, again = rt.setup(new := torch.nn.Linear(4, 3), torch.optim.Adam(new.parameters(), lr=0.5))
    rt.load(tmp_path / "old", {"model": fresh, "optimizer": again})
    assert again.param_groups[0]["lr"] == 0.1
    for name in ("exp_avg", "exp_avg_sq"):
        assert torch.equal(again.state[again.param_groups[0]["params"][0]][name],
                           optimizer.state[optimizer.param_groups[0]["params"][0]][name])


@pytest.mark.parametrize("sharded", [False, True], ids=["ddp", "fsdp"])
def test_a_save_in_the_middle_of_an_accumulation_says_its_gradients_are_not_kept_and_one_after_a_step_does_not(
        tmp_path, sharded):
    """FSDP keeps a micro-step's gradients unsharded, where no param.grad shows them (it said nothing)."""
    import warnings

    import lockstep

    strategy = lockstep.FSDP(cpu_offload=True) if sharded else "auto"  # FSDP stays FSDP on one process so
    rt = lockstep.Runtime(accelerator="cpu", env=lockstep.DistEnv(), strategy=strategy)
    model = torch.nn.Linear(3, 2)
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with rt.no_sync(model):  # a micro-step: its gradients wait for the step
        rt.backward(model(torch.ones(4, 3)).square().mean())
    with pytest.warns(UserWarning, match="rt.save while 'model' holds gradients not yet stepped"):
        rt.save(tmp_path / "mid", {"model": model, "optimizer": optimizer})
    rt.backward(model(torch.ones(4, 3)).square().mean())  # the accumulation's last micro-batch
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)  # zeros, not None: nothing pending either
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rt.save(tmp_path / "after", {"model": model, "optimizer": optimizer})
    assert not [w for w in caught if "lockstep" in str(w.message)]
    rt.close()


def test_a_save_before_the_first_step_changes_nothing_and_resumes_with_no_optimizer_state(tmp_path):
    """DCP makes a fresh optimizer's state by a step at lr 0, which counts in Adam's step: the live run
    would take its bias correction from step 2 on (0.04 off after 3 steps), and so would a resume."""
    import lockstep

    def run(save: bool = False, resume: bool = False) -> tuple[torch.Tensor, float]:
        torch.manual_seed(0)
        rt = lockstep.Runtime(accelerator="cpu")
        model = torch.nn.Linear(4, 2)
        model, optimizer = rt.setup(model, torch.optim.Adam(model.parameters(), lr=0.1))
        if resume:
            rt.load(tmp_path / "start", {"model": model, "optimizer": optimizer})
            assert not optimizer.state
        if save:
            rt.save(tmp_path / "start", {"model": model, "optimizer": optimizer})
            assert not optimizer.state
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
        for _ in range(3):
            rt.backward(model(x).square().mean())
            optimizer.step()
            optimizer.zero_grad()
        return tc.checks.flat_weights(model), float(optimizer.state_dict()["state"][0]["step"])

    reference = run()
    for saved_or_resumed in (run(save=True), run(resume=True)):
        assert torch.equal(saved_or_resumed[0], reference[0]) and saved_or_resumed[1] == reference[1] == 3.0


def test_the_runtime_apis_checkpoint_holds_the_loss_scale_under_16_mixed(tmp_path):
    """rt.save of a model and its optimizer under 16-mixed keeps the GradScaler's scale (the Trainer's did):
    a resume continues with the scale it had, not torch's first one (512 against 32 after 12 steps)."""
    import lockstep

    def run(save_at: int | None = None, resume: bool = False) -> tuple[torch.Tensor, float]:
        torch.manual_seed(0)
        rt = lockstep.Runtime(accelerator="cpu", precision="16-mixed")
        model = torch.nn.Linear(4, 2)
        model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        state = {"model": model, "optimizer": optimizer}
        if resume:
            rt.load(tmp_path / "ck", state)
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)) * 1e3
        for step in range(4 if resume else 0, 12):
            rt.backward(model(x).square().mean())
            optimizer.step()
            optimizer.zero_grad()
            if step + 1 == save_at:
                rt.save(tmp_path / "ck", state)
        return tc.checks.flat_weights(model), rt.precision.scaler.get_scale()

    whole = run(save_at=4)
    resumed = run(resume=True)
    assert torch.equal(resumed[0], whole[0]) and resumed[1] == whole[1] == 32.0


def test_a_larger_models_checkpoint_is_refused_by_a_smaller_model(tmp_path):
    """DCP loads the keys it is asked for: the first layer of a two-layer checkpoint loaded silently into
    a one-layer model."""
    import lockstep

    rt = lockstep.Runtime(accelerator="cpu")
    rt.save(tmp_path / "two", {"model": rt.setup(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)))})
    with pytest.raises(CheckpointError, match=r"it holds 2 weight\(s\) this model does not have \(1.bias, 1.weight\)"):
        rt.load(tmp_path / "two", {"model": rt.setup(torch.nn.Sequential(torch.nn.Linear(4, 4)))})


def test_full_state_dict_on_one_process_under_fsdp_is_plain_tensors_a_plain_model_loads():
    """FSDP(cpu_offload=True) stays FSDP on one process: its state_dict holds DTensors, which came back as they
    were and did not load into a plain model."""
    import lockstep

    rt = lockstep.Runtime(accelerator="cpu", strategy=lockstep.FSDP(cpu_offload=True), seed=0)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    reference = {name: value.clone() for name, value in model.state_dict().items()}
    state = rt.full_state_dict(rt.setup(model))
    assert all(type(value) is torch.Tensor for value in state.values())
    plain = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    plain.load_state_dict(state)
    assert all(torch.equal(plain.state_dict()[name], value) for name, value in reference.items())


def test_resuming_with_another_number_of_schedulers_says_so(tmp_path):
    """Saved with a StepLR, resumed without one: a CheckpointError naming the schedulers (was zip()'s
    ValueError from inside the checkpoint's loading)."""
    class Scheduled(tc.Classifier):
        def configure_optimizers(self):
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
            return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1)}

    data = tc.checks.make_data(64)
    tc.quiet_trainer(max_steps=2, checkpoint_dir=tmp_path).fit(Scheduled(), data, batch_size=16)
    with pytest.raises(CheckpointError, match=r"holds 1 learning-rate scheduler\(s\) where configure_optimizers "
                                              r"returns 0"):
        tc.quiet_trainer(max_steps=4, checkpoint_dir=tmp_path, resume="auto").fit(tc.Classifier(), data,
                                                                                  batch_size=16)


def test_a_value_the_load_cannot_read_back_is_refused_when_saving(tmp_path):
    """Loading reads weights-only (it runs no code): a numpy scalar or a Path saved fine and then no load
    could read the checkpoint."""
    import pathlib

    import lockstep

    rt = lockstep.Runtime(accelerator="cpu")
    with pytest.raises(CheckpointError, match=r"state\['where'\] holds pathlib.PosixPath, which a checkpoint "
                                              r"cannot load back safely"):
        rt.save(tmp_path / "ck", {"step": 3, "where": pathlib.Path("runs")})
    assert not (tmp_path / "ck").exists()
    rt.save(tmp_path / "ck", {"step": 3, "where": "runs"})
    assert rt.load(tmp_path / "ck", {"step": 0, "where": None}) == {"step": 3, "where": "runs"}


class _HeadUsedLater(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x, use_head):
        h = self.body(x)
        return self.head(h) if use_head else h


@pytest.mark.parametrize("sharded", [False, True], ids=["whole", "fsdp"])
def test_a_parameter_without_optimizer_state_yet_saves_and_loads_without_it(tmp_path, sharded):
    """A head used from step 4 on has no Adam state when step 3 is saved: the load made up a state for it
    and then found no such key (refused as 'saved from a different model'). The resume equals the run."""
    import lockstep

    def run(save_at: int | None = None, resume: bool = False) -> dict[str, torch.Tensor] | None:
        strategy = lockstep.FSDP(cpu_offload=True) if sharded else "auto"
        rt = lockstep.Runtime(accelerator="cpu", seed=0, strategy=strategy)
        torch.manual_seed(0)
        model = _HeadUsedLater()
        model, optimizer = rt.setup(model, torch.optim.Adam(model.parameters(), lr=0.1))
        state = {"model": model, "optimizer": optimizer, "step": 0}
        if resume:
            rt.load(tmp_path / "ck", state)
        g = torch.Generator().manual_seed(1)
        xs = [torch.randn(8, 4, generator=g) for _ in range(6)]
        for step in range(state["step"], 6):
            rt.backward(model(xs[step], use_head=step >= 3).square().mean())
            optimizer.step()
            optimizer.zero_grad()
            if step + 1 == save_at:
                rt.save(tmp_path / "ck", {**state, "step": step + 1})
                return None
        return rt.full_state_dict(model)

    whole = run()
    run(save_at=3)
    resumed = run(resume=True)
    assert all(torch.equal(resumed[name], value) for name, value in whole.items())


def test_ray_copies_of_deleted_checkpoints_go_and_nothing_else_does(tmp_path, monkeypatch):
    """The record of Ray's copies (``as-the-script``) is read as untrusted: a copy whose source the script
    deleted goes; a name that is "..", a path or a link deletes nothing (it once emptied the experiment)."""
    from types import SimpleNamespace

    ray_train = pytest.importorskip("ray.train")
    from pyarrow.fs import LocalFileSystem

    from lockstep.runtime.checkpoint.ray_record import _SOURCES, RayRecord

    experiment = tmp_path / "experiment"
    run, other = experiment / "run", experiment / "other-run"
    (run / "step=1").mkdir(parents=True)
    other.mkdir()
    (other / "result.json").write_text("{}")
    (run / "linked").symlink_to(other)
    gone = str(tmp_path / "deleted-by-the-script")
    (run / _SOURCES).write_text(json.dumps({"step=1": gone, "..": gone, "../other-run": gone, str(other): gone,
                                            "linked": gone, "": gone, "step=9": 7}))
    storage = SimpleNamespace(storage_filesystem=LocalFileSystem(), experiment_fs_path=str(run))
    monkeypatch.setattr(ray_train, "get_context", lambda: SimpleNamespace(get_storage=lambda: storage))
    newest = tmp_path / "checkpoints" / "step=2"
    newest.mkdir(parents=True)
    RayRecord._keep_as_the_script(newest)
    assert not (run / "step=1").exists()  # its source is gone: Ray's copy goes too
    assert (other / "result.json").exists() and (run / "linked").is_symlink()
    assert json.loads((run / _SOURCES).read_text()) == {"step=2": str(newest.resolve())}


def _crafted(tmp_path, name: str, edit) -> tuple:
    """A one-process checkpoint of a Linear, its DCP metadata edited by ``edit`` and its checksums written
    again (anyone who can write the folder can), and the Checkpointer that saved it."""
    from torch import nn

    from lockstep.runtime.checkpoint.checkpointer import Checkpointer
    from lockstep.runtime.checkpoint.integrity import checksum_of
    from lockstep.runtime.checkpoint.parts import ModelState

    torch.manual_seed(0)
    checkpointer = Checkpointer(0, 1, barrier=lambda: None)
    for folder, model in ((tmp_path / "other", nn.Linear(4, 4)), (tmp_path / name, nn.Linear(4, 4))):
        checkpointer.save(folder, {"model": ModelState(model)}, {"n": 1}, {"step": 1})
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    edit(metadata, folder)
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    info = json.loads((folder / "lockstep.json").read_text())
    info["files"] = {p.name: dict(zip(("size", "xxh3"), checksum_of(p), strict=True)) for p in folder.iterdir()
                     if p.is_file() and p.name != "lockstep.json"}
    (folder / "lockstep.json").write_text(json.dumps(info))
    return folder, checkpointer, ModelState(nn.Linear(4, 4))


def _half(metadata, folder):
    metadata.state_dict_metadata["model.model.weight"].chunks[0].sizes = torch.Size([2, 4])


def _elsewhere(metadata, folder):
    for info in metadata.storage_data.values():
        info.relative_path = "../other/" + info.relative_path
    for shard in folder.glob("__*"):
        shard.unlink()


@pytest.mark.parametrize("edit, said", [(_half, "its chunks hold 8 of its 16 elements"),
                                        (_elsewhere, "not a file of its folder")])
@pytest.mark.parametrize("verify", [True, False])
def test_a_checkpoint_whose_metadata_was_crafted_is_refused_even_with_matching_checksums(tmp_path, edit, said,
                                                                                         verify):
    """DCP's metadata read as untrusted: chunks that leave part of a tensor out (the load kept the model's own
    values there) or shard paths outside the folder (another checkpoint's weights) are refused by `verify`
    and by a load, with or without checksums."""
    from lockstep.runtime.checkpoint.consolidate import problems_of

    folder, checkpointer, fresh = _crafted(tmp_path, "crafted", edit)
    assert any(said in problem for problem in problems_of(folder)), problems_of(folder)
    with pytest.raises(CheckpointError, match=said):
        checkpointer.load(folder, {"model": fresh}, read_metadata(folder), verify_files=verify)


def test_a_shard_left_off_the_commits_list_is_named_by_verify(tmp_path):
    from lockstep.runtime.checkpoint.consolidate import problems_of

    folder, _, _ = _crafted(tmp_path, "listed", lambda metadata, folder: None)
    info = json.loads((folder / "lockstep.json").read_text())
    info["files"] = {name: entry for name, entry in info["files"].items() if not name.startswith("__")}
    (folder / "lockstep.json").write_text(json.dumps(info))
    assert any("a file its commit did not list" in problem for problem in problems_of(folder)), problems_of(folder)


def test_a_save_replaces_a_checkpoint_a_link_or_an_empty_folder_and_refuses_to_delete_anything_else(tmp_path):
    """rt.save renamed whatever stood at its path aside and deleted it: a run's folder, its logs, a file."""
    import lockstep

    rt = lockstep.Runtime(accelerator="cpu", env=lockstep.DistEnv())
    model = torch.nn.Linear(2, 2)
    run = tmp_path / "run"
    (run / "step=1").mkdir(parents=True)
    (run / "metrics.csv").write_text("step,loss\n")
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    for taken, kept in ((run, ["metrics.csv", "step=1"]), (notes, None)):
        with pytest.raises(CheckpointError, match=f"cannot save to {taken}: it is "):
            rt.save(taken, {"model": model})
        assert (sorted(p.name for p in taken.iterdir()) == kept) if kept else taken.read_text() == "mine"
    (tmp_path / "empty").mkdir()
    for path in (tmp_path / "empty", tmp_path / "empty", run / "step=2"):  # an empty folder, then a checkpoint
        rt.save(path, {"model": model})
        assert (path / "lockstep.json").is_file()
    (tmp_path / "last.ckpt").symlink_to(run / "step=2")
    rt.save(tmp_path / "last.ckpt", {"model": model})
    assert (tmp_path / "last.ckpt").is_dir() and (run / "step=2" / "lockstep.json").is_file()
