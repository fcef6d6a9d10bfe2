"""What plain PyTorch does in the trust cases of docs/reliability.md, measured on this machine.

1. DCP loads a checkpoint whose ``.metadata`` is a planted pickle: does the code run?
2. DCP loads a checkpoint whose optimizer entry (``lr``) is a planted pickle: does the code run?
3. DCP loads a checkpoint with 64 flipped bytes in its tensor data: error, or wrong weights?
4. A torchrun agent is SIGKILLed: how long do its workers go on?
5. ``init_process_group("gloo")`` from the environment: where does rank 0's store listen?

    python benchmarks/plain_pytorch_trust.py [--cap 60]
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

WORKER = """
import os, sys, time, torch.distributed as dist
dist.init_process_group("gloo")
open(os.path.join(sys.argv[1], f"{dist.get_rank()}.pid"), "w").write(str(os.getpid()))
end = time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    dist.barrier()
    time.sleep(0.05)
"""


class RunsCode:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _state() -> dict:
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 64)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}


def planted(folder: Path, where: str) -> str:
    marker = folder / "ran"
    state = _state()
    if where == "entry":
        state["optimizer"]["param_groups"][0]["lr"] = RunsCode(marker)
    dcp.save(state, checkpoint_id=str(folder / "ckpt"), no_dist=True)
    if where == "metadata":
        with open(folder / "ckpt" / ".metadata", "wb") as handle:
            pickle.dump(RunsCode(marker), handle)
    try:
        dcp.load(_state(), checkpoint_id=str(folder / "ckpt"), no_dist=True)
        outcome = "loaded"
    except BaseException as error:  # noqa: BLE001 - report whatever DCP raises
        outcome = f"{type(error).__name__}"
    return f"{outcome}; the planted code {'RAN' if marker.exists() else 'did not run'}"


def flipped(folder: Path) -> str:
    state = _state()
    dcp.save(state, checkpoint_id=str(folder / "ckpt"), no_dist=True)
    shard = next((folder / "ckpt").glob("__0_*.distcp"))
    data = bytearray(shard.read_bytes())
    start = bytes(data).find(state["model"]["weight"].numpy().tobytes()[:256]) + 1024  # inside the weights
    for i in range(start, start + 64):
        data[i] ^= 0xFF
    shard.write_bytes(bytes(data))
    loaded = _state()
    try:
        dcp.load(loaded, checkpoint_id=str(folder / "ckpt"), no_dist=True)
    except BaseException as error:  # noqa: BLE001
        return f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
    differ = (loaded["model"]["weight"] - state["model"]["weight"]).abs().max().item()
    return f"loaded without a word; the weights differ by up to {differ:.3g}"


def killed_agent(folder: Path, cap: float) -> str:
    agent = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                              str(folder / "worker.py"), str(folder), str(cap)],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while len(list(folder.glob("*.pid"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = [int(p.read_text()) for p in folder.glob("*.pid")]
    agent.send_signal(signal.SIGKILL)
    agent.wait()
    killed = time.monotonic()
    while any(_alive(pid) for pid in pids) and time.monotonic() - killed < cap + 5:
        time.sleep(0.1)
    left = [pid for pid in pids if _alive(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    if left:
        return f"{len(left)} workers still running after {cap + 5:.0f}s (killed)"
    return f"the workers went on for {time.monotonic() - killed:.1f}s"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def store_address() -> str:
    code = ("import os, subprocess, torch.distributed as dist; dist.init_process_group('gloo'); "
            "out = subprocess.run(['ss', '-ltnpH'], capture_output=True, text=True).stdout; "
            "print(sorted({l.split()[3] for l in out.splitlines() if f'pid={os.getpid()},' in l}))")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29731"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    return done.stdout.strip() or done.stderr.strip()[-200:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cap", type=float, default=60.0)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    print(f"torch {torch.__version__}")
    for name, case in (("planted .metadata", lambda f: planted(f, "metadata")),
                       ("planted optimizer entry", lambda f: planted(f, "entry")),
                       ("64 flipped bytes in a shard", flipped)):
        folder = Path(tempfile.mkdtemp(prefix="plain-trust-"))
        try:
            print(f"{name}: {case(folder)}")
        finally:
            shutil.rmtree(folder)
    folder = Path(tempfile.mkdtemp(prefix="plain-trust-"))
    try:
        (folder / "worker.py").write_text(WORKER)
        print(f"torchrun agent SIGKILLed: {killed_agent(folder, args.cap)}")
    finally:
        shutil.rmtree(folder)
    print(f"rank 0's store (env://) listens on: {store_address()}")


if __name__ == "__main__":
    main()
