"""Lightning's own basic example, the backbone image classifier, ported to lockstep line by line
(docs/migrating-from-lightning.md says what each line became and why). Two changes of data only: scikit-learn's
bundled 8x8 digits stand in for MNIST (nothing is downloaded), and the batch size is the global one.

    python examples/lightning_backbone.py --devices 2
    lockstep run --devices 4 --accelerator cpu examples/lightning_backbone.py
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import lockstep  # Lightning: from lightning.pytorch import LightningModule, Trainer


class Backbone(nn.Module):  # as Lightning's, for 8x8 images instead of 28x28
    def __init__(self, hidden_dim: int = 128) -> None:
        super().__init__()
        self.l1 = nn.Linear(8 * 8, hidden_dim)
        self.l2 = nn.Linear(hidden_dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(x.size(0), -1)
        x = torch.relu(self.l1(x))
        return torch.relu(self.l2(x))


class LitClassifier(lockstep.Module):  # Lightning: LightningModule
    def __init__(self, backbone: nn.Module | None = None, learning_rate: float = 0.0001) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["backbone"])
        if backbone is None:
            backbone = Backbone()
        self.backbone = backbone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # use forward for inference/predictions
        return self.backbone(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        y_hat = self(x)
        loss = F.cross_entropy(y_hat, y)
        self.log("train_loss", loss, on_epoch=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        y_hat = self(x)
        loss = F.cross_entropy(y_hat, y)
        self.log("valid_loss", loss, on_step=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        y_hat = self(x)
        loss = F.cross_entropy(y_hat, y)
        self.log("test_loss", loss)

    def predict_step(self, batch, batch_idx, dataloader_idx=None):
        x, y = batch
        return self(x)

    def configure_optimizers(self):
        # self.hparams available because we called self.save_hyperparameters()
        return torch.optim.Adam(self.parameters(), lr=self.hparams.learning_rate)


def digits() -> tuple[TensorDataset, TensorDataset, TensorDataset]:
    """Lightning's MyDataModule (MNIST: train split 55000/5000, and test) on the digits: 1237/200, and 360."""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(42))
    parts = order[:1237], order[1237:1437], order[1437:]
    return tuple(TensorDataset(x[part], y[part]) for part in parts)  # type: ignore[return-value]


def cli_main() -> None:
    # Lightning: LightningCLI(LitClassifier, MyDataModule, seed_everything_default=1234, run=False)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", default="auto", help="processes (CPU) or GPUs per node; auto = what the "
                        "launcher started (one process without one)")
    parser.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--max-epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32, help="the global batch (Lightning's is per process)")
    parser.add_argument("--learning-rate", type=float, default=0.001)
    parser.add_argument("--out", default="runs/lightning_backbone")
    parser.add_argument("--save", help="write the test loss and the predictions here (torch.save)")
    args = parser.parse_args()
    train, val, test = digits()
    trainer = lockstep.Trainer(max_epochs=args.max_epochs, devices=args.devices, accelerator=args.accelerator,
                               seed=1234, log_dir=args.out, checkpoint_dir=f"{args.out}/checkpoints",
                               enable_progress_bar=False)
    model = LitClassifier(learning_rate=args.learning_rate)
    trainer.fit(model, train, val, batch_size=args.batch_size)
    tested = trainer.test(model, test, batch_size=args.batch_size, ckpt_path="best")
    predictions = trainer.predict(model, test, batch_size=args.batch_size, ckpt_path="best")
    if trainer.is_global_zero:
        print(predictions[0])
        print(f"test loss {tested['test_loss']:.6f}; {len(predictions)} predictions in dataset order")
        if args.save:
            torch.save({"test_loss": tested["test_loss"], "predictions": predictions,
                        "hparams": dict(model.hparams)}, args.save)


if __name__ == "__main__":
    cli_main()
