"""Context parallel on Hugging Face models built from tiny configs (Llama, Qwen2): rank functions for the
context-parallel tests, and their one-process reference, a hand-written loop."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import lockstep
from checks import hf as hc
from checks.dist import layout
from checks.mesh import train_steps

VOCAB = 64
LENGTH = 24  # every row padded at its end to this length: a multiple of 2 × cp for cp 2 and 4
IGNORE = -100
LR = 0.5


def tiny_model(kind: str = "llama", seed: int = 0, attention: str = "sdpa") -> nn.Module:
    """A two-layer causal LM from a config, grouped-query attention, SDPA attention (or ``attention``), no
    dropout."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    shape = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                 attn_implementation=attention)
    if kind == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**shape))
    return LlamaForCausalLM(LlamaConfig(**shape))


class Rows(torch.utils.data.Dataset):
    """Token rows of 2..20 tokens padded at the end to ``LENGTH`` (labels -100 there), no attention mask,
    each with its dataset index."""

    def __init__(self, n: int = 40) -> None:
        self.rows = hc.sequences(n)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.rows[index]
        ids = torch.zeros(LENGTH, dtype=torch.long)
        ids[: len(row)] = row
        labels = torch.full((LENGTH,), IGNORE, dtype=torch.long)
        labels[: len(row)] = row
        return {"input_ids": ids, "labels": labels, "index": torch.tensor(index)}


def valid_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The tokens with a label to predict: of the shifted labels under cp, else of the labels less the first."""
    shifted = batch.get("shift_labels")
    return (shifted != IGNORE).sum() if shifted is not None else (batch["labels"][:, 1:] != IGNORE).sum()


def optimizer_for(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """SGD: an update proportional to the gradient, so that the weights compare the gradients (AdamW divides
    by the gradients' own size, which turns float noise in a near-zero gradient into a step of ``lr``)."""
    return torch.optim.SGD(model.parameters(), lr=lr)


def reference_weights(kind: str = "llama", steps: int = 5, batch_size: int = 8, lr: float = LR,
                      clip: float | None = None) -> torch.Tensor:
    """A hand-written one-process loop: the sum of every valid token's cross-entropy over the global batch,
    divided by their number; SGD."""
    model = tiny_model(kind)
    optimizer = optimizer_for(model, lr)
    rows = Rows()
    for step in range(steps):
        batch = torch.utils.data.default_collate([rows[i] for i in range(step * batch_size, (step + 1) * batch_size)])
        logits = model(input_ids=batch["input_ids"]).logits
        targets = batch["labels"][:, 1:]
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), targets.reshape(-1), ignore_index=IGNORE,
                               reduction="sum") / (targets != IGNORE).sum()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    return hc.flat(model)


def cp_weights(strategy, kind: str = "llama", steps: int = 5, batch_size: int = 8, lr: float = LR,
               accumulate: int = 1, clip: float | None = None, precision: str = "32-true") -> dict:
    """The same run through the runtime API on ``strategy``: the model's own loss, with num_items."""
    rt = lockstep.Runtime(accelerator="cpu", seed=0, precision=precision, **layout(strategy))
    model = tiny_model(kind)
    model, optimizer = rt.setup(model, optimizer_for(model, lr))
    loader = rt.loader(Rows(), batch_size=batch_size // accumulate, num_workers=0)
    seen, last = train_steps(rt, model, optimizer, loader, valid_tokens, steps, accumulate, clip)
    return {"weights": hc.flat(model), "seen": seen, "length": int(last["input_ids"].size(1))}


class OwnAttention(nn.Module):
    """A model of one's own, the documented way: ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` on
    ``(batch, heads, positions, head_dim)``, positions taken from the batch (learned position embeddings)."""

    def __init__(self, width: int = 32, heads: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.heads = heads
        self.tokens, self.positions = nn.Embedding(VOCAB, width), nn.Embedding(LENGTH, width)
        self.qkv, self.out, self.head = nn.Linear(width, 3 * width), nn.Linear(width, width), nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.tokens(tokens) + self.positions(positions)
        rows, length, width = x.shape
        q, k, v = (t.view(rows, length, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(rows, length, width)
        return self.head(x + self.out(attended))


def own_rows(n: int = 40) -> torch.utils.data.TensorDataset:
    """(tokens, positions, next-token targets shifted over the whole row, -100 on the padding) per row."""
    rows = Rows(n)
    tokens = torch.stack([rows[i]["input_ids"] for i in range(n)])
    labels = torch.stack([rows[i]["labels"] for i in range(n)])
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE)
    return torch.utils.data.TensorDataset(tokens, torch.arange(LENGTH).expand(n, LENGTH).clone(), targets)


def own_loss(model: nn.Module, tokens, positions, targets) -> torch.Tensor:
    logits = model(tokens, positions)
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), ignore_index=IGNORE)


def own_attention_weights(strategy=None, steps: int = 5, batch_size: int = 8) -> torch.Tensor:
    """A hand-written loop (strategy None: one process, no lockstep) or the runtime API on ``strategy``."""
    model = OwnAttention()
    if strategy is None:
        optimizer, data = optimizer_for(model, LR), own_rows()
        for step in range(steps):
            tokens, positions, targets = data[step * batch_size:(step + 1) * batch_size]
            own_loss(model, tokens, positions, targets).backward()
            optimizer.step()
            optimizer.zero_grad()
        return hc.flat(model)
    rt = lockstep.Runtime(accelerator="cpu", seed=0, **layout(strategy))
    model, optimizer = rt.setup(model, optimizer_for(model, LR))
    for step, (tokens, positions, targets) in enumerate(rt.loader(own_rows(), batch_size=batch_size, num_workers=0)):
        rt.backward(own_loss(model, tokens, positions, targets), num_items=(targets != IGNORE).sum())
        optimizer.step()
        optimizer.zero_grad()
        if step + 1 == steps:
            break
    return hc.flat(model)
