"""``lockstep slurm --dry-run``'s script header: a value with a line break never becomes a shell line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)


def _dry_run(tmp_path: Path, *options: str) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text("import lockstep\nrt = lockstep.Runtime()\nrt.should_stop()\n")
    return subprocess.run([sys.executable, "-m", "lockstep.cli.main", "slurm", "--dry-run", "--accelerator", "cpu",
                           *options, str(script), "--prompt", "hello\ntouch /tmp/pwned #"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=50)


def test_an_argument_with_a_line_break_stays_in_the_comment_and_in_the_quoted_command(tmp_path):
    done = _dry_run(tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    header = lines[:next(i for i, line in enumerate(lines) if not line.startswith("#"))]
    assert any(line.startswith("# Written by:") and "hello\\ntouch /tmp/pwned #" in line for line in header)
    assert sum(line.startswith("#SBATCH --signal") for line in header) == 1  # every directive is in the header
    # run with srun, scontrol and touch standing in: the argument reaches srun whole, nothing else runs it
    stand_ins = ('srun() { printf "srun got: %q\\n" "${@: -1}"; }; scontrol() { echo node0; }; '
                 'touch() { echo RAN-TOUCH; }\n')
    env = {"PATH": "/usr/bin:/bin", "SLURM_JOB_NODELIST": "node0", "SLURM_JOB_ID": "7"}
    bash = subprocess.run(["bash"], input=stand_ins + done.stdout, capture_output=True, text=True, timeout=20,
                          cwd=tmp_path, env=env)
    assert bash.returncode == 0, bash.stderr
    assert "RAN-TOUCH" not in bash.stdout and "srun got: $'hello\\ntouch /tmp/pwned #'" in bash.stdout, bash.stdout


@pytest.mark.parametrize("option, value", [("--job-name", "job\ntouch /tmp/pwned"), ("--partition", "gpu\rx"),
                                           ("--sbatch-arg", "--mem=1G\ntouch /tmp/pwned")])
def test_a_header_value_with_a_control_character_is_refused_by_its_option(tmp_path, option, value):
    done = _dry_run(tmp_path, f"{option}={value}")
    assert done.returncode == 2 and option in done.stderr and "line break" in done.stderr, done.stderr
    assert done.stdout == ""
