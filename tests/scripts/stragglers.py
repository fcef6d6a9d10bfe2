"""A data-parallel job with one slow rank, for the straggler report's tests.

    lockstep run --nproc 3 tests/scripts/stragglers.py MODE [STEPS]

MODE: ``data`` (rank SLOW_RANK sleeps in __getitem__), ``forward`` (it sleeps in its forward), ``host``
(ranks pin themselves to the cores PIN gives, e.g. ``0,1,0``: the test busies SLOW_RANK's core), ``none``
(balanced), ``logged`` (it sleeps after its optimizer step, and every rank then all-reduces its loss, as a
loop that logs the mean loss each step does), ``trainer`` (the data mode under the Trainer, which logs the
step-time metrics). Prints
``report <json>`` with rank 0's ``rt.step_times()`` at the end.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import lockstep

MODE = sys.argv[1]
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 24
SLOW_RANK = int(os.environ.get("SLOW_RANK", "2"))
SLEEP_S = float(os.environ.get("SLOW_SLEEP_S", "0.2"))
RANK = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))
torch.set_num_threads(1)
if MODE == "host":
    os.sched_setaffinity(0, {int(os.environ["PIN"].split(",")[RANK])})


class Rows(Dataset):
    def __init__(self, n: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, 256, generator=generator), torch.randint(0, 8, (n,), generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        if MODE in ("data", "trainer") and RANK == SLOW_RANK:
            time.sleep(SLEEP_S / 8)  # 8 rows a rank a batch
        return self.x[i], self.y[i]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(256, 512), nn.Tanh(), nn.Linear(512, 512), nn.Tanh(), nn.Linear(512, 8))

    def forward(self, x):
        if MODE == "forward" and RANK == SLOW_RANK:
            time.sleep(SLEEP_S)
        if MODE == "host":  # enough work that a rank waiting for a CPU falls behind
            for _ in range(int(os.environ.get("HOST_WORK", "120"))):
                x = x + 0 * self.body[0](x).sum()
        return self.body(x)


class Module(lockstep.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    if MODE == "trainer":
        trainer = lockstep.Trainer(max_steps=STEPS, accelerator="cpu", loggers=("csv",), log_every_n_steps=4,
                                   log_dir=os.environ.get("LOG_DIR", "straggler-logs"), enable_progress_bar=False,
                                   num_workers=0)
        trainer.fit(Module(), Rows(8 * 3 * STEPS), batch_size=24)
        report = trainer.runtime.step_times()
    else:
        rt = lockstep.Runtime(accelerator="cpu")
        torch.manual_seed(0)
        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        model, optimizer = rt.setup(model, optimizer)
        for x, y in rt.loader(Rows(8 * rt.world_size * STEPS), batch_size=8 * rt.world_size, num_workers=0):
            loss = F.cross_entropy(model(x), y)
            rt.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if MODE == "logged":
                if RANK == SLOW_RANK:
                    time.sleep(SLEEP_S)
                rt.all_reduce(loss.detach())
        time.sleep(1.2)  # two heartbeats: the newest steps judged
        report = rt.step_times()
        rt.close()
    if os.environ.get("SHOW_STEPS"):
        print(f"steps {RANK} " + json.dumps(report.get("steps", [])), flush=True)
    if RANK == 0:
        print("report " + json.dumps({k: v for k, v in report.items() if k != "steps"}), flush=True)


if __name__ == "__main__":
    main()
