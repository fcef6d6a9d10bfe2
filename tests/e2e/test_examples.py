"""The demo, as a user runs it: its own processes, and the same script under torchrun."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


def _run(*command: str) -> str:
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def _epochs(output: str) -> list[str]:
    return re.findall(r"^epoch .* train loss .*$", output, flags=re.MULTILINE)


def test_digits_demo_reaches_90_percent_on_2_processes_and_matches_torchrun(tmp_path):
    launched = _run(sys.executable, "examples/digits.py", "--accelerator", "cpu", "--out", str(tmp_path / "a"))
    accuracy = float(re.search(r"final validation accuracy: ([0-9.]+) \(360 samples, 2 processes\)", launched).group(1))
    assert accuracy >= 0.9
    assert (tmp_path / "a" / "curves.png").stat().st_size > 10_000
    assert (tmp_path / "a" / "checkpoints" / "last.ckpt").exists()
    assert "val_acc" in (tmp_path / "a" / "metrics.csv").read_text()
    torchrun = _run(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "examples/digits.py",
                    "--accelerator", "cpu", "--out", str(tmp_path / "b"))
    assert _epochs(torchrun) == _epochs(launched)
    assert len(_epochs(launched)) == 10


def test_quickstart_gathers_every_sample_on_2_processes():
    out = _run(sys.executable, "examples/quickstart.py")
    assert out.strip() == "1000 predictions in dataset order from 2 processes"


def test_train_example_gives_the_same_accuracy_on_1_process_and_under_lockstep_run():
    alone = _run(sys.executable, "examples/train.py", "--epochs", "2")
    launched = _run(sys.executable, "-m", "lockstep.cli.main", "run", "--devices", "2", "--accelerator", "cpu",
                    "examples/train.py", "--epochs", "2")
    accuracy = [re.findall(r"val acc ([0-9.]+) over 400 samples", out) for out in (alone, launched)]
    assert accuracy[0] == accuracy[1] and len(accuracy[0]) == 2
    assert "2 process(es) via torchrun" in launched


def test_lstm_text_classifier_learns_the_shipped_reviews(tmp_path):
    out = _run(sys.executable, "examples/lstm_text_classifier.py", "--accelerator", "cpu", "--out", str(tmp_path))
    accuracy = float(re.search(r"validation accuracy ([0-9.]+) over 160 reviews on 2 processes", out).group(1))
    assert accuracy >= 0.85
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))


def test_image_classifier_predicts_every_image_in_order(tmp_path):
    out = _run(sys.executable, "examples/image_classifier.py", "--accelerator", "cpu", "--out", str(tmp_path))
    assert re.search(r"predict\(\) gave 360 rows in dataset order, accuracy 0\.9\d+", out), out


@pytest.mark.skipif(importlib.util.find_spec("torchft") is None, reason="torchft is not installed (the ft extra)")
def test_fault_tolerant_example_runs_as_two_replica_groups(tmp_path):
    out = _run(sys.executable, "-m", "lockstep.cli.main", "run", "--fault-tolerant", "--replicas", "2",
               "--devices", "2", "--accelerator", "cpu", "examples/fault_tolerant.py", "--steps", "60",
               "--checkpoints", str(tmp_path))
    assert "step 50: loss" in out
    assert (tmp_path / "step=50" / "lockstep.json").is_file()
