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


def test_the_ported_ddp_tutorial_of_docs_runs_on_2_processes_and_resumes_from_its_snapshots(tmp_path):
    """docs/migrating-from-ddp.md's script as written (with a dataset like the tutorial's): it trains under
    `lockstep run --devices 2`, saves its snapshots, and a second run resumes from the newest (epoch 8) and
    trains only the last epoch."""
    page = (ROOT / "docs" / "migrating-from-ddp.md").read_text()
    script = re.search(r"## The tutorial, ported\n\n```python\n(.*?)```", page, flags=re.DOTALL).group(1)
    (tmp_path / "train.py").write_text(script.replace("runs/snapshots", str(tmp_path / "snapshots")))
    (tmp_path / "datautils.py").write_text(
        "import torch\n\n\nclass MyTrainDataset(torch.utils.data.Dataset):\n"
        "    def __init__(self, size):\n        generator = torch.Generator().manual_seed(0)\n"
        "        self.rows = [(torch.rand(20, generator=generator), torch.rand(1, generator=generator)) "
        "for _ in range(size)]\n\n    def __len__(self):\n        return len(self.rows)\n\n"
        "    def __getitem__(self, index):\n        return self.rows[index]\n")
    command = [sys.executable, "-m", "lockstep.cli.main", "run", "--devices", "2", "--accelerator", "cpu", "train.py"]
    first = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=100)
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.count("snapshot saved") == 5, first.stdout  # epochs 0, 2, 4, 6, 8
    again = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=100)
    assert again.returncode == 0 and "snapshot saved" not in again.stdout, again.stderr[-3000:]


def test_lightnings_backbone_example_ported_gives_the_same_test_loss_and_predictions_on_1_and_2_processes(tmp_path):
    """Lightning's own basic example, ported (examples/lightning_backbone.py): save_hyperparameters(ignore=...),
    self.hparams, self.log(on_step=/on_epoch=), test and predict from the best checkpoint. On 2 processes the
    test loss and every prediction, in dataset order, are the one-process run's."""
    import torch

    runs = {}
    for devices in ("1", "2"):
        out = _run(sys.executable, "examples/lightning_backbone.py", "--devices", devices, "--accelerator", "cpu",
                   "--max-epochs", "3", "--out", str(tmp_path / devices), "--save", str(tmp_path / f"{devices}.pt"))
        assert "360 predictions in dataset order" in out and "weights from" in out, out
        runs[devices] = torch.load(tmp_path / f"{devices}.pt")
    one, two = runs["1"], runs["2"]
    assert one["hparams"] == two["hparams"] == {"learning_rate": 0.001}
    assert abs(one["test_loss"] - two["test_loss"]) <= 1e-6, (one["test_loss"], two["test_loss"])
    assert one["predictions"].shape == (360, 10)
    assert torch.allclose(one["predictions"], two["predictions"], atol=1e-5, rtol=0)
