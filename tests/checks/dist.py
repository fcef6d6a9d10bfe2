"""Functions the multi-process tests run on every rank (importable by the spawned workers)."""

from __future__ import annotations

import collections
import dataclasses
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lockstep


def layout(given) -> dict:
    """The Runtime's (or Trainer's) keywords for a test's layout: a strategy, a ``lockstep.Parallel`` (FSDP
    on that mesh), or a pair ``(strategy, Parallel)``."""
    if isinstance(given, lockstep.Parallel):
        return {"strategy": "fsdp", "parallel": given}
    if isinstance(given, tuple):
        return {"strategy": given[0], "parallel": given[1]}
    return {"strategy": given}


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def make_model(seed: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4))


def make_data(n: int, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=generator)
    y = torch.randint(0, 4, (n,), generator=generator)
    return TensorDataset(x, y)


def flat_weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().float().reshape(-1) for p in lockstep.unwrap(model).parameters()])


def train_lockstep(rt: lockstep.Runtime, dataset, batch_size: int, epochs: int, shuffle: bool):
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = rt.setup(model, optimizer)
    loader = rt.loader(dataset, batch_size=batch_size, shuffle=shuffle, num_workers=0)
    for _ in range(epochs):
        for x, y in loader:
            rt.backward(F.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    return flat_weights(model)


def train_plain_ddp(rank: int, world: int, dataset, batch_size: int, bf16: bool) -> torch.Tensor:
    """A hand-written DDP loop: step s, rank r takes the r-th contiguous part of global batch s."""
    model = nn.parallel.DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x_all, y_all = dataset.tensors
    per_rank = batch_size // world
    for first in range(0, len(dataset), batch_size):
        part = slice(first + rank * per_rank, first + (rank + 1) * per_rank)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = model(x_all[part])
        loss = F.cross_entropy(out.float(), y_all[part])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return flat_weights(model.module)


def parity_with_plain_ddp(precision: str) -> float:
    rt = lockstep.Runtime(accelerator="cpu", precision=precision, seed=0)
    dataset = make_data(16 * 20)  # 20 steps of global batch 16
    ours = train_lockstep(rt, dataset, 16, epochs=1, shuffle=False)
    theirs = train_plain_ddp(rt.rank, rt.world_size, dataset, 16, bf16=precision == "bf16-mixed")
    return float((ours - theirs).abs().max())


def world_size_invariance() -> torch.Tensor:
    """2 epochs, global batch 16 over 103 samples: a short last batch of 7, split unevenly."""
    rt = lockstep.Runtime(accelerator="cpu", seed=0)
    return train_lockstep(rt, make_data(103), 16, epochs=2, shuffle=True)


def gathered_evaluation(batch_size: int) -> dict:
    """Evaluate 1,001 samples; ranks hold different numbers of batches; gather once at the end."""
    rt = lockstep.Runtime(accelerator="cpu", seed=0)
    model = rt.setup(make_model())
    x, y = make_data(1001).tensors
    dataset = TensorDataset(torch.arange(1001), x, y)
    outputs, indices, batches = [], [], 0
    model.eval()
    with torch.no_grad():
        for index, xb, _ in rt.eval_loader(dataset, batch_size=batch_size, num_workers=0):
            outputs.append(model(xb))
            indices.append(index)
            batches += 1
    return {"outputs": rt.gather(outputs), "indices": rt.gather(indices),
            "batches": rt.all_gather(batches)}


def inf_gradient_skips_step() -> dict:
    """16-mixed: an inf gradient on one rank only makes every rank skip the step."""
    rt = lockstep.Runtime(accelerator="cpu", precision="16-mixed", seed=0)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = rt.setup(model, optimizer)
    x, y = make_data(8).tensors
    before = flat_weights(model).clone()
    poisoned = x.clone()
    if rt.rank == 1:
        poisoned[0, 0] = float("inf")  # inf gradients on rank 1 only, before the all-reduce
    rt.backward(F.cross_entropy(model(poisoned), y))
    optimizer.step()
    skipped = rt.step_was_skipped
    unchanged = torch.equal(before, flat_weights(model))
    optimizer.zero_grad()
    rt.backward(F.cross_entropy(model(x), y))
    optimizer.step()
    return {"skipped": skipped, "unchanged": unchanged, "then_stepped": not rt.step_was_skipped,
            "then_changed": not torch.equal(before, flat_weights(model))}


def accumulation_skips_allreduce(micro_steps: int = 4) -> dict:
    """no_sync on all but the last micro-step: one all-reduce per bucket, same gradients."""
    rt = lockstep.Runtime(accelerator="cpu", seed=0)
    model = rt.setup(make_model())
    calls = []

    def counting_hook(state, bucket):
        calls.append(bucket.index())
        tensor = bucket.buffer().div_(rt.world_size)
        work = torch.distributed.all_reduce(tensor, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    model.forward_module.register_comm_hook(None, counting_hook)
    x, y = make_data(64).tensors
    per_rank = 64 // rt.world_size
    mine = slice(rt.rank * per_rank, (rt.rank + 1) * per_rank)
    xs, ys = x[mine].chunk(micro_steps), y[mine].chunk(micro_steps)
    for i in range(micro_steps):
        with rt.no_sync(model, enabled=i < micro_steps - 1):
            rt.backward(F.cross_entropy(model(xs[i]), ys[i]) / micro_steps)
    accumulated = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    reference = make_model()  # the full global batch in one step, one process
    F.cross_entropy(reference(x), y).backward()
    expected = torch.cat([p.grad.reshape(-1) for p in reference.parameters()])
    buckets = len(set(calls))
    return {"allreduce_calls": len(calls), "buckets": buckets,
            "grad_error": float((accumulated - expected).abs().max())}


class Augmented(torch.utils.data.Dataset):
    """Each item is a fresh random draw, like a random augmentation, plus the worker's id."""

    def __len__(self):
        return 16

    def __getitem__(self, index):
        return torch.rand(1), torch.utils.data.get_worker_info().id


def worker_seeds() -> dict:
    """Random augmentations drawn in DataLoader workers, per epoch, on this rank: with 2 workers (twice), with
    1, and a pass of epoch 1 resumed after its batch 2 (a new loader placed there, as a resume places it)."""
    rt = lockstep.Runtime(accelerator="cpu", seed=3)

    def draws(num_workers: int) -> list[list[tuple[float, int]]]:
        loader = rt.loader(Augmented(), batch_size=4, num_workers=num_workers)
        return [[(float(v), int(w)) for noise, worker in loader for v, w in zip(noise, worker, strict=True)]
                for _epoch in range(2)]

    resumed = rt.loader(Augmented(), batch_size=4, num_workers=2)
    resumed.load_state_dict({"epoch": 1, "batches_done": 2})
    return {"first": draws(2), "second": draws(2), "one_worker": draws(1),
            "resumed": [float(v) for noise, _ in resumed for v in noise]}


def rank_zero_goes_first(path: str) -> list[str]:
    import time

    rt = lockstep.Runtime(accelerator="cpu")
    with rt.rank_zero_first():
        if rt.is_global_zero:
            time.sleep(0.5)
        with open(path, "a") as handle:
            handle.write(f"{rt.rank}\n")
    rt.barrier()
    with open(path) as handle:
        return handle.read().split()


def dataloader_is_recreated() -> dict:
    rt = lockstep.Runtime(accelerator="cpu")
    seen = []

    def collate(rows):
        seen.append(len(rows))
        return torch.stack([r[0] for r in rows])

    original = DataLoader(make_data(40), batch_size=8, shuffle=False, collate_fn=collate)
    loader = rt.loader(original)
    batches = [b for b in loader]
    return {"collate_calls": len(seen), "rows": sum(len(b) for b in batches),
            "local_rows": [len(b) for b in batches]}


# -- every container kind through every collective --------------------------------------------------
Pair = collections.namedtuple("Pair", ["a", "b"])


@dataclasses.dataclass
class Record:
    a: torch.Tensor
    b: float


class Encoding(collections.UserDict):
    """Like transformers' BatchEncoding: a UserDict, not a dict."""


@dataclasses.dataclass
class Output(collections.OrderedDict):
    """Like transformers' ModelOutput: a dataclass that is an OrderedDict."""

    a: torch.Tensor | None = None
    b: float | None = None

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if value is not None:
                self[field.name] = value


def containers(a, b) -> dict:
    """One value of each container kind, holding tensor ``a`` (rows) and number ``b``."""
    return {"dict": {"a": a, "b": b}, "list": [a, b], "tuple": (a, b), "namedtuple": Pair(a, b),
            "dataclass": Record(a, b), "userdict": Encoding({"a": a, "b": b}), "modeloutput": Output(a=a, b=b)}


def parts(value) -> tuple:
    """(a, b) back out of any container kind, and its type name."""
    if isinstance(value, (Record, Pair)):
        return value.a, value.b, type(value).__name__
    if isinstance(value, (dict, collections.UserDict)):
        return value["a"], value["b"], type(value).__name__
    return value[0], value[1], type(value).__name__


def collectives_over_containers() -> dict:
    """Rank r holds a = [[r, r]] * (r + 1) rows and b = r + 1; every collective, every container kind."""
    rt = lockstep.Runtime(accelerator="cpu")
    r = rt.rank
    results = {}
    for kind in containers(None, None):
        mine = containers(torch.full((r + 1, 2), float(r)), float(r + 1))[kind]
        results[kind] = {
            "all_reduce": parts(rt.all_reduce(containers(torch.full((2,), float(r)), float(r + 1))[kind], op="sum")),
            "all_gather": [parts(v) for v in rt.all_gather(mine)],
            "gather": _gathered(rt.gather(containers(torch.full((r + 1, 2), float(r)), [float(r)] * (r + 1))[kind])),
            "broadcast": parts(rt.broadcast(mine, src=1)),
        }
    return results


def _gathered(value):
    return value if isinstance(value, list) else parts(value)


def stale_loss_weight(leave: str) -> float:
    """After a loop whose last global batch split 2+1, a backward not from the loader is plain DDP's."""
    rt = lockstep.Runtime(accelerator="cpu", seed=0)
    model = rt.setup(nn.Linear(1, 1, bias=False))
    loader = rt.loader(TensorDataset(torch.ones(7, 1)), batch_size=4, num_workers=0)  # 2+2, then 2+1
    for (x,) in loader:
        rt.backward(model(x).mean())
        if leave == "break":
            break
    model.zero_grad()
    rt.backward(model(torch.full((1, 1), float(rt.rank + 1))).sum())  # rank r: d/dw = r + 1
    return float(lockstep.unwrap(model).weight.grad)  # plain DDP: mean over ranks of (r + 1) = 1.5


class IndexedNoise(torch.utils.data.Dataset):
    """An augmentation drawing from torch, python and numpy, returned with the sample's index."""

    def __len__(self):
        return 24

    def __getitem__(self, index):
        import random

        import numpy as np

        return index, torch.rand(()) + random.random() + float(np.random.rand())


def per_sample_draws(num_workers: int) -> dict:
    """Each sample's augmentation per epoch, as every rank saw it (index -> value), and the global RNG after."""
    rt = lockstep.Runtime(accelerator="cpu", seed=5, per_sample_rng=True)
    torch.manual_seed(11)
    loader = rt.loader(IndexedNoise(), batch_size=12, shuffle=True, num_workers=num_workers)
    epochs = []
    for _epoch in range(2):
        seen = {}
        for index, value in loader:
            for rank_rows in rt.all_gather((index, value)):
                seen.update(zip(rank_rows[0].tolist(), rank_rows[1].tolist(), strict=True))
        epochs.append(seen)
    return {"epochs": epochs, "after": float(torch.rand(()))}


Doubled = collections.namedtuple("Doubled", "index doubled")


def merged_gather(n: int) -> dict:
    """Per-batch dicts and namedtuples from an eval loader, gathered: one merged structure each."""
    rt = lockstep.Runtime(accelerator="cpu")
    dicts, pairs = [], []
    for (index,) in rt.eval_loader(TensorDataset(torch.arange(n)), batch_size=4, num_workers=0):
        dicts.append({"index": index, "square": index**2})
        pairs.append(Doubled(index, 2 * index))
    return {"dicts": rt.gather(dicts), "pairs": rt.gather(pairs), "batches": len(dicts)}


class _WithSpare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.used, self.spare = nn.Linear(4, 2), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def unused_parameter_steps() -> str:
    """Two steps of a model with a parameter its forward never uses, under plain DDP: the error's text."""
    rt = lockstep.Runtime(accelerator="cpu", seed=0)
    model = _WithSpare()
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        for _ in range(2):
            rt.backward(model(torch.randn(8, 4)).sum())
            optimizer.step()
            optimizer.zero_grad()
    except lockstep.UsageError as error:
        return str(error)
    return "no error"


def batchnorm_eval_warnings() -> dict:
    """A BatchNorm model trained on this rank's rows: how often ``model.eval()`` warns, before and after
    ``rt.sync_buffers(model)``."""
    import warnings

    rt = lockstep.Runtime(accelerator="cpu", seed=0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))

    def train(steps: int) -> None:
        model.train()
        for step, (x,) in enumerate(rt.loader(TensorDataset(torch.randn(32, 4)), batch_size=8)):
            if step == steps:
                break
            rt.backward(model(x).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()

    def warned() -> int:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.eval()
            model.eval()
        return sum("rt.sync_buffers(model)" in str(w.message) for w in caught)

    train(2)
    unsynced = warned()
    train(1)
    rt.sync_buffers(model)
    return {"unsynced": unsynced, "synced": warned()}


def plain_backward_warnings(use_rt_backward: bool, clip: bool = False, optimizers: int = 1) -> int:
    """An epoch of 19 samples in global batches of 8 on this rank's share (the last batch of 3 splits 2/1),
    the backward through ``loss.backward()`` or ``rt.backward``: how many of lockstep's warnings came."""
    import warnings

    rt = lockstep.Runtime(accelerator="cpu", seed=0)
    model = make_model()
    groups = [list(model.parameters())[:2], list(model.parameters())[2:]][-optimizers:] if optimizers == 2 else \
        [list(model.parameters())]
    model, *steppers = rt.setup(model, *(torch.optim.SGD(group, lr=0.1) for group in groups))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            for x, y in rt.loader(make_data(19), batch_size=8):
                loss = F.cross_entropy(model(x), y)
                rt.backward(loss) if use_rt_backward else loss.backward()
                for optimizer in steppers:  # as the Trainer does: clip, then step, each optimizer in turn
                    if clip:
                        rt.clip_grad_norm_(model, optimizer, 1.0)
                    optimizer.step()
                    optimizer.zero_grad()
    return sum("Call rt.backward(loss) instead" in str(w.message) for w in caught)


def loader_of_sharded_data(evaluation: bool = False) -> str:
    """What ``rt.loader`` (``rt.eval_loader``) says of data that the script already split by rank
    (``files[rank::world_size]``)."""
    rt = lockstep.Runtime(accelerator="cpu", seed=0)
    mine = list(range(19))[rt.rank::rt.world_size]  # 10 and 9 samples
    try:
        (rt.eval_loader if evaluation else rt.loader)(TensorDataset(torch.tensor(mine)), batch_size=4)
    except lockstep.ConfigError as error:
        return str(error)
    return "accepted"


def loader_of_rank_settings(evaluation: bool, options: list[dict]) -> str:
    """What ``rt.loader`` (``rt.eval_loader``) says when each rank gives it other ``options`` (its entry)."""
    rt = lockstep.Runtime(accelerator="cpu", seed=0)
    try:
        (rt.eval_loader if evaluation else rt.loader)(TensorDataset(torch.arange(64)), **options[rt.rank])
    except lockstep.ConfigError as error:
        return str(error)
    return "accepted"


def torchrun_loader_warnings() -> list[list[str]]:
    """A torchrun script's DataLoader (per-rank batch 6, DistributedSampler) given to rt.loader as it is, then
    with the global batch given: the warnings of each."""
    import warnings

    rt = lockstep.Runtime(accelerator="cpu", seed=0)
    data = TensorDataset(torch.arange(48))
    said = []
    for batch_size in (None, 12):
        loader = DataLoader(data, batch_size=6, sampler=DistributedSampler(data))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rt.loader(loader, batch_size=batch_size, num_workers=0)
        said.append([str(w.message) for w in caught if "lockstep" in str(w.message)])
    return said


def evaluation_on_rank_0_only() -> str:
    """``if rt.rank == 0:`` around an evaluation loop: what each rank is told (rank 1 goes on to a barrier)."""
    rt = lockstep.Runtime(accelerator="cpu", seed=0, timeout=5)
    try:
        if rt.rank == 0:
            sum(len(x) for (x,) in rt.eval_loader(TensorDataset(torch.arange(10)), batch_size=2, num_workers=0))
        rt.barrier()
    except Exception as error:  # noqa: BLE001 - what the rank is told, whatever it is
        return f"{type(error).__name__}: {error}"
    return "no error"



def _strided(r: int) -> dict[str, torch.Tensor]:
    """Rank r's non-contiguous views (Gloo reads some collectives' non-contiguous inputs in storage order):
    a transpose, a column slice with a step, a channels-last image, and an expanded row."""
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6) * (r + 1)
    return {"transposed": base.t(), "stepped": base[:, ::2], "channels_last": torch.arange(
        2 * 3 * 2 * 2, dtype=torch.float32).reshape(2, 3, 2, 2).mul(r + 1).to(memory_format=torch.channels_last),
        "expanded": torch.arange(3, dtype=torch.float32).mul(r + 1).expand(4, 3)}


class _Transposed(nn.Module):
    """A layer whose weight is a transposed (non-contiguous) parameter, and a non-contiguous buffer."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = nn.Parameter(torch.randn(4, 8).t())
        self.register_buffer("offset", torch.arange(8, dtype=torch.float32).reshape(2, 4).t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t() + self.offset.sum()


def non_contiguous_collectives(strategy: str) -> dict:
    """Every lockstep collective on non-contiguous tensors, each rank's a known multiple of one pattern, and
    two SGD steps of a model with a transposed parameter (its gradient as non-contiguous) on ``strategy``."""
    rt = lockstep.Runtime(accelerator="cpu", seed=0, strategy=strategy)
    r = rt.rank
    mine = _strided(r)
    out = {"all_reduce": {op: rt.all_reduce(mine, op=op) for op in ("sum", "mean", "max")},
           "all_gather": rt.all_gather(mine), "broadcast": rt.broadcast(mine, src=1),
           "gather": rt.gather({k: v for k, v in mine.items() if k != "channels_last"})}
    model = _Transposed()
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    data = torch.arange(32, dtype=torch.float32).reshape(8, 4).div(10)
    loader = rt.loader(TensorDataset(data), batch_size=4, num_workers=0)
    for (x,) in loader:
        rt.backward(model(x).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    if r == 1:  # sync_buffers must give rank 0's values, whatever the strides
        with torch.no_grad():
            lockstep.unwrap(model).offset.mul_(-1)
    rt.sync_buffers(model)
    state = rt.full_state_dict(model, rank0_only=False)
    out["weights"] = state["weight"].contiguous()
    out["offset"] = state["offset"].contiguous()
    return out


def non_contiguous_reference() -> dict:
    """By hand: the collectives' results from the two ranks' patterns, and one process's two steps."""
    one, two = _strided(0), _strided(1)
    model = _Transposed()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    data = torch.arange(32, dtype=torch.float32).reshape(8, 4).div(10)
    for x in data.split(4):
        model(x).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return {"sum": {k: one[k] + two[k] for k in one}, "mean": {k: (one[k] + two[k]) / 2 for k in one},
            "max": {k: torch.maximum(one[k], two[k]) for k in one}, "ranks": [one, two],
            "weights": model.weight.detach().contiguous(), "offset": model.offset.detach().contiguous()}


def collectives_by_key() -> dict:
    """Dicts built in another key order on each rank, bools and numpy scalars, in rt.all_reduce and
    rt.gather; keys that differ by rank are refused."""
    import numpy as np

    from lockstep.errors import ConfigError

    rt = lockstep.Runtime(accelerator="cpu", seed=0)
    r = rt.rank
    pairs = [("a", r + 1), ("b", 10 * (r + 1))]
    ordered = dict(pairs if r == 0 else pairs[::-1])
    out = {"sum": rt.all_reduce(ordered, op="sum"),
           "flags": [rt.all_reduce(r == 1, op=op) for op in ("max", "min", "sum")],
           "numpy": [rt.all_reduce(np.float32(r + 0.5), op="sum"), rt.all_reduce(np.int64(r + 2), op="sum")]}
    out["numpy_types"] = [type(v).__name__ for v in out["numpy"]]
    out["numpy_mean_and_count"] = [rt.all_reduce(np.int64(r + 1), op="mean"), rt.all_reduce(np.bool_(True), op="sum")]
    from collections import defaultdict

    factory = defaultdict(lambda: 0.0)  # its factory's repr holds an address that differs by process
    factory["x"] = float(r)
    out["defaultdict"] = dict(rt.all_reduce(factory, op="sum"))
    out["narrow_mean"] = rt.all_reduce(torch.tensor([40000.0, 1.0], dtype=torch.float16), op="mean")
    out["complex_mean"] = rt.all_reduce(torch.tensor([1 + 1j]), op="mean")
    rows = {"a": torch.full((1,), float(r)), "b": torch.full((1,), 10.0 + r)}
    out["gather"] = rt.gather(dict(rows.items() if r == 0 else list(rows.items())[::-1]), order="rank")
    for name, call in (("all_reduce", lambda: rt.all_reduce({"cat" if r == 0 else "dog": 1.0}, op="sum")),
                       ("gather", lambda: rt.gather({"cat" if r == 0 else "dog": torch.ones(1)}, order="rank"))):
        try:
            call()
            out[name + "_refused"] = ""
        except ConfigError as error:
            out[name + "_refused"] = str(error)
    return out


def clip_over_two_models() -> list[float]:
    """Two models set up apart, one optimizer each, clipped together: the norm of both models' gradients."""
    rt = lockstep.Runtime(accelerator="cpu", seed=0)
    torch.manual_seed(0)
    encoder, decoder = nn.Linear(4, 3), nn.Linear(3, 2)
    encoder, first = rt.setup(encoder, torch.optim.SGD(encoder.parameters(), lr=0.1))
    decoder, second = rt.setup(decoder, torch.optim.SGD(decoder.parameters(), lr=0.1))
    x = torch.arange(8.0).reshape(2, 4) / 8
    rt.backward(decoder(encoder(x)).square().sum())
    grads = [p.grad.clone() for m in (encoder, decoder) for p in lockstep.unwrap(m).parameters()]
    norm = rt.clip_grad_norm_(encoder, [first, second], 0.1)
    return [float(norm), float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads])))]


def distil_from_a_frozen_teacher() -> torch.Tensor:
    """A frozen teacher set up beside its student (DDP refuses a model with nothing to train): the student's
    weights after 3 steps on the teacher's outputs."""
    rt = lockstep.Runtime(accelerator="cpu", seed=0)
    torch.manual_seed(0)
    teacher, student = nn.Linear(3, 2).requires_grad_(False), nn.Linear(3, 2)
    teacher = rt.setup(teacher)
    student, optimizer = rt.setup(student, torch.optim.SGD(student.parameters(), lr=0.1))
    x = torch.arange(12.0).reshape(4, 3) / 12
    for _ in range(3):
        with torch.no_grad():
            target = teacher(x)
        rt.backward(F.mse_loss(student(x), target))
        optimizer.step()
        optimizer.zero_grad()
    return torch.cat([p.detach().flatten() for p in lockstep.unwrap(student).parameters()])


def gathered_rows_per_sample() -> dict:
    """rt.gather of outputs collected one per sample (of varying lengths, of one shape, as dicts), and per
    batch with a list of texts, over an evaluation pass of 7 samples in global batches of 4; then outputs that
    only rank 0 cannot join (chunks of other widths): every rank is told, and the next gather still lines up."""
    from lockstep.errors import ConfigError

    rt = lockstep.Runtime(accelerator="cpu", seed=0)
    data = torch.utils.data.TensorDataset(torch.arange(7))
    varying, vectors, dicts, chunks, texts = [], [], [], [], []
    for (index,) in rt.eval_loader(data, batch_size=4):
        texts.append({"index": index, "text": [f"s{int(i)}" for i in index]})  # per batch: decoded texts
        varying.extend(torch.arange(int(i) % 3) + 100 * i for i in index)  # 0, 1 or 2 values a sample
        vectors.extend(torch.stack([i, -i]) for i in index)
        dicts.extend({"i": i, "v": torch.arange(int(i) % 3)} for i in index)
        width = 3 if rt.rank == 0 and not chunks else 2  # rank 0's first batch is wider: its chunks do not join
        chunks.append(index.unsqueeze(1).expand(-1, width))
    out = {"varying": [v.tolist() for v in rt.gather(varying)], "vectors": rt.gather(vectors).tolist()}
    gathered = rt.gather(dicts)
    out["dicts"] = [gathered["i"].tolist(), [v.tolist() for v in gathered["v"]]]
    gathered = rt.gather(texts)
    out["texts"] = [gathered["index"].tolist(), gathered["text"]]
    try:
        rt.gather(chunks)
        out["refused"] = ""
    except ConfigError as error:
        out["refused"] = str(error)
    out["after"] = rt.gather([c[:, 0] for c in chunks]).tolist()
    # 3 samples: rank 0 holds a batch of 2, rank 1 a batch of 1, whose one row reads as a chunk too; the ranks
    # must read each list alike (rank 0 stacked its rows and rank 1 joined its chunk: a failed all-gather)
    columns, lengths = [], []
    for (index,) in rt.eval_loader(torch.utils.data.TensorDataset(torch.arange(3)), batch_size=4):
        columns.extend(index.float().unsqueeze(1))  # rows of shape (1,)
        lengths.extend(torch.arange(int(i) + 3) for i in index)  # rank 1's one row has a shape of its own
    gathered = rt.gather(columns)
    out["few"] = [list(gathered.shape), [v.tolist() for v in rt.gather(lengths)]]
    from lockstep.runtime.comm.collectives import _gather_leaves, _is_rows  # a rank without rows (a tp replica's)
    from lockstep.runtime.tree import flatten

    rows = [[torch.arange(3), torch.arange(5)]] if rt.rank == 0 else [[]]
    out["replica"] = [v.tolist() for v in _gather_leaves(rows, flatten([[0]], is_leaf=_is_rows)[1], rt.device)]
    return out
