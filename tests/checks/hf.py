"""Hugging Face models for the tests, built from configs (nothing downloaded), and their rank functions."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import lockstep
from checks import fsdp as fsdp_checks
from checks.dist import layout

IGNORE = -100


def tiny_gpt2(seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=50, n_positions=32, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def sequences(n: int = 40, seed: int = 0) -> list[torch.Tensor]:
    """Token rows of lengths 2..20, so that ranks and micro-batches hold very different token counts."""
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 21, (n,), generator=generator)
    return [torch.randint(1, 50, (int(length),), generator=generator) for length in lengths]


def pad(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    longest = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), longest), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = row, 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, IGNORE)}


def valid_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return (batch["labels"][:, 1:] != IGNORE).sum()


flat = fsdp_checks.full_weights  # every weight in one vector, FSDP shards gathered whole


def reference_weights(steps: int = 5, batch_size: int = 8, lr: float = 0.5) -> torch.Tensor:
    """A hand-written loop on one process: each step's loss is the sum of every valid token's
    cross-entropy in the global batch, divided by their number (computed here from the logits)."""
    model = tiny_gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    rows = sequences()
    for step in range(steps):
        batch = pad(rows[step * batch_size:(step + 1) * batch_size])
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        targets = batch["labels"][:, 1:]
        per_token = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                    ignore_index=IGNORE, reduction="sum")
        (per_token / (targets != IGNORE).sum()).backward()
        optimizer.step()
        optimizer.zero_grad()
    return flat(model)


def lockstep_weights(batch_size: int = 8, accumulate: int = 1, use_num_items: bool = True,
                     strategy: str = "auto", lr: float = 0.5, steps: int = 5) -> torch.Tensor:
    """The same run through the runtime API: the model's own (per-rank mean) loss, with num_items."""
    rt = lockstep.Runtime(accelerator="cpu", seed=0, **layout(strategy))
    model = tiny_gpt2()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model, optimizer = rt.setup(model, optimizer)
    loader = rt.loader(sequences(), batch_size=batch_size // accumulate, shuffle=False, collate_fn=pad,
                       num_workers=0)
    for i, batch in enumerate(loader):
        last = (i + 1) % accumulate == 0
        with rt.no_sync(model, enabled=not last):
            loss = model(**batch).loss
            rt.backward(loss, num_items=valid_tokens(batch)) if use_num_items else rt.backward(loss / accumulate)
        if last:
            optimizer.step()
            optimizer.zero_grad()
        if i + 1 == steps * accumulate:
            break
    return flat(model)


def gathered_model_outputs() -> object:
    """``ModelOutput``s per evaluation batch, gathered into one ``ModelOutput`` in dataset order."""
    from transformers.modeling_outputs import SequenceClassifierOutput

    rt = lockstep.Runtime(accelerator="cpu")
    outputs = []
    for (x,) in rt.eval_loader(torch.utils.data.TensorDataset(torch.arange(10.0)[:, None]), batch_size=4,
                               num_workers=0):
        outputs.append(SequenceClassifierOutput(logits=x * 2))
    return rt.gather(outputs)
