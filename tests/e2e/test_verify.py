"""`lockstep verify`: the examples pass on 2 and 4 processes; planted bugs are caught and explained."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lockstep.cli.verify import compare

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(240)


def _verify(devices: int, *script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lockstep.cli.main", "verify", "--devices", str(devices),
                           "--accelerator", "cpu", "--steps", "3", *script], cwd=ROOT, capture_output=True, text=True,
                          timeout=200)


@pytest.mark.parametrize(("devices", "script"), [(2, "examples/train.py"), (4, "examples/digits.py"),
                                                 (2, "tests/scripts/verify_planted.py tokens")],
                         ids=["runtime-2", "trainer-4", "num_items-2"])
def test_verify_passes_where_the_run_computes_what_one_process_computes(devices, script):
    done = _verify(devices, *script.split())
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"the run on {devices} processes computes what one process computes: 3 steps agree" in done.stdout
    assert len([line for line in done.stdout.splitlines() if line.strip()[:1].isdigit()]) == 3


def _verify_as_the_readme_writes_it(devices: int, script: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``lockstep verify SCRIPT --devices N ...``: verify's options after the script, then the script's."""
    return subprocess.run([sys.executable, "-m", "lockstep.cli.main", "verify", script, "--devices", str(devices),
                           "--accelerator", "cpu", "--steps", "3", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=200)


@pytest.mark.parametrize("devices", [2, 4])
def test_a_script_on_a_tensor_parallel_mesh_verifies_against_itself_on_one_process(devices):
    """Parallel(tp=2): on one process the model runs unsplit (one line says so); on 2 it is tp2, on 4 dp2 x tp2."""
    done = _verify_as_the_readme_writes_it(devices, "tests/scripts/verify_planted.py", "tokens-tp")
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"the run on {devices} processes computes what one process computes: 3 steps agree" in done.stdout


def test_verify_takes_its_options_after_the_script_and_passes_the_rest_on():
    done = _verify_as_the_readme_writes_it(2, "tests/scripts/verify_planted.py", "--", "tokens-bug")
    assert done.returncode == 1 and "DIVERGES at step 1: the loss differs" in done.stderr, done.stdout + done.stderr
    missing = subprocess.run([sys.executable, "-m", "lockstep.cli.main", "verify", "examples/train.py"], cwd=ROOT,
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "give --devices N" in missing.stderr


@pytest.mark.parametrize(("mode", "cause"), [
    ("tokens-bug", "must say the count: rt.backward(loss, num_items=n)"),
    ("batchnorm", "the model has BatchNorm"),
])
def test_verify_catches_a_planted_bug_at_its_first_step_and_says_why(mode, cause):
    done = _verify(2, "tests/scripts/verify_planted.py", mode)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "DIVERGES at step 1: the loss differs" in done.stderr and cause in done.stderr, done.stderr


def _record(step: int, loss: float, norm: float, weight: float) -> dict:
    return {"step": step, "loss": loss, "grad_norm": norm, "weights": {"w": torch.tensor([1.0, weight])}}


def test_compare_names_the_first_step_and_what_diverged():
    reference = [_record(1, 2.0, 1.0, 0.5), _record(2, 1.5, 0.8, 0.4)]
    assert compare(reference, [_record(1, 2.0, 1.0, 0.5), _record(2, 1.5, 0.8, 0.4 + 1e-7)], 1e-4, 1e-6)[1] is None
    assert "step 2: the weights differ, most in w" in compare(
        reference, [_record(1, 2.0, 1.0, 0.5), _record(2, 1.5, 0.8, 0.41)], 1e-4, 1e-6)[1]
    assert "step 1: the gradient norm differs" in compare(reference, [_record(1, 2.0, 1.1, 0.5)], 1e-4, 1e-6)[1]
    assert "the run stopped after 1 steps" in compare(reference, [_record(1, 2.0, 1.0, 0.5)], 1e-4, 1e-6)[1]


def test_compare_never_calls_a_nan_loss_or_a_run_without_gradients_agreeing():
    nan = float("nan")
    both_nan = compare([_record(1, nan, 1.0, 0.5)], [_record(1, nan, 1.0, 0.5)], 1e-4, 1e-6)[1]
    assert both_nan is not None and "step 1: the loss is not a number" in both_nan
    frozen = [_record(1, 2.0, 0.0, 0.5), _record(2, 2.0, 0.0, 0.5)]
    divergence = compare(frozen, [dict(step) for step in frozen], 1e-4, 1e-6)[1]
    assert divergence is not None and divergence.startswith("nothing was compared: the gradients were zero")
