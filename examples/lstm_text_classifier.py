"""An LSTM sentiment classifier over padded variable-length batches, trained with the Trainer.

The data is examples/data/sentiment.tsv: 800 short synthetic movie reviews, labelled positive or
negative. Some say one thing first and the opposite after "but", so word order matters.

    python examples/lstm_text_classifier.py --devices 2
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_sequence

import lockstep

DATA = Path(__file__).parent / "data" / "sentiment.tsv"
PAD, UNKNOWN = 0, 1


def read_reviews(path: Path = DATA) -> list[tuple[list[str], int]]:
    lines = path.read_text().splitlines()[1:]
    return [(text.lower().split(), int(label == "positive")) for text, label in (line.split("\t") for line in lines)]


class Reviews(torch.utils.data.Dataset):
    """Token ids per review (lengths differ) and the label."""

    def __init__(self, reviews: list[tuple[list[str], int]], vocabulary: dict[str, int]) -> None:
        self.items = [(torch.tensor([vocabulary.get(w, UNKNOWN) for w in words]), label) for words, label in reviews]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.items[index]


def pad_batch(rows: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pad to the longest review of the batch; keep the true lengths for packing."""
    tokens = pad_sequence([r[0] for r in rows], batch_first=True, padding_value=PAD)
    lengths = torch.tensor([len(r[0]) for r in rows])
    labels = torch.tensor([r[1] for r in rows])
    return tokens, lengths, labels


class SentimentLSTM(lockstep.Module):
    def __init__(self, vocabulary_size: int, embedding: int = 32, hidden: int = 64) -> None:
        super().__init__()
        self.hparams = {"vocabulary_size": vocabulary_size, "embedding": embedding, "hidden": hidden}
        self.embed = nn.Embedding(vocabulary_size, embedding, padding_idx=PAD)
        self.lstm = nn.LSTM(embedding, hidden, batch_first=True)
        self.head = nn.Linear(hidden, 2)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(self.embed(tokens), lengths.cpu(), batch_first=True, enforce_sorted=False)
        _, (last_hidden, _) = self.lstm(packed)  # the state after each review's true last word
        return self.head(last_hidden[-1])

    def training_step(self, batch, batch_idx):
        tokens, lengths, labels = batch
        loss = F.cross_entropy(self(tokens, lengths), labels)
        self.log("train_loss_logged", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        tokens, lengths, labels = batch
        logits = self(tokens, lengths)
        self.log("val_loss", F.cross_entropy(logits, labels))
        self.log("val_acc", (logits.argmax(dim=1) == labels).float().mean(), prog_bar=True)

    def configure_optimizers(self):
        optimizer = torch.optim.Adam(self.parameters(), lr=5e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "epoch"}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--out", default="runs/lstm")
    args = parser.parse_args()
    reviews = read_reviews()
    train, val = reviews[:640], reviews[640:]
    counts = Counter(word for words, _ in train for word in words)
    vocabulary = {word: i + 2 for i, word in enumerate(sorted(counts))}  # 0 = padding, 1 = unknown
    trainer = lockstep.Trainer(max_epochs=args.epochs, devices=args.devices, accelerator=args.accelerator,
                               log_every_n_steps=5, log_dir=args.out, loggers=("csv", "tensorboard"),
                               gradient_clip_val=1.0)
    module = SentimentLSTM(len(vocabulary) + 2)
    loader = torch.utils.data.DataLoader(Reviews(train, vocabulary), batch_size=32, shuffle=True, collate_fn=pad_batch)
    trainer.fit(module, loader, torch.utils.data.DataLoader(Reviews(val, vocabulary), batch_size=32,
                                                           collate_fn=pad_batch))
    accuracy = trainer.callback_metrics["val_acc"]
    if trainer.is_global_zero:
        print(f"validation accuracy {accuracy:.4f} over {len(val)} reviews on {trainer.runtime.world_size} processes")
    return 0 if accuracy >= 0.85 else 1


if __name__ == "__main__":
    sys.exit(main())
