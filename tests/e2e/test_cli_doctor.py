"""`lockstep doctor` and `lockstep doctor --bench` as a user runs them."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


def _doctor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lockstep.cli.main", "doctor", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=100, env=env)


def test_doctor_reports_versions_devices_launcher_network():
    done = _doctor()
    assert done.returncode == 0, done.stderr
    import torch

    for expected in (f"torch {torch.__version__}", "Gloo: yes", "CPUs usable:", "launcher environment",
                     "none: rank 0 of 1", "lo: 127.0.0.1", "Gloo would use:", "NCCL would use:", "problems",
                     "listens on loopback only (one node)", "let only the job's hosts reach them"):
        assert expected in done.stdout, expected


def test_doctor_spots_an_unresolvable_master_and_an_inconsistent_launcher():
    import os

    env = {**os.environ, "MASTER_ADDR": "no-such-host.invalid", "RANK": "3", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
           "MASTER_PORT": "29500"}
    done = _doctor(env=env)
    assert "MASTER_ADDR=no-such-host.invalid does not resolve" in done.stdout
    assert "inconsistent: rank 3 does not fit world size 2" in done.stdout


def test_doctor_bench_reports_bandwidth_per_size():
    done = _doctor("--bench", "--devices", "2", "--accelerator", "cpu", "--max-bytes", "1M", "--iters", "5")
    assert done.returncode == 0, done.stderr
    rows = re.findall(r"^\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", done.stdout, flags=re.MULTILINE)
    assert [int(r[0]) for r in rows] == [1024, 4096, 16384, 65536, 262144, 1048576]
    for size, micros, algbw, busbw in rows:
        assert float(micros) > 0
        assert abs(int(size) / (float(micros) * 1e-6) / 1e9 - float(algbw)) <= 0.002 + 0.01 * float(algbw)
        assert float(busbw) == float(algbw)  # 2 processes: busbw = algbw * 2 * (2 - 1) / 2


def test_doctor_bench_records_the_matmul_peak_that_the_trainers_mfu_then_uses(monkeypatch, tmp_path):
    import torch

    from checks import trainer as tc
    from lockstep.train.flops import cache_file, device_name, peak_flops

    monkeypatch.delenv("LOCKSTEP_PEAK_FLOPS", raising=False)
    cpu = torch.device("cpu")
    assert peak_flops(cpu, "32-true") is None  # nothing measured yet: no MFU on the CPU
    done = _doctor("--bench", "--devices", "1", "--accelerator", "cpu")
    assert done.returncode == 0, done.stderr
    assert "all-reduce benchmark: skipped, it needs at least 2 processes" in done.stdout
    printed = dict(re.findall(r"^  (bf16|fp32): ([\d.]+) TFLOP/s$", done.stdout, flags=re.MULTILINE))
    recorded = json.loads(cache_file().read_text())[device_name(cpu)]  # the child ran with this process's threads
    assert set(printed) == set(recorded) == {"bf16", "fp32"}
    for key, rate in recorded.items():
        assert float(printed[key]) == pytest.approx(rate / 1e12, abs=1e-3)
        assert 1e9 < rate < 1e14  # some GFLOP/s, less than any CPU's 100 TFLOP/s
    assert peak_flops(cpu, "32-true") == recorded["fp32"]

    _, windows, monitor = tc.fit_logging(tmp_path, max_steps=4)
    assert windows and all(0 < m["mfu"] <= 1 for m in windows)
    for m in windows:
        assert m["mfu"] == pytest.approx(monitor.flops_per_sample * m["samples_per_s"] / recorded["fp32"])


@pytest.mark.parametrize(("option", "says"), [
    (["--max-bytes", "abc"], "argument --max-bytes: 'abc': give a size of at least 1K"),
    (["--max-bytes", "512"], "argument --max-bytes: '512': give a size of at least 1K"),
    (["--iters", "0"], "argument --iters: '0': give a whole number, at least 1"),
])
def test_the_bench_options_are_checked_before_any_benchmark_runs(option, says):
    """Before: a ValueError after the matmul benchmark, a StatisticsError inside a WorkerError, an empty table."""
    done = _doctor("--bench", "--accelerator", "cpu", *option)
    assert done.returncode == 2 and says in done.stderr and "matmul" not in done.stdout, done.stdout + done.stderr
