"""Checkpoints under damage and distrust: a damaged file is found and skipped, a crafted file never
runs code, and cleaning up never deletes anything but the run's own checkpoints."""

from __future__ import annotations

import concurrent.futures
import json
import os
import pickle
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import lockstep
from checks import trainer as tc
from lockstep.runtime.checkpoint.integrity import checksum_of
from lockstep.train.callbacks import ModelCheckpoint
from lockstep.train.checkpoint import CheckpointError

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


def _fit(folder: Path | None, max_steps: int, resume=None, **checkpointing) -> tc.Classifier:
    callbacks = [ModelCheckpoint(every_n_steps=2, every_n_epochs=None, **checkpointing)] if checkpointing else []
    module = tc.Classifier()
    trainer = tc.quiet_trainer(max_steps=max_steps, checkpoint_dir=folder, resume=resume, callbacks=callbacks)
    trainer.fit(module, tc.checks.make_data(64), batch_size=16)
    return module


@pytest.fixture(scope="module")
def uninterrupted() -> torch.Tensor:
    return tc.checks.flat_weights(_fit(None, max_steps=10))


def _shard(checkpoint: Path) -> Path:
    return next(checkpoint.glob("__0_*.distcp"))


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 64):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "flipped tensor bytes": (lambda c: _flip(_shard(c)), "its checksum differs"),
    "a truncated shard": (lambda c: _truncate(_shard(c)), "truncated or damaged"),
    "a deleted shard": (lambda c: _shard(c).unlink(), "missing"),
    "a damaged .metadata": (lambda c: _flip(c / ".metadata"), "its checksum differs"),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_resume_auto_skips_a_damaged_checkpoint_and_ends_at_the_uninterrupted_weights(
        damage, uninterrupted, tmp_path, capsys):
    _fit(tmp_path, max_steps=6, save_top_k=-1)  # checkpoints at steps 2, 4, 6
    newest = tmp_path / "epoch=2-step=00000006.ckpt"
    harm, why = DAMAGE[damage]
    harm(newest)
    with pytest.raises(CheckpointError, match=f"{newest.name}: damaged, not resumed from"):
        _fit(None, max_steps=10, resume=newest)  # named explicitly: refused, never "another model"
    capsys.readouterr()
    resumed = _fit(tmp_path, max_steps=10, resume="auto", save_top_k=-1)
    out = capsys.readouterr().out
    assert f"skipping the damaged checkpoint {newest.name}" in out and why in out, out
    assert "resumed from" in out and "after step 4." in out
    assert torch.equal(tc.checks.flat_weights(resumed), uninterrupted)
    # the resumed fit's step 6 replaced the damaged checkpoint (before, a save at its name was skipped: a fit
    # resumed after this one would have passed over it again)
    assert f"{newest.name} in {tmp_path} (passed over as damaged): this fit's checkpoints replace them" in out
    assert lockstep.Runtime(accelerator="cpu").verify_checkpoint(newest) == []
    assert (tmp_path / "last.ckpt").resolve().name == "epoch=3-step=00000010.ckpt"


def test_lockstep_checkpoint_verify_names_the_damaged_file(tmp_path):
    _fit(tmp_path, max_steps=2, save_top_k=1)
    checkpoint = tmp_path / "epoch=1-step=00000002.ckpt"
    cli = [sys.executable, "-m", "lockstep.cli.main", "checkpoint", "verify", str(checkpoint)]
    intact = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert intact.returncode == 0 and "intact (3 files match their checksums)" in intact.stdout, intact.stderr
    _flip(_shard(checkpoint))
    damaged = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert damaged.returncode == 1 and f"{_shard(checkpoint)}: its checksum differs" in damaged.stderr


class _RunsCode:
    """Unpickled, it runs a shell command: what a crafted checkpoint can carry."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _update_checksum(checkpoint: Path, name: str) -> None:
    """What whoever plants a file does too: checksums find damage, not tampering."""
    info = json.loads((checkpoint / "lockstep.json").read_text())
    size, digest = checksum_of(checkpoint / name)
    info["files"][name] = {"size": size, "xxh3": digest}
    (checkpoint / "lockstep.json").write_text(json.dumps(info))


def _crafted(tmp_path: Path, where: str, marker: Path) -> Path:
    module = tc.Classifier()
    trainer = tc.quiet_trainer(max_steps=2)
    trainer.fit(module, tc.checks.make_data(64), batch_size=16)
    checkpoint = tmp_path / "crafted.ckpt"
    if where == "optimizer entry":
        trainer.optimizers[0].param_groups[0]["lr"] = _RunsCode(marker)  # an entry every load reads
        trainer.save_checkpoint(checkpoint)
    else:
        trainer.save_checkpoint(checkpoint)
        with open(checkpoint / ".metadata", "wb") as handle:
            pickle.dump(_RunsCode(marker), handle)
        _update_checksum(checkpoint, ".metadata")
    assert not marker.exists()
    return checkpoint


def _rt_load(checkpoint: Path) -> None:
    rt = lockstep.Runtime(accelerator="cpu", env=lockstep.DistEnv())
    module = tc.Classifier()
    model, optimizer = rt.setup(module, module.configure_optimizers())
    rt.load(checkpoint, {"model": model, "optimizer": optimizer})


def _resume(checkpoint: Path) -> None:
    _fit(None, max_steps=4, resume=checkpoint)


def _cli(action: str):
    def run(checkpoint: Path) -> None:
        extra = [str(checkpoint.parent / "out.pt")] if action == "consolidate" else []
        done = subprocess.run([sys.executable, "-m", "lockstep.cli.main", "checkpoint", action, str(checkpoint),
                               *extra], capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise CheckpointError(done.stderr)
    return run


PATHS = {"rt.load": _rt_load, "resume": _resume, "inspect": _cli("inspect"), "consolidate": _cli("consolidate"),
         "verify": _cli("verify")}


@pytest.mark.parametrize("where", [".metadata", "optimizer entry"])
def test_a_planted_pickle_runs_in_none_of_the_five_ways_to_read_a_checkpoint(where, tmp_path):
    marker = tmp_path / "code-ran"
    checkpoint = _crafted(tmp_path, where, marker)
    refused = []
    for name, read in PATHS.items():
        try:
            read(checkpoint)
        except CheckpointError as error:
            assert "may run code" in str(error) or "refused" in str(error), str(error)
            refused.append(name)
        assert not marker.exists(), f"{name} ran the code planted in the {where}"
    if where == ".metadata":
        assert refused == list(PATHS)  # nothing reads the folder without its metadata
    else:
        assert {"rt.load", "resume"} <= set(refused)  # the commands that load the entry refuse it


def test_a_copied_run_folder_resumes_without_touching_the_original(tmp_path):
    original = tmp_path / "run"
    _fit(original, max_steps=4, save_top_k=1)
    before = {p.relative_to(original): p.read_bytes() for p in original.rglob("*") if p.is_file()}
    assert before
    copy = tmp_path / "variant"
    shutil.copytree(original, copy, symlinks=True)
    _fit(copy, max_steps=8, resume="auto", save_top_k=1)
    after = {p.relative_to(original): p.read_bytes() for p in original.rglob("*") if p.is_file()}
    assert after == before
    assert [p.name for p in copy.iterdir() if p.name.startswith("epoch=")] == ["epoch=2-step=00000008.ckpt"]


def test_cleanup_never_follows_a_link_out_of_the_checkpoint_folder(tmp_path):
    outside = tmp_path / "elsewhere" / "epoch=0-step=00000001.ckpt"
    outside.mkdir(parents=True)
    (outside / "lockstep.json").write_text(json.dumps({"format": 2, "step": 1}))
    (outside / "precious").write_text("keep me")
    run = tmp_path / "run"
    run.mkdir()
    (run / outside.name).symlink_to(outside)  # named like a checkpoint, pointing out of the folder
    _fit(run, max_steps=6, save_top_k=1)
    assert (outside / "precious").read_text() == "keep me"


def test_an_unwritable_checkpoint_folder_fails_before_training_naming_it(tmp_path):
    (tmp_path / "a-file").write_text("")
    folder = tmp_path / "a-file" / "checkpoints"  # cannot be made, not even by root
    with pytest.raises(CheckpointError, match=f"cannot write checkpoints into {folder}: rank 0 on .*Not a directory"):
        _fit(folder, max_steps=2, save_top_k=1)


def test_partial_folders_of_interrupted_saves_are_removed_at_the_next_start(tmp_path):
    leftover = tmp_path / ".epoch=0-step=00000002.ckpt.partial"
    leftover.mkdir(parents=True)
    (leftover / "__0_0.distcp").write_bytes(b"x" * 1000)
    _fit(tmp_path, max_steps=2, save_top_k=1)
    assert not leftover.exists()


def _one_process_model():
    rt = lockstep.Runtime(accelerator="cpu", env=lockstep.DistEnv())
    model = torch.nn.Linear(512, 512)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = rt.setup(model, optimizer)
    return rt, model, optimizer


def _step(rt, model, optimizer) -> None:
    rt.backward(model(torch.randn(4, 512)).square().mean())
    optimizer.step()
    optimizer.zero_grad()


def test_a_failed_background_save_is_raised_at_the_next_step_and_leaves_no_partial_folder(tmp_path, monkeypatch):
    import lockstep.runtime.checkpoint.checkpointer as checkpoint

    def failing(*args, **kwargs):
        raise OSError("injected failure while committing")

    rt, model, optimizer = _one_process_model()
    monkeypatch.setattr(checkpoint, "files_written_by", failing)
    rt.save(tmp_path / "ckpt", {"model": model, "optimizer": optimizer}, blocking=False)
    pending = rt._checkpoints._checkpointer._pending
    assert pending is not None
    concurrent.futures.wait([pending], timeout=30)
    with pytest.raises(OSError, match="injected failure while committing"):
        _step(rt, model, optimizer)  # the very next step, not the next save
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / ".ckpt.partial").exists()
    _step(rt, model, optimizer)  # raised once; training can go on


def test_a_full_disk_is_said_plainly_and_leaves_no_partial_folder(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(small)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        rt, model, optimizer = _one_process_model()  # 1 MiB of weights
        with pytest.raises(CheckpointError, match=r"not saved, the disk is full \([\d,]+ bytes free on the file"):
            rt.save(small / "ckpt", {"model": model, "optimizer": optimizer})
        assert list(small.iterdir()) == []
    finally:
        subprocess.run(["umount", str(small)], capture_output=True)


def test_shards_are_checksummed_as_they_are_written_and_the_sums_match_the_files(tmp_path):
    import torch.distributed.checkpoint as dcp

    from lockstep.runtime.checkpoint.integrity import checksummed_writer

    model = torch.nn.Linear(300, 300)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 300)).sum().backward()
    optimizer.step()
    writer, files = checksummed_writer(tmp_path / "ckpt")
    with pytest.warns(UserWarning, match="torch.distributed is disabled"):
        dcp.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, storage_writer=writer,
                 no_dist=True)
    shards = sorted(p.name for p in (tmp_path / "ckpt").glob("__0_*.distcp"))
    assert shards and set(shards) <= set(files.sums)  # written in order: nothing needs reading back
    for name in shards:
        assert checksum_of(tmp_path / "ckpt" / name) == (files.sums[name]["size"], files.sums[name]["xxh3"])


def _fit_on_ranks(folder: str, max_steps: int, resume: str | None) -> torch.Tensor:
    return tc.checks.flat_weights(_fit(Path(folder), max_steps, resume=resume, save_top_k=-1))


def test_on_two_ranks_each_checks_its_share_and_both_skip_the_damaged_checkpoint(uninterrupted, tmp_path, capfd):
    from lockstep.testing import run_ranks

    run_ranks(_fit_on_ranks, 2, str(tmp_path), 6, None)
    newest = tmp_path / "epoch=2-step=00000006.ckpt"
    _flip(sorted(newest.glob("__1_*.distcp"))[0])  # a shard rank 1 wrote
    capfd.readouterr()
    resumed = run_ranks(_fit_on_ranks, 2, str(tmp_path), 10, "auto")
    out = capfd.readouterr().out
    assert f"skipping the damaged checkpoint {newest.name}" in out and "__1_0.distcp" in out, out
    assert "after step 4." in out
    for weights in resumed:
        assert torch.allclose(weights, uninterrupted, atol=1e-6, rtol=0)  # 2 ranks: equal up to summation order


def test_lockstep_checkpoint_verify_of_a_run_folder_checks_each_checkpoint_in_it(tmp_path):
    """A run folder (what resume="auto" scans) is verified checkpoint by checkpoint, not called damaged."""
    _fit(tmp_path, max_steps=6, save_top_k=-1)  # checkpoints at steps 2, 4, 6, and last.ckpt
    cli = [sys.executable, "-m", "lockstep.cli.main", "checkpoint", "verify", str(tmp_path)]
    intact = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert intact.returncode == 0, intact.stderr
    assert "a run folder, 3 of 3 checkpoint(s) intact; resume='auto' loads epoch=2-step=00000006.ckpt" in intact.stdout
    newest = tmp_path / "epoch=2-step=00000006.ckpt"
    _flip(_shard(newest))
    damaged = subprocess.run(cli, capture_output=True, text=True, timeout=60)
    assert damaged.returncode == 1 and f"{newest}: damaged or unsafe" in damaged.stderr, damaged.stderr
    assert "2 of 3 checkpoint(s) intact; resume='auto' loads epoch=1-step=00000004.ckpt" in damaged.stdout
    (tmp_path / "empty").mkdir()
    empty = subprocess.run([*cli[:-1], str(tmp_path / "empty")], capture_output=True, text=True, timeout=60)
    assert empty.returncode == 1 and "holds no checkpoint folder" in empty.stderr, empty.stderr


def test_the_checkpoint_commands_say_what_is_wrong_with_hostile_metadata_and_consolidate_writes_outside_them(
        tmp_path):
    """Before: a run folder whose newest lockstep.json was damaged verified as intact (it was passed over
    unsaid); deeply nested JSON raised a bare RecursionError; a pipe in the place of lockstep.json or .metadata
    was read without end; consolidate wrote over a checkpoint's own files (its shard, another's lockstep.json)."""
    _fit(tmp_path, max_steps=4, save_top_k=-1)  # checkpoints at steps 2 and 4
    older, newest = tmp_path / "epoch=1-step=00000002.ckpt", tmp_path / "epoch=1-step=00000004.ckpt"
    cli = [sys.executable, "-m", "lockstep.cli.main", "checkpoint"]
    out = tmp_path.parent / f"{tmp_path.name}-weights" / "model.pt"
    for target in (_shard(older), newest / "lockstep.json"):
        done = subprocess.run([*cli, "consolidate", str(older), str(target)], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 2 and "is inside the checkpoint" in done.stderr, done.stderr
    done = subprocess.run([*cli, "consolidate", str(older), str(out)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and set(torch.load(out)) and not list(out.parent.glob(".*partial")), done.stderr
    shutil.rmtree(out.parent)
    intact = subprocess.run([*cli, "verify", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert intact.returncode == 0 and "2 of 2 checkpoint(s) intact" in intact.stdout, intact.stderr
    (newest / "lockstep.json").write_text("[" * 200_000 + "]" * 200_000)
    damaged = subprocess.run([*cli, "verify", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert damaged.returncode == 1 and "1 of 2 checkpoint(s) intact" in damaged.stdout, damaged.stdout
    assert f"{newest}: not a complete lockstep checkpoint (RecursionError" in damaged.stderr, damaged.stderr
    (newest / "lockstep.json").unlink()
    os.mkfifo(newest / "lockstep.json")
    (older / ".metadata").unlink()
    os.mkfifo(older / ".metadata")
    for folder in (newest, older):
        for command in ("inspect", "verify"):
            done = subprocess.run([*cli, command, str(folder)], capture_output=True, text=True, timeout=60)
            assert done.returncode != 0 and "not a regular file" in done.stderr, done.stderr
