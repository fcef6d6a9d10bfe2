"""A Hugging Face ``transformers`` classifier trained with the Trainer, batches as Hugging Face makes them.

A tiny BERT built from a config (nothing is downloaded), a word-level tokenizer built from the
shipped reviews (examples/data/sentiment.tsv), ``DataCollatorWithPadding`` batches (a
``BatchEncoding``), ``EarlyStopping`` on the exact validation loss, and ``predict`` returning
one prediction per review in dataset order.

    pip install "lockstep[hf]"
    python examples/hf_text_classifier.py --devices 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import BertConfig, BertForSequenceClassification, DataCollatorWithPadding, PreTrainedTokenizerFast

import lockstep

DATA = Path(__file__).parent / "data" / "sentiment.tsv"


def read_reviews(path: Path = DATA) -> list[tuple[str, int]]:
    lines = path.read_text().splitlines()[1:]
    return [(text.lower(), int(label == "positive")) for text, label in (line.split("\t") for line in lines)]


def word_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the words of ``texts``, with BERT's special tokens."""
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    words = sorted({word for text in texts for word in text.split()})
    vocabulary = {token: i for i, token in enumerate(specials + words)}
    core = Tokenizer(models.WordLevel(vocabulary, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="[PAD]", unk_token="[UNK]",
                                   cls_token="[CLS]", sep_token="[SEP]")


class Encoded(torch.utils.data.Dataset):
    """Each review tokenized on its own (lengths differ); the collator pads each batch."""

    def __init__(self, reviews: list[tuple[str, int]], tokenizer: PreTrainedTokenizerFast) -> None:
        self.rows = [{**tokenizer(text), "labels": label} for text, label in reviews]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return self.rows[index]


class Classifier(lockstep.Module):
    def __init__(self, vocabulary_size: int, pad_id: int) -> None:
        super().__init__()
        config = BertConfig(vocab_size=vocabulary_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                            intermediate_size=64, max_position_embeddings=64, pad_token_id=pad_id, num_labels=2,
                            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        self.hparams = config.to_diff_dict()
        self.model = BertForSequenceClassification(config)

    def training_step(self, batch, batch_idx):
        return self.model(**batch).loss  # batch is the collator's BatchEncoding, as Hugging Face made it

    def validation_step(self, batch, batch_idx):
        out = self.model(**batch)
        self.log("val_loss", out.loss)
        self.log("val_acc", (out.logits.argmax(dim=1) == batch["labels"]).float().mean(), prog_bar=True)

    def predict_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.argmax(dim=1)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--out", default="runs/hf_text_classifier")
    args = parser.parse_args()
    reviews = read_reviews()
    train, val = reviews[:640], reviews[640:]
    tokenizer = word_tokenizer([text for text, _ in train])
    collate = DataCollatorWithPadding(tokenizer)
    stop = lockstep.EarlyStopping(monitor="val_loss", patience=2)
    trainer = lockstep.Trainer(max_epochs=args.epochs, devices=args.devices, accelerator=args.accelerator,
                               log_every_n_steps=5, log_dir=args.out, callbacks=[stop])
    module = Classifier(tokenizer.vocab_size, tokenizer.pad_token_id)
    trainer.fit(module, Encoded(train, tokenizer), Encoded(val, tokenizer), batch_size=32,
                loader_options={"collate_fn": collate})
    metrics = dict(trainer.callback_metrics)
    predictions = trainer.predict(module, Encoded(val, tokenizer), batch_size=32,
                                  loader_options={"collate_fn": collate})
    agree = (predictions == torch.tensor([label for _, label in val])).float().mean().item()
    if trainer.is_global_zero:
        print(f"train_loss {metrics['train_loss_epoch']:.4f} val_loss {metrics['val_loss']:.4f} "
              f"val_acc {metrics['val_acc']:.4f} over {len(val)} reviews on {trainer.runtime.world_size} processes")
        print(f"predict() gave {len(predictions)} rows in dataset order, accuracy {agree:.4f}")
    return 0 if metrics["val_acc"] >= 0.8 and abs(agree - metrics["val_acc"]) < 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
