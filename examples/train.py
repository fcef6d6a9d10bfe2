"""One training script for every launch route (see docs/launching.md).

    python examples/train.py --devices 2                      # starts its own 2 processes
    lockstep run --devices 2 examples/train.py                # lockstep's launcher (torch elastic)
    torchrun --nproc-per-node 2 examples/train.py             # plain torchrun
    python -m torch.distributed.launch --nproc-per-node 2 examples/train.py   # legacy, --local-rank
    lockstep run --nodes 2 --node-rank R --master HOST:29500 --devices 2 examples/train.py   # 2 nodes
"""

import argparse

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import lockstep


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", default="auto",
                        help="processes (CPU) or GPUs per node; auto = what the launcher started")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--local-rank", "--local_rank", type=int,
                        help="set by the legacy launcher; lockstep reads it too")
    args = parser.parse_args()

    rt = lockstep.Runtime(devices=args.devices, seed=0)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2000, 20, generator=generator)
    y = (x[:, :10].sum(dim=1) > 0).long()  # a learnable rule
    train_set, val_set = TensorDataset(x[:1600], y[:1600]), TensorDataset(x[1600:], y[1600:])

    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    model, optimizer = rt.setup(model, optimizer)
    loader = rt.loader(train_set, batch_size=64, shuffle=True)
    for epoch in range(args.epochs):
        for xb, yb in loader:
            rt.backward(F.cross_entropy(model(xb), yb))
            optimizer.step()
            optimizer.zero_grad()
        with torch.no_grad():
            hits = rt.gather([model(xb).argmax(1) == yb for xb, yb in rt.eval_loader(val_set, batch_size=100)])
        rt.print(f"epoch {epoch + 1}: val acc {hits.float().mean():.4f} over {len(hits)} samples, "
                 f"{rt.world_size} process(es) via {rt.env.launcher}")


if __name__ == "__main__":
    main()
