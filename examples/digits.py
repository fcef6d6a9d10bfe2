"""Train a digits classifier (scikit-learn's bundled 8x8 digits, no download) with the Trainer.

    python examples/digits.py                       # 2 processes: the script starts them itself
    torchrun --nproc-per-node 2 examples/digits.py --out runs/digits-torchrun  # or under any launcher

Gloo on the CPU; NCCL with one GPU per process when CUDA GPUs are present. Writes a CSV log, a
checkpoint and a PNG of the training and validation curves under --out.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

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


class DigitsClassifier(lockstep.Module):
    def __init__(self, lr: float = 1e-3) -> None:
        super().__init__()
        self.hparams = {"lr": lr, "hidden": 128}
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y))
        self.log("val_acc", (logits.argmax(dim=1) == y).float().mean(), prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams["lr"])


class EpochLine(lockstep.Callback):
    """One line per epoch from rank 0, for logs where no progress bar is drawn."""

    def on_validation_epoch_end(self, trainer, module):
        m = trainer.callback_metrics
        trainer.runtime.print(f"epoch {trainer.current_epoch + 1:2d}  train loss {m['train_loss_epoch']:.4f}  "
                              f"val loss {m['val_loss']:.4f}  val acc {m['val_acc']:.4f}")


def plot_curves(metrics_csv: Path, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(open(metrics_csv)))

    def series(name: str) -> tuple[list[int], list[float]]:
        points = [(int(r["step"]), float(r[name])) for r in rows if r.get(name)]
        return [s for s, _ in points], [v for _, v in points]

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(*series("train_loss"), label="train loss (every 5 steps)")
    left.plot(*series("val_loss"), marker="o", label="validation loss")
    left.set_xlabel("step")
    left.legend()
    right.plot(*series("val_acc"), marker="o", color="tab:green")
    right.set_xlabel("step")
    right.set_ylabel("validation accuracy")
    figure.suptitle("digits: 2 processes, global batch 64")
    figure.tight_layout()
    figure.savefig(png, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2, help="processes (CPU) or GPUs")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--out", default="runs/digits", help="folder for the log, checkpoint and plot")
    args = parser.parse_args()
    out = Path(args.out)
    train_set, val_set = digits_datasets()
    trainer = lockstep.Trainer(
        max_epochs=args.epochs, devices=args.devices, accelerator=args.accelerator, log_every_n_steps=5,
        checkpoint_dir=out / "checkpoints", log_dir=out, loggers=("csv",),
        callbacks=[lockstep.ModelCheckpoint(monitor="val_acc", mode="max"), EpochLine()],
    )
    trainer.fit(DigitsClassifier(), train_set, val_set, batch_size=args.batch_size)
    accuracy = trainer.callback_metrics["val_acc"]
    if trainer.is_global_zero:
        plot_curves(out / "metrics.csv", out / "curves.png")
        print(f"final validation accuracy: {accuracy:.4f} ({len(val_set)} samples, {trainer.runtime.world_size} "
              f"processes)")
        print(f"log: {out / 'metrics.csv'}  checkpoint: {out / 'checkpoints' / 'last.ckpt'}")
        print(f"plot of the training and validation curves: {out / 'curves.png'}")
    return 0 if accuracy >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
