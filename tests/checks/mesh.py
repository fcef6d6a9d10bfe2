"""A small Llama (``transformers``, built from a config) on a device mesh: rank functions for the
tensor-parallel, 2-D and activation-checkpointing tests, and their one-process references."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import lockstep
from checks import dist as checks
from checks import hf as hc
from checks.dist import layout

VOCAB = 64


def tiny_llama(seed: int = 0) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return LlamaForCausalLM(config)


class Rows(torch.utils.data.Dataset):
    """Token rows of lengths 2..20 (``hf_checks.sequences``), each with its dataset index."""

    def __init__(self, n: int = 40) -> None:
        self.rows = hc.sequences(n)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.rows[index], index


def collate(items: list[tuple[torch.Tensor, int]]) -> dict[str, torch.Tensor]:
    batch = hc.pad([row for row, _ in items])
    batch["index"] = torch.tensor([index for _, index in items])
    return batch


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in batch.items() if k != "index"}


def reference_weights(steps: int = 5, batch_size: int = 8, clip: float | None = None, lr: float = 1e-3,
                      rows: int = 40) -> torch.Tensor:
    """A hand-written one-process loop: the mean over every valid token of the global batch, AdamW."""
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rows = hc.sequences(rows)
    for step in range(steps):
        batch = hc.pad(rows[step * batch_size:(step + 1) * batch_size])
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        targets = batch["labels"][:, 1:]
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), targets.reshape(-1), ignore_index=hc.IGNORE,
                               reduction="sum") / (targets != hc.IGNORE).sum()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad()
    return hc.flat(model)


def mesh_weights(strategy, accumulate: int = 1, clip: float | None = None, checkpointing=None,
                 steps: int = 5, batch_size: int = 8, lr: float = 1e-3, rows: int = 40, accelerator: str = "cpu",
                 devices="auto") -> dict:
    """The same run through lockstep, on ``strategy``: the model's own loss with num_items."""
    rt = lockstep.Runtime(accelerator=accelerator, devices=devices, seed=0, **layout(strategy))
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model, optimizer = rt.setup(model, optimizer, activation_checkpointing=checkpointing)
    loader = rt.loader(Rows(rows), batch_size=batch_size // accumulate, collate_fn=collate, num_workers=0)
    seen, _ = train_steps(rt, model, optimizer, loader, hc.valid_tokens, steps, accumulate, clip)
    return {"weights": hc.flat(model), "seen": seen, "data_rank": rt.data_parallel_rank,
            "data_size": rt.data_parallel_size, "tp_size": rt.tensor_parallel_size}


def train_steps(rt, model, optimizer, loader, count, steps: int, accumulate: int = 1,
                clip: float | None = None) -> tuple[list[list[int]], dict]:
    """``steps`` optimizer steps of ``accumulate`` micro-batches each: the model's own loss with
    ``num_items=count(batch)``, clipped at ``clip``. Returns each micro-batch's dataset indices, and the last
    micro-batch."""
    seen = []
    for i, batch in enumerate(loader):
        seen.append(batch["index"].tolist())
        last = (i + 1) % accumulate == 0
        with rt.no_sync(model, enabled=not last):
            rt.backward(model(**model_inputs(batch)).loss, num_items=count(batch))
        if last:
            if clip is not None:
                rt.clip_grad_norm_(model, optimizer, clip)
            optimizer.step()
            optimizer.zero_grad()
        if i + 1 == steps * accumulate:
            break
    return seen, batch


def gathered_logits(strategy) -> dict:
    """Evaluation over 13 rows (uneven over the data-parallel ranks): logits gathered in dataset order."""
    rt = lockstep.Runtime(accelerator="cpu", seed=0, **layout(strategy))
    model = rt.setup(tiny_llama())
    outputs, indices = [], []
    with torch.no_grad():
        for batch in rt.eval_loader(Rows(13), batch_size=4, collate_fn=collate, num_workers=0):
            outputs.append(model(**model_inputs(batch)).logits[:, 0])
            indices.append(batch["index"])
    return {"logits": rt.gather(outputs), "indices": rt.gather(indices)}


def reference_logits() -> torch.Tensor:
    model, rows = tiny_llama(), Rows(13)
    with torch.no_grad():
        return torch.cat([model(**model_inputs(collate([rows[i]])))["logits"][:, 0] for i in range(13)])


def _steps(rt, model, optimizer, loader, consumed: list, stop_after: int | None = None) -> None:
    """Train over a pass of ``loader``, recording each step's global sample indices (one copy per
    data-parallel rank: tensor-parallel peers see the same batch)."""
    for step, batch in enumerate(loader):
        by_data_rank = dict(rt.all_gather((rt.data_parallel_rank, batch["index"].tolist())))
        consumed.append(sorted(i for indices in by_data_rank.values() for i in indices))
        rt.backward(model(**model_inputs(batch)).loss, num_items=hc.valid_tokens(batch))
        rt.clip_grad_norm_(model, optimizer, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        if stop_after is not None and step == stop_after:
            return


def _setup(strategy, seed: int = 0):
    rt = lockstep.Runtime(accelerator="cpu", **layout(strategy), seed=0)
    model = tiny_llama(seed)
    model, optimizer = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    loader = rt.loader(Rows(), batch_size=8, shuffle=True, collate_fn=collate, num_workers=0)
    return rt, model, optimizer, loader


def save_mid_epoch(strategy, folder: str) -> dict:
    """Two epochs of 5 steps, saved after step 2 of epoch 1, then finished: the uninterrupted run."""
    rt, model, optimizer, loader = _setup(strategy)
    consumed: list = []
    _steps(rt, model, optimizer, loader, consumed)
    epoch_1 = iter(loader)
    _steps(rt, model, optimizer, epoch_1, consumed, stop_after=2)
    rt.save(folder, {"model": model, "optimizer": optimizer, "loader": loader, "step": len(consumed)})
    with torch.no_grad():
        logits = model(**model_inputs(probe())).logits
    saved = hc.flat(model)
    _steps(rt, model, optimizer, epoch_1, consumed)
    return {"weights": hc.flat(model), "consumed": consumed, "saved_weights": saved, "saved_logits": logits}


def probe() -> dict[str, torch.Tensor]:
    """Three rows to compare a model's logits on."""
    rows = Rows(3)
    return collate([rows[i] for i in range(3)])


def resume_from(strategy, folder: str) -> dict:
    """Load what ``save_mid_epoch`` saved into a model with other weights, then finish the run."""
    rt, model, optimizer, loader = _setup(strategy, seed=5)
    state = rt.load(folder, {"model": model, "optimizer": optimizer, "loader": loader, "step": -1})
    consumed: list = []
    _steps(rt, model, optimizer, loader, consumed)
    return {"step": state["step"], "weights": hc.flat(model), "consumed": consumed}


class LlamaModule(lockstep.Module):
    """The Trainer's view of the same run: token-averaged loss through ``num_items``."""

    def __init__(self) -> None:
        super().__init__()
        self.llama = tiny_llama()

    def training_step(self, batch, batch_idx):
        return {"loss": self.llama(**model_inputs(batch)).loss, "num_items": hc.valid_tokens(batch)}

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)

    def predict_step(self, batch, batch_idx):
        return self.llama(**model_inputs(batch)).logits[:, 0]


def trainer_predictions(strategy) -> torch.Tensor:
    """The Trainer's predictions over 13 rows (uneven over the data-parallel ranks), untrained."""
    from checks import trainer as tc

    return tc.quiet_trainer(**layout(strategy)).predict(LlamaModule(), Rows(13), batch_size=4,
                                                        loader_options={"collate_fn": collate})


def trainer_weights(strategy, checkpointing=None) -> torch.Tensor:
    from checks import trainer as tc

    module = LlamaModule()
    trainer = tc.quiet_trainer(max_steps=5, **layout(strategy), gradient_clip_val=0.5,
                               activation_checkpointing=checkpointing)
    trainer.fit(module, Rows(), batch_size=8, loader_options={"collate_fn": collate})
    return hc.flat(module.llama)


def stack_grads(strategy, checkpointing=None, compile: bool = False) -> torch.Tensor:
    """One backward of ``fsdp_checks.Stack`` (blocks of our own, not Hugging Face layers): its whole gradients."""
    from checks import fsdp as fc

    rt = lockstep.Runtime(accelerator="cpu", seed=0, **layout(strategy))
    model = rt.setup(fc.make_stack(), activation_checkpointing=checkpointing, compile=compile)
    for x, y in rt.loader(fc.checks.make_data(32), batch_size=16, num_workers=0):
        rt.backward(F.cross_entropy(model(x), y))
        break
    from lockstep.runtime._torch_compat import full_tensor

    return torch.cat([full_tensor(p.grad).reshape(-1) for p in lockstep.unwrap(model).parameters()])


def flops_of_one_step(strategy) -> int:
    """What the Trainer's FLOP count sees for one forward and backward of 4 rows on this rank."""
    from lockstep.runtime import FlopCount

    rt = lockstep.Runtime(accelerator="cpu", seed=0, **layout(strategy))
    model = rt.setup(tiny_llama())
    rows = Rows(4)
    count = FlopCount(tp=rt.tensor_parallel_size)
    count.start()
    model(**model_inputs(collate([rows[i] for i in range(4)]))).loss.backward()
    return count.stop()


def built_empty_on_the_mesh() -> dict:
    """``fsdp_checks.Stack`` built on the meta device, then tensor parallel × FSDP: what each rank holds."""
    from checks import fsdp as fc
    from lockstep.runtime._torch_compat import to_local

    plan = {"blocks.*.linear": "colwise_gather_output"}
    rt = lockstep.Runtime(accelerator="cpu", seed=0, strategy="fsdp", parallel=lockstep.Parallel(tp=2, tp_plan=plan))
    with rt.init_module(empty=True):
        model = fc.Stack()
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    inner = lockstep.unwrap(model)
    losses = []
    for x, y in rt.loader(fc.checks.make_data(32), batch_size=8, num_workers=0):
        loss = F.cross_entropy(model(x), y)
        rt.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    return {"embed": to_local(inner.embed.weight).detach().clone(),
            "block": to_local(inner.blocks[0].linear.weight).detach().clone(),
            "losses": losses, "finite": bool(torch.isfinite(fc.full_weights(model)).all())}


class GatedBlock(nn.Module):
    """A Llama-style MLP block of our own: gate and up split by columns, down by rows."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(width, 64), nn.Linear(width, 64), nn.Linear(64, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.silu(self.gate(x)) * self.up(x))


class GatedNet(nn.Module):
    PLAN = {"blocks.*.gate": "colwise", "blocks.*.up": "colwise", "blocks.*.down": "rowwise"}

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Linear(8, 32), nn.Linear(32, 4)
        self.blocks = nn.ModuleList([GatedBlock(), GatedBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def gated_weights(strategy, compile: bool = False) -> dict:
    """Two epochs of ``GatedNet`` with AdamW and clipping, optionally compiled: its whole weights."""
    from checks import dist as checks
    from lockstep.runtime._torch_compat import full_tensor

    rt = lockstep.Runtime(accelerator="cpu", seed=0, **layout(strategy))
    model = GatedNet()
    model, optimizer = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2), compile=compile)
    for x, y in rt.loader(checks.make_data(64), batch_size=16, num_workers=0):
        rt.backward(F.cross_entropy(model(x), y))
        rt.clip_grad_norm_(model, optimizer, 1.0)
        optimizer.step()
        optimizer.zero_grad()
    weights = torch.cat([full_tensor(p.detach()).reshape(-1) for p in lockstep.unwrap(model).parameters()])
    return {"weights": weights, "compiled": rt.compiled}


def trainer_checkpoint(strategy, folder: str) -> torch.Tensor:
    """Fit 3 steps with checkpoints in ``folder``; the trained model's logits on ``probe()``."""
    from checks import trainer as tc

    module = LlamaModule()
    trainer = tc.quiet_trainer(max_steps=3, **layout(strategy), checkpoint_dir=folder)
    trainer.fit(module, Rows(24), batch_size=8, loader_options={"collate_fn": collate})
    whole = trainer.runtime.full_state_dict(module, rank0_only=False)  # shards gathered
    plain = tiny_llama(seed=7)
    plain.load_state_dict({name.removeprefix("llama."): t for name, t in whole.items()})
    with torch.no_grad():
        return plain(**model_inputs(probe())).logits


def float8_against_plain_2d() -> float:
    """``float8`` on dp2 × tp2 against a hand-written 2-D loop: torchao's conversion, the model's
    tensor-parallel plan written out as torch's styles, ``fully_shard`` over dp with bf16
    parameters, and the loss summed over this rank's tokens, the gradients scaled by dp / all tokens.
    Returns the largest weight difference after 3 AdamW steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torchao.float8 import convert_to_float8_training

    steps, batch_size = 3, 8
    rt = lockstep.Runtime(accelerator="cpu", seed=0, strategy="fsdp", parallel=lockstep.Parallel(tp=2),
                          precision="float8")
    model = tiny_llama()
    model, optimizer = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for batch in rt.loader(Rows(steps * batch_size), batch_size=batch_size, collate_fn=collate, num_workers=0):
        rt.backward(model(**model_inputs(batch)).loss, num_items=hc.valid_tokens(batch))
        optimizer.step()
        optimizer.zero_grad()
    ours = hc.flat(model)

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    plain = convert_to_float8_training(
        tiny_llama(), module_filter_fn=lambda m, name: m.in_features % 16 == 0 and m.out_features % 16 == 0)
    plan = {"lm_head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(len(plain.model.layers)):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(plain, mesh["tp"], plan)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in plain.model.layers:
        fully_shard(layer, mesh=mesh["dp"], mp_policy=policy)
    fully_shard(plain, mesh=mesh["dp"], mp_policy=policy)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    rows, dp_rank = Rows(steps * batch_size), rt.rank // 2
    for step in range(steps):
        first = step * batch_size + dp_rank * (batch_size // 2)
        batch = collate([rows[i] for i in range(first, first + batch_size // 2)])
        everyone = collate([rows[i] for i in range(step * batch_size, (step + 1) * batch_size)])
        mine = hc.valid_tokens(batch)
        (plain(**model_inputs(batch)).loss * mine).backward()
        for p in plain.parameters():
            p.grad.mul_(2 / hc.valid_tokens(everyone))
        plain_optimizer.step()
        plain_optimizer.zero_grad()
    return float((ours - hc.flat(plain)).abs().max())


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class NamedBlocks(lockstep.Module):
    """Blocks under ``net``: a plan or ``pp_stages`` written in this module's names (``net.blocks.*.up``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.net = nn.Sequential(nn.Linear(8, 16), _Block(), _Block(), nn.Linear(16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def loss_fn(self, output, batch):  # on pipeline stages
        return F.cross_entropy(output, batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def named_blocks_weights(parallel) -> dict:
    """Trains NamedBlocks with the Trainer on ``parallel`` (None: one process); its full weights, and how many
    of its parameters this rank holds split over the tensor-parallel peers."""
    from torch.distributed.tensor import DTensor

    from checks import trainer as tc

    module = NamedBlocks()
    trainer = tc.quiet_trainer(max_steps=4, parallel=parallel, strategy="ddp" if parallel else "auto")
    trainer.fit(module, checks.make_data(32), batch_size=8)
    split = [name for name, p in module.named_parameters() if isinstance(p, DTensor)
             and "tp" in (p.device_mesh.mesh_dim_names or ())  # the tensor-parallel dimension's placement
             and p.placements[p.device_mesh.mesh_dim_names.index("tp")].is_shard()]
    weights = trainer.runtime.full_state_dict(trainer.module)
    return {"weights": {name: value.clone() for name, value in weights.items()}, "split": split}


def plan_by_function(model: nn.Module, tp_mesh) -> None:
    """A tp_plan function, given the module it is written for."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, tp_mesh, {f"net.{i}.up": ColwiseParallel() for i in (1, 2)}
                       | {f"net.{i}.down": RowwiseParallel() for i in (1, 2)})


def runtime_of_rank_layout(layouts: list) -> str:
    """A Runtime on this rank's entry of ``layouts`` (a Parallel each): ranks that disagree are refused."""
    import torch.distributed as dist

    lockstep.Runtime(accelerator="cpu", strategy="fsdp", parallel=layouts[dist.get_rank()], timeout=60)
    return "built"


def runtime_of_rank_precision(precisions: list) -> str:
    """A Runtime on this rank's entry of ``precisions``: ranks that disagree are refused (they trained on)."""
    import torch.distributed as dist

    lockstep.Runtime(accelerator="cpu", precision=precisions[dist.get_rank()], timeout=60)
    return "built"


def plan_by_function_in_other_names(model: nn.Module, tp_mesh) -> None:
    """A plan function whose names match nothing in ``model`` (torch warns and skips each)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    parallelize_module(model, tp_mesh, {"module.net.1.up": ColwiseParallel()})


class TiedNet(nn.Module):
    """An embedding whose weight the output head shares (tied embeddings), split by a plan of names."""

    PLAN = {"embed": "embedding_rowwise", "up": "colwise", "down": "rowwise", "head": "colwise_gather_output"}

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.up, self.down = nn.Embedding(16, 8), nn.Linear(8, 16), nn.Linear(16, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head(h + self.down(torch.relu(self.up(h))))


def tied_weights_after_steps(tp: int, steps: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """3 SGD steps of ``TiedNet`` on one batch, on tp ranks (1: one process); the embedding and the head, whole."""
    tokens = torch.randint(0, 16, (8, 5), generator=torch.Generator().manual_seed(1))
    model = TiedNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    if tp > 1:
        rt = lockstep.Runtime(accelerator="cpu", seed=0, strategy="fsdp",
                              parallel=lockstep.Parallel(tp=tp, tp_plan=TiedNet.PLAN))
        model, optimizer = rt.setup(model, optimizer)
    for _ in range(steps):
        F.cross_entropy(model(tokens).reshape(-1, 16), tokens.roll(1, 1).reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad()
    inner = lockstep.unwrap(model)
    whole = [p.detach().full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in (inner.embed.weight,
                                                                                            inner.head.weight)]
    return whole[0].clone(), whole[1].clone()


def tied_split_apart() -> None:
    """``TiedNet`` with its head split by input features and its embedding by rows: refused by ``rt.setup``."""
    rt = lockstep.Runtime(accelerator="cpu", seed=0, strategy="fsdp",
                          parallel=lockstep.Parallel(tp=2, tp_plan={"embed": "embedding_rowwise", "head": "rowwise"}))
    rt.setup(TiedNet())
