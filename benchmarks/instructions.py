"""Instructions per step, counted: the loops of benchmarks/overhead.py under valgrind's callgrind.

steps/s on a shared 2-core machine moves by ±15 % between rounds, and the medians of 60 rounds by
5-10 µs per step: a change worth a few µs cannot be seen there. An instruction count can: the same
loop counts the same within about 0.3 %. Each loop runs on 2 processes (Gloo), as in overhead.py, each
under callgrind with instrumentation off until step 100 and off again from step 300; the count is that
of rank 0's main thread over those 200 steps (the Gloo threads, and lockstep's heartbeat thread, which
acts every 0.5 s of wall time and so 30-50 times as often under valgrind's slowdown, are left out).

A count is not a time: the Trainer's own Python runs at fewer instructions per ns than the loops'
tensor work (overhead.py measured about 1 µs of main-thread CPU per 1,000 of its instructions, and
2.4 per ns for the hand-written loop as a whole), so compare counts of the same kind of code.

    python benchmarks/instructions.py [--loops batched,runtime,trainer] [--processes 2]

Needs valgrind (``apt-get install valgrind``); about 1 minute per loop on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

FIRST, LAST = 100, 300  # the counted steps: [FIRST, LAST)
STEPS = LAST + 20


def _instrument(on: bool) -> None:
    """Switch callgrind's instrumentation of this process; returns once valgrind has done it."""
    subprocess.run(["callgrind_control", "-i", "on" if on else "off", str(os.getpid())],
                   stdout=subprocess.DEVNULL, check=True)


def _at(step: int) -> None:
    if step == FIRST:
        _instrument(True)
    elif step == LAST:
        _instrument(False)


def worker(loop: str) -> None:
    """One rank of ``loop``; torchrun's variables say which."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from overhead import PER_PROCESS_BATCH, Classifier, make_data, make_model
    from torch import nn
    from torch.utils.data import BatchSampler, DataLoader, DistributedSampler

    import lockstep

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    data = make_data(PER_PROCESS_BATCH * world * STEPS)
    if loop == "batched":  # overhead.py's hand_written(batched=True)
        dist.init_process_group("gloo")
        model = nn.parallel.DistributedDataParallel(make_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        sampler = BatchSampler(DistributedSampler(data, shuffle=True), PER_PROCESS_BATCH, drop_last=False)
        for step, (x, y) in enumerate(DataLoader(data, batch_size=None, sampler=sampler)):
            _at(step)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        dist.barrier()
        dist.destroy_process_group()
    elif loop == "runtime":  # overhead.py's runtime_api
        rt = lockstep.Runtime(accelerator="cpu")
        model = make_model()
        model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
        for step, (x, y) in enumerate(rt.loader(data, batch_size=PER_PROCESS_BATCH * world, shuffle=True,
                                                num_workers=0)):
            _at(step)
            rt.backward(F.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        rt.barrier()
        rt.close()
    elif loop == "trainer":  # overhead.py's trainer_loop: the Trainer's defaults
        class Toggle(lockstep.Callback):
            def on_train_batch_start(self, trainer, module, batch, batch_idx):
                _at(batch_idx)

        trainer = lockstep.Trainer(max_steps=STEPS, accelerator="cpu", loggers=(), enable_progress_bar=False,
                                   num_workers=0, callbacks=[Toggle()])
        trainer.fit(Classifier(), data, batch_size=PER_PROCESS_BATCH * world)
    else:
        raise SystemExit(f"no loop {loop!r}: batched, runtime or trainer")


def count(loop: str, processes: int, folder: Path, port: int) -> int:
    """Rank 0's main-thread instructions over the counted steps of ``loop``."""
    ranks = []
    for rank in range(processes):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
               "LOCAL_RANK": str(rank), "WORLD_SIZE": str(processes), "LOCAL_WORLD_SIZE": str(processes),
               "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
        command = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes",
                   f"--callgrind-out-file={folder}/{loop}.{rank}", sys.executable, __file__, "--worker", loop]
        log = open(folder / f"{loop}.{rank}.log", "w")  # noqa: SIM115 - closed once the rank exits
        ranks.append((subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    for process, log in ranks:
        code = process.wait(timeout=900)
        log.close()
        if code:
            raise SystemExit(f"{loop}: a rank exited with {code}; see {log.name}")
    main_thread = folder / f"{loop}.0-01"  # callgrind numbers the threads from 1, the main thread first
    for line in main_thread.read_text().splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    raise SystemExit(f"{main_thread} holds no totals")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loops", default="batched,runtime,trainer")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--keep", type=Path, help="a folder to keep callgrind's files in (callgrind_annotate "
                        "FOLDER/LOOP.0-01 then shows where rank 0's instructions went)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker)
        return
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("valgrind is not installed: apt-get install valgrind")
    loops = args.loops.split(",")
    counts = {}
    with tempfile.TemporaryDirectory(prefix="lockstep-instructions-") as scratch:
        folder = args.keep or Path(scratch)
        folder.mkdir(parents=True, exist_ok=True)
        for index, loop in enumerate(loops):
            counts[loop] = count(loop, args.processes, folder, 29700 + index) / (LAST - FIRST)
    base = counts.get("batched")
    print(f"{args.processes} processes; rank 0's main thread, steps {FIRST}-{LAST - 1}")
    for loop, per_step in counts.items():
        against = f"   {per_step - base:+10,.0f} ({per_step / base:.3f}x) against batched" if base else ""
        print(f"{loop:<10}{per_step:>12,.0f} instructions per step{against}")


if __name__ == "__main__":
    main()
