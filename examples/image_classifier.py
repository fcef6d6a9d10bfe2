"""A small CNN on 8x8 digit images (scikit-learn's bundled digits), trained with the Trainer.

    python examples/image_classifier.py --devices 2 [--precision bf16-mixed]
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import lockstep


def digit_images(seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    from sklearn.datasets import load_digits

    x_all, y_all = load_digits(return_X_y=True)
    images = torch.tensor(x_all, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    labels = torch.tensor(y_all, dtype=torch.long)
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(seed))
    train, val = order[:1437], order[1437:]
    return TensorDataset(images[train], labels[train]), TensorDataset(images[val], labels[val])


class SmallCNN(lockstep.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2), nn.Dropout(0.1),
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))

    def training_step(self, batch, batch_idx):
        images, labels = batch
        return F.cross_entropy(self(images), labels)

    def validation_step(self, batch, batch_idx):
        images, labels = batch
        logits = self(images)
        self.log("val_acc", (logits.argmax(dim=1) == labels).float().mean(), prog_bar=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(dim=1)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=2e-3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--out", default="runs/cnn")
    args = parser.parse_args()
    train, val = digit_images()
    trainer = lockstep.Trainer(max_epochs=args.epochs, devices=args.devices, accelerator=args.accelerator,
                               precision=args.precision, log_every_n_steps=10, log_dir=args.out)
    module = SmallCNN()
    trainer.fit(module, train, val, batch_size=64)
    predictions = trainer.predict(module, val, batch_size=128)  # one per image, in dataset order
    accuracy = (predictions == val.tensors[1]).float().mean().item()
    if trainer.is_global_zero:
        print(f"validation accuracy {trainer.callback_metrics['val_acc']:.4f}; predict() gave {len(predictions)} "
              f"rows in dataset order, accuracy {accuracy:.4f}")
    return 0 if accuracy >= 0.9 else 1


if __name__ == "__main__":
    sys.exit(main())
