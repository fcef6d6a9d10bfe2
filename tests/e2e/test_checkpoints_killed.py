"""Checkpoints: a killed run resumes to the bitwise-same model; damaged files never win."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.timeout(180)


def _run(*args: str, restarts: int = 0, devices: int = 2) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lockstep.cli.main", "run", "--devices", str(devices),
                           "--accelerator", "cpu", "--max-restarts", str(restarts), "tests/scripts/trainer_resume.py",
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def _whole_then_killed_and_resumed(tmp_path: Path, *extra: str, devices: int = 2, kill_at: str = "8",
                                   resumed_at: int = 6) -> tuple[dict, dict]:
    """An uninterrupted run, then one whose rank 1 SIGKILLs itself (at step ``kill_at``, or as the
    extra arguments say) and is rerun to resume.

    Returns both runs' results after checking that the kill happened and the rerun resumed at
    step ``resumed_at``.
    """
    killed = _run(str(tmp_path / "resumed"), str(tmp_path / "resumed.pt"), kill_at, *extra,  # 7 steps/epoch
                  devices=devices)
    assert killed.returncode != 0
    if kill_at == "save":  # rank 0 may fail first, on the connection rank 1's death resets
        assert (tmp_path / "resumed.killed").exists()
    else:
        assert "signal SIGKILL" in killed.stderr
    assert not (tmp_path / "resumed.pt").exists()
    resumed = _run(str(tmp_path / "resumed"), str(tmp_path / "resumed.pt"), "-1", *extra, devices=devices)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout and f"step {resumed_at}." in resumed.stdout
    a, b = _uninterrupted(tmp_path, *extra, devices=devices), torch.load(tmp_path / "resumed.pt")
    assert a["steps"] == b["steps"] == 21
    return a, b


_UNINTERRUPTED: dict[tuple, dict] = {}


def _uninterrupted(tmp_path: Path, *extra: str, devices: int = 2) -> dict:
    """The uninterrupted run's result; each configuration is run once per session."""
    key = (*extra, devices)
    if key not in _UNINTERRUPTED:
        whole = _run(str(tmp_path / "whole"), str(tmp_path / "whole.pt"), "-1", *extra, devices=devices)
        assert whole.returncode == 0, whole.stderr
        _UNINTERRUPTED[key] = torch.load(tmp_path / "whole.pt")
    return _UNINTERRUPTED[key]


KILL_DURING_SAVE = """
import os, signal, sys, torch
from pathlib import Path
from lockstep.runtime.files import write_atomic
path = Path(sys.argv[1])
write_atomic(path, lambda handle: torch.save({"value": 1}, handle))
def dying_save(handle):
    handle.write(b"PK" + b"x" * 4096)  # part of a file, then the process dies
    handle.flush()
    os.kill(os.getpid(), signal.SIGKILL)
write_atomic(path, dying_save)
"""


def _stream_run(tmp_path: Path, name: str, kill_at: int, variant: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lockstep.cli.main", "run", "--devices", "2", "--accelerator", "cpu",
                           "tests/scripts/trainer_stream.py", str(tmp_path / name), str(tmp_path / f"{name}.pt"),
                           str(kill_at), variant], cwd=ROOT, capture_output=True, text=True, timeout=150)


def _rows(path: Path) -> list[tuple[int, str]]:
    import csv

    with open(path, newline="") as handle:
        return [(int(row["step"]), row["train_loss"]) for row in csv.DictReader(handle) if row.get("train_loss")]


def test_sigkill_mid_epoch_then_resume_is_bitwise_equal_to_an_uninterrupted_run(tmp_path):
    a, b = _whole_then_killed_and_resumed(tmp_path)
    assert torch.equal(a["weights"], b["weights"])
    # epoch 0 was interrupted: its epoch metric still covers all of its samples, both halves
    assert sorted(b["epoch_losses"]) == [0, 1, 2]
    for epoch in (0, 1, 2):
        assert b["epoch_losses"][epoch] == pytest.approx(a["epoch_losses"][epoch], rel=1e-12)
    # so was the logging window of steps 5-8: the value logged at step 8 covers all four steps
    assert sorted(b["step_losses"]) == [8, 12, 16, 20] and sorted(a["step_losses"]) == [4, 8, 12, 16, 20]
    for step in (8, 12, 16, 20):
        assert b["step_losses"][step] == pytest.approx(a["step_losses"][step], rel=1e-12)


def test_on_4_ranks_a_resume_is_bitwise_when_ddp_keeps_one_bucket_layout(tmp_path):
    """DDP sums a fresh model's first step in one bucket in definition order, later steps in rebuilt
    buckets: with more than 2 ranks the sums round differently, so a resume is bitwise only when DDP
    never rebuilds (find_unused_parameters=True); docs/trainer.md says so."""
    a, b = _whole_then_killed_and_resumed(tmp_path, "one-layout", devices=4)
    assert torch.equal(a["weights"], b["weights"])


def test_a_kill_between_shard_files_resumes_from_the_previous_complete_checkpoint(tmp_path):
    a, b = _whole_then_killed_and_resumed(tmp_path, kill_at="save", resumed_at=3)
    assert torch.equal(a["weights"], b["weights"])  # the step-6 save never committed: resumed at step 3


def test_elastic_restart_after_a_kill_continues_from_the_checkpoint_bitwise(tmp_path):
    start = time.monotonic()
    restarted = _run(str(tmp_path / "elastic"), str(tmp_path / "elastic.pt"), "8", restarts=1)
    assert restarted.returncode == 0, restarted.stderr
    assert time.monotonic() - start < 60
    assert "resumed from" in restarted.stdout and "step 6" in restarted.stdout  # the restarted group resumed
    a, b = _uninterrupted(tmp_path), torch.load(tmp_path / "elastic.pt")
    assert a["steps"] == b["steps"] == 21
    assert torch.equal(a["weights"], b["weights"])


def test_a_kill_during_checkpoint_writing_leaves_the_previous_checkpoint(tmp_path):
    path = tmp_path / "state.pt"
    done = subprocess.run([sys.executable, "-c", KILL_DURING_SAVE, str(path)], capture_output=True, timeout=60)
    assert done.returncode == -9
    assert torch.load(path)["value"] == 1
    assert list(tmp_path.glob(".state.pt.*.partial"))  # the interrupted write, never renamed


@pytest.mark.parametrize("variant", ["workers", "state", "shuffle"])
def test_a_trainer_on_a_hugging_face_stream_is_killed_and_resumes_exactly_with_its_logs(tmp_path, variant):
    """A stream without __len__ (2 loader workers; none, continuing from its own state; or a shuffle
    buffer whose own state would lose its buffer), checkpointed every 3 steps; rank 0 dies after
    step 14 and the rerun resumes at step 12. The weights equal an uninterrupted run's bitwise,
    the resumed ranks see the uninterrupted run's items from step 13 on, and metrics.csv /
    metrics.jsonl hold every logged step once, with the uninterrupted run's values."""
    pytest.importorskip("datasets")
    whole = _stream_run(tmp_path, "whole", -1, variant)
    assert whole.returncode == 0, whole.stderr
    killed = _stream_run(tmp_path, "resumed", 14, variant)
    assert killed.returncode != 0 and "signal SIGKILL" in killed.stderr
    resumed = _stream_run(tmp_path, "resumed", -1, variant)
    assert resumed.returncode == 0, resumed.stderr
    assert "in epoch 2 after its batch 2, after step 12." in resumed.stdout, resumed.stdout
    a, b = torch.load(tmp_path / "whole.pt"), torch.load(tmp_path / "resumed.pt")
    assert torch.equal(a["weights"], b["weights"])
    assert a["epoch"] == b["epoch"] == 2
    for rank in range(2):  # 5 items of each global batch of 10 per rank
        assert torch.equal(b["seen"][rank], a["seen"][rank][12 * 5:])
    steps = [step for step, _ in _rows(tmp_path / "whole" / "metrics.csv")]
    assert steps == list(range(2, 25, 2))
    assert _rows(tmp_path / "resumed" / "metrics.csv") == _rows(tmp_path / "whole" / "metrics.csv")
    logged = [json.loads(line) for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged if "train_loss" in r] == steps
    from lockstep.runtime.checkpoint.format import read_objects

    position = read_objects(tmp_path / "resumed" / "epoch=2-step=00000012.ckpt")["loader"]
    assert ("stream" in position) == (variant == "state")  # a shuffle buffer's own state is never used
    assert sorted(p.name for p in (tmp_path / "resumed").glob("epoch=*")) == [
        *(f"epoch=1-step={s:08d}.ckpt" for s in (3, 6, 9, 10)), *(f"epoch=2-step={s:08d}.ckpt" for s in (12, 15, 18)),
        "epoch=2-step=00000020.ckpt", *(f"epoch=3-step={s:08d}.ckpt" for s in (21, 24))]


def test_one_process_saves_in_the_background_without_a_torch_warning(tmp_path):
    script = ("import sys; sys.path.insert(0, 'tests'); import lockstep; from checks import trainer as tc\n"
              f"t = tc.quiet_trainer(max_epochs=2, checkpoint_dir={str(tmp_path)!r}, "
              "callbacks=[lockstep.ModelCheckpoint(async_save=True)])\n"
              "t.fit(tc.Classifier(), tc.checks.make_data(32), batch_size=8)\n")
    done = subprocess.run([sys.executable, "-W", "default", "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Warning" not in done.stderr, done.stderr
    assert (tmp_path / "epoch=2-step=00000008.ckpt" / "lockstep.json").is_file()

