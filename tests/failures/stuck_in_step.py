"""Case 10: rank 1 is stuck in its own code (a slow data path) while rank 0 waits inside the step's own
collectives: DDP's gradient all-reduce or FSDP's all-gather. ``stuck_in_step.py STRATEGY runtime|trainer``."""
import sys
import time

import torch

import lockstep

strategy, api = sys.argv[1], sys.argv[2]
data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))


def slow_fetch(rank: int, step: int) -> None:
    if rank == 1 and step == 3:
        print(f"stuck since {time.time()}", flush=True)
        time.sleep(3600)  # rank 1 never comes back


def build() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


class Regression(lockstep.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = build()

    def training_step(self, batch, batch_idx):
        slow_fetch(self.trainer.runtime.rank, batch_idx)
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if api == "trainer":
    trainer = lockstep.Trainer(max_epochs=1, accelerator="cpu", strategy=strategy, enable_progress_bar=False)
    trainer.fit(Regression(), data, batch_size=8)
else:
    rt = lockstep.Runtime(accelerator="cpu", strategy=strategy)
    model = build()
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step, (x, y) in enumerate(rt.loader(data, batch_size=8)):
        rt.mark("my_data")
        slow_fetch(rt.rank, step)
        rt.mark("my_step")
        rt.backward(torch.nn.functional.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
