"""What plain PyTorch (torchrun, Gloo, default timeouts) does in the failure suite's situations.

Each case runs `torchrun --nproc-per-node 2` on a script in plain_failures/, capped at --cap seconds,
and prints the exit code, the time and the last error line. docs/reliability.md records the output.

    python benchmarks/plain_pytorch_failures.py [--cap 60]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent / "plain_failures"
CASES = ["skip_barrier", "uneven_loop", "spin", "shapes", "raises"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cap", type=float, default=60.0)
    args = parser.parse_args()
    jobs = {}
    for case in CASES:  # concurrently: each waits on its own timeouts
        jobs[case] = (time.monotonic(), subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
             str(HERE / f"{case}.py")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True))
    finished: dict[str, float] = {}
    while len(finished) < len(jobs) and time.monotonic() - min(t for t, _ in jobs.values()) < args.cap:
        for case, (start, job) in jobs.items():
            if case not in finished and job.poll() is not None:
                finished[case] = time.monotonic() - start
        time.sleep(0.2)
    for case, (_, job) in jobs.items():
        if case not in finished:
            os.killpg(job.pid, signal.SIGKILL)
            # the agent starts its workers in sessions of their own: stop them by name
            subprocess.run(["pkill", "-9", "-f", str(HERE / f"{case}.py")], check=False)
            job.communicate(timeout=10)
            print(f"{case}: still waiting after {args.cap:.0f}s (killed)")
            continue
        out, _ = job.communicate()
        lines = [line for line in out.splitlines() if "rror" in line or " got " in line]
        print(f"{case}: exit {job.returncode} after {finished[case]:.1f}s; {lines[0][:200] if lines else '(no error)'}")
        for line in (line for line in out.splitlines() if " got " in line):
            print(f"    {line.strip()[:160]}")

if __name__ == "__main__":
    main()
