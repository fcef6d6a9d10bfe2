"""A Hugging Face causal LM on padded variable-length text, exact on any number of processes.

A tiny GPT-2 built from a config (nothing is downloaded) learns the shipped reviews
(examples/data/sentiment.tsv) word by word. Reviews differ in length, so ranks hold different
numbers of tokens: ``training_step`` returns ``num_items`` (its valid tokens), and each step's
gradient is that of the mean over every token of the global batch, on 1, 2 or 8 processes and
with any ``--accumulate``. Without it, each rank would average its own tokens and the model
would depend on the number of processes.

    pip install "lockstep[hf]"
    python examples/hf_causal_lm.py --devices 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel

import lockstep

DATA = Path(__file__).parent / "data" / "sentiment.tsv"
PAD, IGNORE = 0, -100


def read_sentences(path: Path = DATA) -> list[list[str]]:
    return [line.split("\t")[0].lower().split() for line in path.read_text().splitlines()[1:]]


class Sentences(torch.utils.data.Dataset):
    def __init__(self, sentences: list[list[str]], vocabulary: dict[str, int]) -> None:
        self.ids = [torch.tensor([vocabulary[w] for w in words]) for words in sentences]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.ids[index]


def pad(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Right-pad to the longest row of the batch; padded positions are masked and ignored by the loss."""
    longest = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), longest), PAD)
    mask = torch.zeros((len(rows), longest), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)], mask[i, : len(row)] = row, 1
    return {"input_ids": input_ids, "attention_mask": mask, "labels": input_ids.masked_fill(mask == 0, IGNORE)}


class CausalLM(lockstep.Module):
    def __init__(self, vocabulary_size: int, lr: float) -> None:
        super().__init__()
        config = GPT2Config(vocab_size=vocabulary_size, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
        self.model = GPT2LMHeadModel(config)
        self.lr = lr

    def training_step(self, batch, batch_idx):
        # The model's loss is the mean over this rank's valid next-token predictions: say how many.
        num_items = (batch["labels"][:, 1:] != IGNORE).sum()
        return {"loss": self.model(**batch).loss, "num_items": num_items}

    def validation_step(self, batch, batch_idx):
        tokens = (batch["labels"][:, 1:] != IGNORE).sum()
        self.log("val_loss", self.model(**batch).loss, batch_size=tokens)  # a mean over tokens, weighted so

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="global batch (reviews per step)")
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--out", default="runs/hf_causal_lm")
    args = parser.parse_args()
    sentences = read_sentences()
    vocabulary = {w: i + 1 for i, w in enumerate(sorted({w for s in sentences for w in s}))}  # 0 = padding
    trainer = lockstep.Trainer(max_epochs=args.epochs, devices=args.devices, accelerator=args.accelerator,
                               accumulate_grad_batches=args.accumulate, log_every_n_steps=5, log_dir=args.out,
                               enable_progress_bar=False)
    module = CausalLM(len(vocabulary) + 1, args.lr)
    train, val = Sentences(sentences[:640], vocabulary), Sentences(sentences[640:], vocabulary)
    trainer.fit(module, train, val, batch_size=args.batch_size // args.accumulate,
                val_batch_size=args.batch_size, loader_options={"collate_fn": pad})
    metrics = trainer.callback_metrics
    checksum = sum(float(p.detach().double().abs().sum()) for p in module.parameters())
    if trainer.is_global_zero:
        print(f"train_loss_epoch {metrics['train_loss_epoch']:.6f} val_loss {metrics['val_loss']:.6f} "
              f"weights {checksum:.6f} on {trainer.runtime.world_size} processes")
    return 0 if metrics["val_loss"] < 4.0 else 1


if __name__ == "__main__":
    sys.exit(main())
