"""A small Llama (``transformers``, built from a config) cut into pipeline stages: rank functions for the
pipeline tests, and their one-process references (hand-written loops)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import lockstep
from checks import hf as hc
from checks import mesh as mc
from checks.dist import layout

VOCAB = mc.VOCAB


def llama(layers: int = 4, seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


LENGTH = 20  # every row padded to the longest of hf_checks.sequences: pipeline stages take one shape


def collate(items: list[tuple[torch.Tensor, int]]) -> dict[str, torch.Tensor]:
    batch = hc.pad([torch.cat([row, row.new_zeros(LENGTH - len(row))]) for row, _ in items])
    valid = torch.stack([torch.arange(LENGTH) < len(row) for row, _ in items])
    batch["labels"] = batch["labels"].masked_fill(~valid, hc.IGNORE)
    batch["index"] = torch.tensor([index for _, index in items])
    return batch


def gpt2(seed: int = 0) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=4, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    return GPT2LMHeadModel(config)


def qwen2(seed: int = 0) -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False)
    return Qwen2ForCausalLM(config)


class DictBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.mlp = nn.RMSNorm(width), nn.Sequential(nn.Linear(width, 2 * width), nn.SiLU(),
                                                               nn.Linear(2 * width, width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlp(self.norm(h))


class DictNet(nn.Module):
    """Layers in an ``nn.ModuleDict`` keyed "0", "1", ... and called in a loop over its values, as
    torchtitan's models keep them; a per-token model (no attention), returning the logits."""

    def __init__(self, layers: int = 4, width: int = 32) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, width)
        self.layers = nn.ModuleDict({str(i): DictBlock(width) for i in range(layers)})
        self.norm, self.output = nn.RMSNorm(width), nn.Linear(width, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(input_ids) if not input_ids.is_floating_point() else input_ids
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


class NotAChain(DictNet):
    """A model whose forward does work between its blocks (``between``: ``tanh`` after each block, a
    ``residual`` around each, or a ``scale`` on the embeddings' output before the first): under pipeline
    parallel that code would run again on every stage."""

    def __init__(self, between: str) -> None:
        super().__init__()
        self.between = between

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(input_ids) if not input_ids.is_floating_point() else input_ids
        if self.between == "scale":
            h = h * 2.0
        for layer in self.layers.values():
            h = torch.tanh(layer(h)) if self.between == "tanh" else h + layer(h) if self.between == "residual" \
                else layer(h)
        return self.output(self.norm(h))


def dict_net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return DictNet()


MODELS = {"llama": llama, "gpt2": gpt2, "qwen2": qwen2, "dict": dict_net}


def token_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The mean cross-entropy over the valid next tokens of these rows."""
    targets = batch["labels"][:, 1:]
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), targets.reshape(-1), ignore_index=hc.IGNORE,
                           reduction="sum") / (targets != hc.IGNORE).sum().clamp(min=1)


def row_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The mean over rows of each row's summed cross-entropy (a plain per-row mean, no item count)."""
    targets = batch["labels"][:, 1:]
    per_token = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), targets.reshape(-1), ignore_index=hc.IGNORE,
                                reduction="none")
    return per_token.reshape(targets.shape).sum(1).mean()


def reference(steps: int = 4, batch_size: int = 8, clip: float | None = None, lr: float = 0.5, rows: int = 40,
              items: bool = True, kind: str = "llama") -> torch.Tensor:
    """A hand-written one-process loop: SGD on the mean over the global batch's valid tokens (or rows)."""
    model = MODELS[kind]()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    data = hc.sequences(rows)
    for step in range(steps):
        batch = hc.pad(data[step * batch_size:(step + 1) * batch_size])
        output = model(input_ids=batch["input_ids"])
        (token_loss if items else row_loss)(getattr(output, "logits", output), batch).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    return flat_named({n: p.detach() for n, p in model.named_parameters()}, kind)


def mixed_reference(precision: str, steps: int = 3, clip: float = 0.5, microbatches: int = 2
                    ) -> tuple[torch.Tensor, list[float]]:
    """A hand-written one-process loop under autocast (``bf16-mixed``; ``16-mixed`` with a GradScaler), each
    global batch of 8 rows padded to LENGTH as the pipeline runs it and cut into the same micro-batches: the
    mean over the batch's valid tokens, as num_items computes it so that the low-precision backward rounds the
    same: each micro-batch's backward on its token sum divided by a power of two ``c`` (the first micro-batch's
    tokens, then the last step's, rounded down to a power of two), the gradients times ``c`` over the batch's
    tokens before clipping."""
    dtype = torch.float16 if precision == "16-mixed" else torch.bfloat16
    model, data = llama(), mc.Rows(40)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    losses: list[float] = []
    c = None
    for step in range(steps):
        batch = collate([data[i] for i in range(step * 8, step * 8 + 8)])
        total, losses = int(hc.valid_tokens(batch)), [*losses, 0.0]
        for part in range(microbatches):
            rows = {key: value.chunk(microbatches)[part] for key, value in batch.items()}
            items = int(hc.valid_tokens(rows))
            c = c or 2 ** (items.bit_length() - 1)
            with torch.autocast("cpu", dtype=dtype):
                logits = model(input_ids=rows["input_ids"]).logits
            mean = token_loss(logits.float(), rows)
            loss = mean * torch.tensor(items / c, dtype=torch.float32)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            losses[-1] += float(mean) * items / total
        if scaler is not None:
            scaler.unscale_(optimizer)
        for param in model.parameters():
            param.grad.mul_(torch.tensor(c / total, dtype=torch.float64).float())
        c = 2 ** (total.bit_length() - 1)
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad()
    return flat_named({n: p.detach() for n, p in model.named_parameters()}), losses


def flat_named(weights: dict[str, torch.Tensor], kind: str = "llama") -> torch.Tensor:
    """The whole model's weights in one vector, in the order of a fresh model's parameters (float32 at least)."""
    return torch.cat([weights[name].to(torch.promote_types(weights[name].dtype, torch.float32)).reshape(-1)
                      for name, _ in MODELS[kind]().named_parameters()])


def whole_weights(rt, named, kind: str = "llama") -> torch.Tensor:
    """Every rank's stage weights (shards gathered; ``named``: a model, or its named parameters), put
    together into the whole model's vector."""
    mine = {}
    if isinstance(named, nn.Module):
        named = lockstep.unwrap(named).named_parameters()
    for name, param in named:
        value = param.detach()
        mine[name] = (value.full_tensor() if isinstance(value, DTensor) else value).cpu()
    parts = [mine]
    if rt.world_size > 1:  # each rank holds other names: gathered as objects
        parts = [None] * rt.world_size
        torch.distributed.all_gather_object(parts, mine)
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    return flat_named(merged, kind)


def pipeline_weights(strategy, steps: int = 4, accumulate: int = 1, clip: float | None = None, lr: float = 0.5,
                     rows: int = 40, items: bool = True, batch_size: int = 8, kind: str = "llama",
                     precision: str = "32-true") -> dict:
    """The same run through ``rt.forward_backward`` on ``strategy``."""
    rt = lockstep.Runtime(accelerator="cpu", seed=0, **layout(strategy), precision=precision)
    model = MODELS[kind]()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    model, optimizer = rt.setup(model, optimizer)
    loader = rt.loader(mc.Rows(rows), batch_size=batch_size // accumulate, collate_fn=collate, num_workers=0)
    losses = []
    for i, batch in enumerate(loader):
        last = (i + 1) % accumulate == 0 or i + 1 == len(loader)  # a short last step: its micro-batches alone
        with rt.no_sync(model, enabled=not last):
            loss = rt.forward_backward(model, batch, token_loss if items else row_loss,
                                       num_items=hc.valid_tokens if items else None)
        losses.append(float(loss))
        if last:
            if clip is not None:
                rt.clip_grad_norm_(model, optimizer, clip)
            optimizer.step()
            optimizer.zero_grad()
        if i + 1 == steps * accumulate:
            break
    return {"weights": whole_weights(rt, model, kind), "losses": losses, "pp": rt.pipeline_parallel_size,
            "data": (rt.data_parallel_rank, rt.data_parallel_size)}


def _run(strategy, folder: str | None, resume: bool, steps: int, save_after: int | None = None) -> dict:
    """Two epochs of 32 rows (global batch 8) through ``rt.forward_backward``; saves after ``save_after``
    steps of the first epoch when given, resumes from ``folder`` first when ``resume``."""
    rt = lockstep.Runtime(accelerator="cpu", seed=0, **layout(strategy))
    model = llama()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    model, optimizer = rt.setup(model, optimizer)
    loader = rt.loader(mc.Rows(32), batch_size=8, shuffle=True, collate_fn=collate, num_workers=0)
    state = {"model": model, "optimizer": optimizer, "loader": loader}
    if resume:
        rt.load(folder, state)
    done, saved = 0, None
    for _ in range(2):
        for batch in loader:
            rt.forward_backward(model, batch, token_loss, num_items=hc.valid_tokens)
            rt.clip_grad_norm_(model, optimizer, 1.0)
            optimizer.step()
            optimizer.zero_grad()
            done += 1
            if save_after is not None and done == save_after:
                rt.save(folder, state)
                saved = whole_weights(rt, model)
        if done >= steps:
            break
    return {"weights": whole_weights(rt, model), "saved": saved}


def save_and_finish(strategy, folder: str) -> dict:
    return _run(strategy, folder, False, 8, save_after=3)


def resume_and_finish(strategy, folder: str) -> dict:
    return _run(strategy, folder, True, 8)


class LlamaModule(lockstep.Module):
    """A Trainer module on pipeline stages: ``forward`` is the model, ``loss_fn`` the loss of some rows."""

    def __init__(self) -> None:
        super().__init__()
        self.model = llama()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits

    def training_step(self, batch, batch_idx):  # what pp = 1 runs
        return {"loss": token_loss(self(batch["input_ids"]), batch), "num_items": hc.valid_tokens(batch)}

    def loss_fn(self, output, batch):
        return token_loss(output, batch)

    def num_items(self, batch):
        return hc.valid_tokens(batch)

    def validation_step(self, batch, batch_idx):  # self(...) runs every stage in turn
        self.log("val_loss", token_loss(self(batch["input_ids"]), batch), batch_size=hc.valid_tokens(batch))

    def predict_step(self, batch, batch_idx):
        return {"index": batch["index"], "first": self(batch["input_ids"])[:, 0]}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def trainer_weights(strategy) -> dict:
    """The Trainer on ``strategy``: 39 rows, global batch 16 (a short last step), clipping, num_items."""
    module = LlamaModule()
    trainer = lockstep.Trainer(accelerator="cpu", **layout(strategy), max_steps=3, seed=0, gradient_clip_val=0.5,
                               enable_progress_bar=False, loggers=())
    data = torch.utils.data.DataLoader(mc.Rows(39), batch_size=16, collate_fn=collate)  # in order, as the reference
    trainer.fit(module, data)
    named = ((name.removeprefix("model."), param) for name, param in module.named_parameters())
    return {"weights": whole_weights(trainer.runtime, named)}


def trainer_evaluation(strategy) -> dict:
    """The Trainer's validate and predict over 13 rows (4 per batch: uneven over 2 data-parallel ranks)."""
    module = LlamaModule()
    trainer = lockstep.Trainer(accelerator="cpu", **layout(strategy), seed=0, enable_progress_bar=False, loggers=())
    options = {"collate_fn": collate, "num_workers": 0}
    metrics = trainer.validate(module, mc.Rows(13), batch_size=4, loader_options=options)
    predictions = trainer.predict(module, mc.Rows(13), batch_size=4, loader_options=options)
    return {"val_loss": metrics["val_loss"], "index": predictions["index"], "first": predictions["first"]}


def reference_validation() -> float:
    """The mean cross-entropy over every valid next token of the 13 rows, by hand."""
    model, rows = llama(), mc.Rows(13)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(13):
            batch = collate([rows[i]])
            tokens = int(hc.valid_tokens(batch))
            total += float(token_loss(model(input_ids=batch["input_ids"]).logits, batch)) * tokens
            count += tokens
    return total / count


def skipped_on_every_stage(strategy) -> dict:
    """16-mixed: an inf planted in one gradient of the first stage's rank at step 2 only; every rank must skip
    that step (the GradScaler's inf check agreed over every stage)."""
    rt = lockstep.Runtime(accelerator="cpu", seed=0, **layout(strategy), precision="16-mixed")
    model = llama()
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    loader = rt.loader(mc.Rows(32), batch_size=8, collate_fn=collate, num_workers=0)
    skipped = []
    for step, batch in enumerate(loader):
        rt.forward_backward(model, batch, token_loss, num_items=hc.valid_tokens)
        if step == 2 and rt.rank == 0:  # this rank's shard of the first gradient it holds
            grad = next(p for p in lockstep.unwrap(model).parameters() if p.grad is not None).grad
            (grad.to_local() if isinstance(grad, DTensor) else grad).view(-1)[0] = float("inf")
        before = whole_weights(rt, model)
        optimizer.step()
        optimizer.zero_grad()
        skipped.append((rt.step_was_skipped, bool(torch.equal(before, whole_weights(rt, model)))))
    return {"skipped": skipped}


def refused(strategy, layers: int | str, evaluate: bool = False) -> None:
    """One step (or one evaluation forward) of a layout that cannot work (``layers=0``: a model with no
    repeated blocks; a string: a ``NotAChain`` model with that code between its blocks)."""
    rt = lockstep.Runtime(accelerator="cpu", seed=0, **layout(strategy))
    torch.manual_seed(0)
    model = (NotAChain(layers) if isinstance(layers, str) else llama(layers) if layers
             else nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)))
    model, _ = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))  # num_items needs its optimizer
    loader = rt.loader(mc.Rows(32), batch_size=8 * rt.data_parallel_size, collate_fn=collate, num_workers=0)
    batch = next(iter(loader))
    if evaluate:
        with torch.no_grad():
            model(batch["input_ids"])
    else:
        rt.forward_backward(model, batch, token_loss, num_items=hc.valid_tokens)


def gathered_logits(strategy) -> dict:
    """Evaluation over 13 rows (uneven over the data-parallel ranks: zero-row padding batches), the first
    position's logits gathered in dataset order."""
    rt = lockstep.Runtime(accelerator="cpu", seed=0, **layout(strategy))
    model = rt.setup(llama())
    outputs, indices = [], []
    with torch.no_grad():
        for batch in rt.eval_loader(mc.Rows(13), batch_size=4, collate_fn=collate, num_workers=0):
            outputs.append(model(batch["input_ids"])[:, 0])
            indices.append(batch["index"])
    return {"logits": rt.gather(outputs), "indices": rt.gather(indices)}


def reference_logits() -> torch.Tensor:
    model, rows = llama(), mc.Rows(13)
    with torch.no_grad():
        return torch.cat([model(input_ids=collate([rows[i]])["input_ids"]).logits[:, 0] for i in range(13)])


def stage_under_fsdp(strategy, precision: str) -> bool:
    """Whether this rank's stage runs under FSDP (whose policy makes a mixed precision)."""
    from torch.distributed.fsdp import FSDPModule

    rt = lockstep.Runtime(accelerator="cpu", seed=0, **layout(strategy), precision=precision)
    return isinstance(lockstep.unwrap(rt.setup(llama())), FSDPModule)


def _token_weights(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """A weight per next token, 0.001 to 0.003 (0 where there is no label): a step's weights add up to less than 1."""
    targets = batch["labels"][:, 1:]
    return torch.where(targets != hc.IGNORE, 0.001 * (1 + targets.clamp(min=0) % 3), 0.0).double()


def weighted_token_loss(logits: torch.Tensor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The weighted mean cross-entropy over the next tokens of these rows (a weighted mean: num_items is
    the weights' sum)."""
    targets = batch["labels"][:, 1:]
    per_token = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), targets.reshape(-1), ignore_index=hc.IGNORE,
                                reduction="none").reshape(targets.shape)
    weights = _token_weights(batch)
    return (per_token * weights).sum() / weights.sum().clamp(min=1e-12)


def weighted_float64_steps(strategy, steps: int = 3) -> dict:
    """A float64 model trained on a weighted mean whose weights sum to less than 1 per step
    (``num_items`` the weights' sum), through ``rt.forward_backward``: the reported losses and the weights."""
    rt = lockstep.Runtime(accelerator="cpu", seed=0, precision="64-true", **layout(strategy))
    model = dict_net()
    optimizer = torch.optim.SGD(model.parameters(), lr=5.0)  # weighted means of few tokens: a visible step
    model, optimizer = rt.setup(model, optimizer)
    loader = rt.loader(mc.Rows(24), batch_size=8, collate_fn=collate, num_workers=0)
    losses = []
    for i, batch in enumerate(loader):
        loss = rt.forward_backward(model, batch, weighted_token_loss, num_items=lambda rows: _token_weights(rows).sum())
        losses.append(float(loss))
        optimizer.step()
        optimizer.zero_grad()
        if i + 1 == steps:
            break
    return {"weights": whole_weights(rt, model, "dict"), "losses": losses}
