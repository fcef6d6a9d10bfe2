"""Functions the FSDP tests run on every rank (importable by the spawned workers)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

import lockstep
from checks import dist as checks
from checks.dist import layout


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


class Stack(nn.Module):
    """A small model with repeated blocks, the shape FSDP shards block by block."""

    def __init__(self, width: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList([Block(width) for _ in range(depth)])
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_stack(seed: int = 1, width: int = 32) -> Stack:
    torch.manual_seed(seed)
    return Stack(width)


def full_weights(model: nn.Module) -> torch.Tensor:
    """Every parameter, whole (shards gathered), flattened in definition order."""
    parts = []
    for p in lockstep.unwrap(model).parameters():
        t = p.detach()
        parts.append((t.full_tensor() if isinstance(t, DTensor) else t).float().reshape(-1).cpu())
    return torch.cat(parts)


def train(strategy, precision: str = "32-true", accumulate: int = 1, clip: float | None = None,
          epochs: int = 2, n: int = 103, batch: int = 16, norm_type: float = 2.0,
          torch_clip: bool = False) -> torch.Tensor:
    """lockstep's loop: optimizer built before setup, uneven last batch, accumulation, clipping (``torch_clip``:
    torch's own ``clip_grad_norm_``, the reference on one process)."""
    rt = lockstep.Runtime(accelerator="cpu", **layout(strategy), precision=precision, seed=0)
    model = make_stack()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    model, optimizer = rt.setup(model, optimizer)
    loader = rt.loader(checks.make_data(n), batch_size=batch, shuffle=True, num_workers=0)
    for _ in range(epochs):
        for i, (x, y) in enumerate(loader):
            boundary = (i + 1) % accumulate == 0 or i + 1 == len(loader)
            with rt.no_sync(model, enabled=not boundary):
                rt.backward(F.cross_entropy(model(x), y) / accumulate)
            if boundary:
                if clip is not None and torch_clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip, norm_type=norm_type)
                elif clip is not None:
                    rt.clip_grad_norm_(model, optimizer, clip, norm_type=norm_type)
                optimizer.step()
                optimizer.zero_grad()
    return full_weights(model)


def built_unseeded(strategy) -> dict:
    """Each rank builds the model from a seed of its own (as a script that seeds nothing does): rank 0's weights
    before setup, and the weights this rank holds after it (gathered whole), by name."""
    import torch.distributed as dist

    rt = lockstep.Runtime(accelerator="cpu", **layout(strategy))
    torch.manual_seed(100 + rt.rank)
    model = Stack()
    mine = {name: p.detach().clone() for name, p in model.named_parameters()}
    everyone: list = [None] * rt.world_size
    dist.all_gather_object(everyone, mine)
    model = rt.setup(model)
    after = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
             for name, p in lockstep.unwrap(model).named_parameters()}
    return {"after": after, "rank0_before": everyone[0], "mine_before": mine}


def built_other_shapes(strategy) -> None:
    """Rank 1 builds a wider model than rank 0 (a rank-dependent layer): rt.setup must refuse it on every rank."""
    rt = lockstep.Runtime(accelerator="cpu", **layout(strategy))
    rt.setup(Stack(width=32 if rt.rank == 0 else 16))


def bf16_against_plain_fsdp2(precision: str = "bf16-mixed") -> float:
    """lockstep ``bf16-mixed`` (or ``float8``) under FSDP against a hand-written FSDP2 loop with the
    same policy (and torchao's float8 conversion of the Linears whose sizes divide by 16)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    rt = lockstep.Runtime(accelerator="cpu", strategy="fsdp", precision=precision, seed=0)
    dataset = checks.make_data(16 * 12)
    model = make_stack()
    model, optimizer = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for x, y in rt.loader(dataset, batch_size=16, shuffle=False, num_workers=0):
        rt.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    ours = full_weights(model)

    plain = make_stack()
    if precision == "float8":
        from torchao.float8 import convert_to_float8_training

        plain = convert_to_float8_training(
            plain, module_filter_fn=lambda m, name: m.in_features % 16 == 0 and m.out_features % 16 == 0)
    mesh = init_device_mesh("cpu", (rt.world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in plain.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(plain, mesh=mesh, mp_policy=policy)
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    x_all, y_all = dataset.tensors
    per_rank = 16 // rt.world_size
    for first in range(0, len(dataset), 16):
        part = slice(first + rt.rank * per_rank, first + (rt.rank + 1) * per_rank)
        F.cross_entropy(plain(x_all[part]).float(), y_all[part]).backward()
        plain_optimizer.step()
        plain_optimizer.zero_grad()
    return float((ours - full_weights(plain)).abs().max())


def built_empty() -> dict:
    """A model built on the meta device: each rank allocates its shards only, initialised."""
    rt = lockstep.Runtime(accelerator="cpu", strategy="fsdp", seed=0)
    with rt.init_module(empty=True):
        model = Stack(width=64)
    assert all(p.is_meta for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = rt.setup(model, optimizer)
    params = list(lockstep.unwrap(model).parameters())
    local = [p.to_local() for p in params]
    x, y = checks.make_data(16).tensors
    rt.backward(F.cross_entropy(model(x[rt.rank * 8:(rt.rank + 1) * 8]), y[:8]))
    optimizer.step()
    return {
        "local_numel": sum(t.numel() for t in local), "full_numel": sum(p.numel() for p in params),
        "finite": all(bool(torch.isfinite(t).all()) for t in local),
        "embed_std": float(local[0].detach().std()), "embed_rows": local[0][:2].detach().clone(),
        "optimizer_holds_model": all(a is b for a, b in zip(optimizer.param_groups[0]["params"], params, strict=True)),
    }


def evaluation_under_fsdp() -> dict:
    """1,001 samples on 3 ranks in batches of 9 (3 per rank): shards of 334, 334 and 333 rows take 112,
    112 and 111 batches, so rank 2 runs one empty batch; outputs come back in dataset order."""
    rt = lockstep.Runtime(accelerator="cpu", strategy="fsdp", seed=0)
    model = rt.setup(make_stack())
    data = checks.make_data(1001)
    loader = rt.eval_loader(torch.utils.data.TensorDataset(data.tensors[0], torch.arange(1001)), batch_size=9,
                            num_workers=0)
    outputs, indices, rows = [], [], []
    model.eval()
    with torch.no_grad():
        for x, index in loader:
            outputs.append(model(x))
            indices.append(index)
            rows.append(len(x))
    return {"outputs": rt.gather(outputs), "indices": rt.gather(indices), "rows": rows,
            "weights": full_weights(model)}


def storage_bytes(strategy) -> int:
    """This rank's bytes of parameters, gradients and optimizer state after one AdamW step."""
    rt = lockstep.Runtime(accelerator="cpu", **layout(strategy), seed=0)
    model = make_stack(width=256)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = rt.setup(model, optimizer)
    x, y = checks.make_data(16).tensors
    rt.backward(F.cross_entropy(model(x[:4]), y[:4]))
    optimizer.step()
    tensors = []
    for p in lockstep.unwrap(model).parameters():
        tensors += [p, p.grad]
    tensors += [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    seen: set[int] = set()
    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        if storage.data_ptr() not in seen and local.numel() > 1:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def stepped_optimizer_is_refused() -> str:
    rt = lockstep.Runtime(accelerator="cpu", strategy="fsdp", seed=0)
    model = make_stack()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    try:
        rt.setup(model, optimizer)
    except ValueError as error:
        return str(error)
    return "no error"


def _indexed_data():
    x, y = checks.make_data(96).tensors
    return torch.utils.data.TensorDataset(x, y, torch.arange(96))


def _steps(rt, model, optimizer, batches, consumed: list, stop_after: int | None = None) -> None:
    """Train over the batches (a loader: one epoch), recording each step's global sample indices."""
    for step, (x, y, index) in enumerate(batches):
        consumed.append(sorted(torch.cat(rt.all_gather(index)).tolist()))
        rt.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        if stop_after is not None and step == stop_after:
            return


def _setup(strategy, seed: int = 1, batch: int = 12):
    rt = lockstep.Runtime(accelerator="cpu", **layout(strategy), seed=0)
    model = make_stack(seed=seed)
    model, optimizer = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    loader = rt.loader(_indexed_data(), batch_size=batch, shuffle=True, num_workers=0)
    return rt, model, optimizer, loader


def save_mid_epoch(strategy, folder: str, blocking: bool, batch: int = 12) -> dict:
    """Two epochs of 96 samples in global batches of ``batch`` (8 steps each for 12), saved with rt.save
    after step 3 of epoch 1 (in the background when not ``blocking``), then finished: the uninterrupted
    run."""
    rt, model, optimizer, loader = _setup(strategy, batch=batch)
    consumed: list = []
    _steps(rt, model, optimizer, loader, consumed)
    epoch_1 = iter(loader)
    _steps(rt, model, optimizer, epoch_1, consumed, stop_after=3)
    rt.save(folder, {"model": model, "optimizer": optimizer, "loader": loader, "step": len(consumed)},
            blocking=blocking)
    _steps(rt, model, optimizer, epoch_1, consumed)
    rt.close()
    return {"weights": full_weights(model), "consumed": consumed}


def resume_from(strategy, folder: str, batch: int = 12) -> dict:
    """Load what ``save_mid_epoch`` saved into a model with other weights, then finish the run."""
    rt, model, optimizer, loader = _setup(strategy, seed=5, batch=batch)
    state = rt.load(folder, {"model": model, "optimizer": optimizer, "loader": loader, "step": -1})
    consumed: list = []
    _steps(rt, model, optimizer, loader, consumed)
    return {"step": state["step"], "weights": full_weights(model), "consumed": consumed}


def trainer_run(strategy) -> dict:
    """The Trainer: fit 2 epochs, then validate and predict over 1,001 samples (uneven per rank)."""
    from checks import trainer as tc

    trainer = tc.quiet_trainer(max_epochs=2, **layout(strategy))
    module = tc.Classifier()
    trainer.fit(module, checks.make_data(103), batch_size=12)
    metrics = trainer.validate(module, checks.make_data(1001), batch_size=9)
    predictions = trainer.predict(module, checks.make_data(1001), batch_size=9)
    return {"weights": full_weights(module), "metrics": metrics, "predictions": predictions}


class BuiltInConfigureModel(lockstep.Module):
    def configure_model(self) -> None:
        self.stack = Stack(width=64)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.stack(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def trainer_configure_model() -> dict:
    from checks import trainer as tc

    trainer = tc.quiet_trainer(max_steps=3, strategy="fsdp")
    module = BuiltInConfigureModel()
    trainer.fit(module, checks.make_data(48), batch_size=8)
    weight = module.stack.head.weight
    return {"sharded": isinstance(weight, DTensor), "local_rows": weight.to_local().shape[0],
            "loss": trainer.callback_metrics.get("train_loss_epoch", float("nan")), "steps": trainer.global_step}


def model_from_folder(folder) -> Stack:
    """The saved model, loaded on one process through ``rt.load`` (an independent path from consolidate)."""
    rt = lockstep.Runtime(accelerator="cpu", env=lockstep.DistEnv())
    model = rt.setup(make_stack(seed=3))
    rt.load(folder, {"model": model})
    return lockstep.unwrap(model)


def full_weights_of_folder(folder) -> torch.Tensor:
    return full_weights(model_from_folder(folder))


def full_state_dicts() -> dict:
    """Under FSDP after two steps: rank 0's full state dict, every rank's, and the reference
    gathered by hand from the DTensor shards."""
    rt = lockstep.Runtime(accelerator="cpu", strategy="fsdp", seed=0)
    model = rt.setup(make_stack(seed=1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        rt.backward(model(torch.randn(4, 8)).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    by_hand = {name: (value.full_tensor() if isinstance(value, DTensor) else value).detach().cpu()
               for name, value in lockstep.unwrap(model).state_dict().items()}
    return {"rank0": rt.full_state_dict(model), "every": rt.full_state_dict(model, rank0_only=False),
            "by_hand": by_hand, "sharded": isinstance(lockstep.unwrap(model).head.weight, DTensor)}


def offloaded_on_one_process() -> dict:
    """``FSDP(cpu_offload=True)`` on one process: sharded (over a group of one) and offloaded, not
    turned into the single-device path; trained as ``train`` trains."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    rt = lockstep.Runtime(accelerator="cpu", strategy=lockstep.FSDP(cpu_offload=True), seed=0)
    model = rt.setup(make_stack())
    sharded = isinstance(lockstep.unwrap(model), FSDPModule) and isinstance(lockstep.unwrap(model).head.weight, DTensor)
    rt.close()
    group_left = dist.is_initialized()  # the group of one is the Runtime's: closing it leaves it
    weights = train(lockstep.FSDP(cpu_offload=True), epochs=1)
    return {"weights": weights, "sharded": sharded, "group_left": group_left}
