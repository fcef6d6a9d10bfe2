"""The runtime API in 20 lines: python examples/quickstart.py (or under torchrun / srun)."""

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import lockstep


def main() -> int:
    rt = lockstep.Runtime(precision="bf16-mixed", seed=0)  # joins the process group
    data = TensorDataset(torch.randn(1000, 64), torch.randint(0, 10, (1000,)))
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer = rt.setup(model, optimizer)  # devices, DDP, precision
    loader = rt.loader(data, batch_size=256, shuffle=True)  # 256 = GLOBAL batch
    for _epoch in range(3):
        for x, y in loader:  # this rank's share, on rt.device; set_epoch done for you
            rt.backward(F.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    with torch.no_grad():
        preds = rt.gather([model(x).argmax(1) for x, _ in rt.eval_loader(data, batch_size=500)])
    rt.print(f"{len(preds)} predictions in dataset order from {rt.world_size} processes")  # rank 0 only
    return len(preds)


if __name__ == "__main__":
    lockstep.launch(main, nprocs=2)  # starts 2 processes; under a launcher, runs main() as this rank
