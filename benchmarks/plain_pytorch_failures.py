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
CASES = ["skip_barrier", "uneven_loop", "spin", "shapes", "raises", "sigkill"]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cap", type=float, default=60.0)
    args = parser.parse_args()
    jobs = {}
    commands = {case: [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       str(HERE / f"{case}.py")] for case in CASES}
    environments = {case: dict(os.environ) for case in CASES}
    import socket

    busy = socket.socket()
    busy.bind(("", 0))
    busy.listen()
    one_rank = [sys.executable, str(HERE / "single_rank.py")]
    for case, rank, addr, port in (("port_taken", 0, "127.0.0.1", busy.getsockname()[1]),
                                   ("master_silent", 1, "127.0.0.2", _free_port())):
        commands[case] = one_rank
        environments[case] = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": addr,
                              "MASTER_PORT": str(port)}
    for case, command in commands.items():  # concurrently: each waits on its own timeouts
        jobs[case] = (time.monotonic(), subprocess.Popen(
            command, env=environments[case], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
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
            subprocess.run(["pkill", "-9", "-f", "--", commands[case][-1]], check=False)
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
