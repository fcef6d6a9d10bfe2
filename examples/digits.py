"""Train a digits classifier (scikit-learn's bundled 8x8 digits, no download) on N processes.

    python examples/digits.py --devices 2          # starts 2 processes itself (lockstep.launch)
    torchrun --nproc-per-node 2 examples/digits.py # or under any launcher: runs as one rank

Gloo on the CPU; NCCL with one GPU per process when CUDA GPUs are present.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import lockstep


def digits_datasets(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """1,437 training and 360 validation images, standardised with training statistics."""
    from sklearn.datasets import load_digits

    x_all, y_all = load_digits(return_X_y=True)
    x = torch.tensor(x_all, dtype=torch.float32)
    y = torch.tensor(y_all, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    train, val = order[:1437], order[1437:]
    mean, std = x[train].mean(0), x[train].std(0) + 1e-6
    return (TensorDataset((x[train] - mean) / std, y[train]),
            TensorDataset((x[val] - mean) / std, y[val]))


def train(epochs: int, batch_size: int, accelerator: str) -> float:
    rt = lockstep.Runtime(accelerator=accelerator, seed=0)
    train_set, val_set = digits_datasets()
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    model, optimizer = rt.setup(model, optimizer)
    train_loader = rt.loader(train_set, batch_size=batch_size, shuffle=True)  # global batch
    val_loader = rt.eval_loader(val_set, batch_size=128)
    rt.print(f"{rt.world_size} process(es) on {rt.device.type}, global batch {batch_size}")
    accuracy = 0.0
    for epoch in range(epochs):
        model.train()
        loss_sum = torch.zeros(2, device=rt.device)  # (sum of losses, samples) on this rank
        for x, y in train_loader:
            loss = F.cross_entropy(model(x), y)
            rt.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            loss_sum += torch.stack([loss.detach() * len(y), torch.tensor(len(y), device=rt.device)])
        total_loss, samples = rt.all_reduce(loss_sum, op="sum").tolist()
        model.eval()
        with torch.no_grad():
            hits = [model(x).argmax(dim=1) == y for x, y in val_loader]
        hits_all = rt.gather(hits)  # every validation sample once, in dataset order
        accuracy = hits_all.float().mean().item()
        rt.print(f"epoch {epoch + 1:2d}  train loss {total_loss / samples:.4f}  "
                 f"val acc {accuracy:.4f} ({len(hits_all)} samples)")
    return accuracy


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2, help="processes to start (ignored under a launcher)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "cuda"])
    args = parser.parse_args()
    # Starts the processes; under torchrun, srun or another launcher it runs train() as this rank.
    accuracy = lockstep.launch(train, nprocs=args.devices, args=(args.epochs, args.batch_size, args.accelerator))
    if lockstep.DistEnv.from_environ().is_global_zero:
        print(f"final validation accuracy: {accuracy:.4f}")
    return 0 if accuracy >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
