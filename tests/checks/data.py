"""Rank functions and datasets for the data tests: streams, samplers, huge datasets, ordered gathers."""

from __future__ import annotations

import os
import random
import signal
import time

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, IterableDataset, WeightedRandomSampler

import lockstep
from checks import dist as dist_checks


def features(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Item ``i``: 8 features and a class, computed from the index alone."""
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, generator=g), torch.randint(0, 4, (), generator=g)


class IndexedStream(IterableDataset):
    """``n`` items ``(index, x, y)`` in order; ``reads`` counts the items read (for the I/O check)."""

    def __init__(self, n: int) -> None:
        self.n, self.reads = n, 0

    def __iter__(self):
        for i in range(self.n):
            self.reads += 1
            yield (i, *features(i))


class StatefulStream(IndexedStream):
    """The same stream, resumable through its own state_dict (the torchdata convention)."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.position, self._start = 0, 0

    def __iter__(self):
        self.position = self._start
        self._start = 0
        for i in range(self.position, self.n):
            self.reads += 1
            self.position = i + 1
            yield (i, *features(i))

    def state_dict(self) -> dict:
        return {"position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self._start = state["position"]


class SeekableRecords(IterableDataset):
    """A stream of fixed-size records, as in a file: it knows its length and its iterator can
    ``skip(n)`` (a seek) without decoding; ``decoded`` counts the records decoded."""

    def __init__(self, n: int) -> None:
        self.n, self.decoded = n, 0

    def __len__(self) -> int:
        return self.n

    def __iter__(self):
        return _RecordCursor(self)


class _RecordCursor:
    def __init__(self, records: SeekableRecords) -> None:
        self.records, self.position = records, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.position >= self.records.n:
            raise StopIteration
        self.records.decoded += 1
        self.position += 1
        return (self.position - 1, *features(self.position - 1))

    def skip(self, count: int) -> int:
        passed = min(count, self.records.n - self.position)
        self.position += passed
        return passed


class UnevenStream(IterableDataset):
    """A stream that yields one item more on rank 0 (it splits itself by rank): lockstep must refuse it."""

    def __iter__(self):
        rank = int(os.environ.get("RANK", "0"))
        for i in range(8 + (1 if rank == 0 else 0)):
            yield (i, *features(i))


class EpochCounted:
    """A batch sampler of ``n`` samples whose number of batches changes with the epoch (as token-budget
    packing's does): batches of ``sizes[0]`` in even epochs, of ``sizes[1]`` in odd ones; no ``__len__``."""

    def __init__(self, n: int = 24, sizes: tuple[int, int] = (3, 4)) -> None:
        self.n, self.sizes, self.epoch = n, sizes, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        size = self.sizes[self.epoch % 2]
        return iter([list(range(i, min(i + size, self.n))) for i in range(0, self.n, size)])


class Indexed(Dataset):
    """A map-style dataset of ``n`` items ``(index, x, y)``, any n (items computed on demand)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return (i, *features(i))


class LengthGrouped(torch.utils.data.Sampler):
    """Batches of similar lengths, as a length-grouped batch sampler for padded text does: shuffle,
    sort 4 batches' worth by length, cut, shuffle the batches (python's random: seeded by lockstep)."""

    def __init__(self, lengths: list[int], batch_size: int) -> None:
        self.lengths, self.batch_size = lengths, batch_size

    def __iter__(self):
        order = list(range(len(self.lengths)))
        random.shuffle(order)
        chunk = 4 * self.batch_size
        batches = []
        for start in range(0, len(order), chunk):
            group = sorted(order[start:start + chunk], key=lambda i: self.lengths[i])
            batches += [group[i:i + self.batch_size] for i in range(0, len(group), self.batch_size)]
        random.shuffle(batches)
        return iter(batches)

    def __len__(self) -> int:
        return -(-len(self.lengths) // self.batch_size)


def global_batches(rt: lockstep.Runtime, loader, epochs: int = 1) -> list[list[int]]:
    """Every global batch the loader handed out, as sorted dataset indices (each rank's share joined)."""
    seen = []
    for _ in range(epochs):
        for index, *_rest in loader:
            parts = rt.all_gather(index)
            seen.append(sorted(i for part in parts for i in part.tolist()))
    return seen


def seeded_per_rank() -> dict:
    """``Runtime(seed=42 + rank)``, a DDP script's habit: the global batches of a shuffled pass, a draw of torch's
    generator, and the seed the data order took."""
    rt = lockstep.Runtime(accelerator="cpu", seed=42 + int(os.environ.get("RANK", "0")))
    loader = rt.loader(Indexed(99), batch_size=8, shuffle=True, num_workers=0)
    return {"batches": global_batches(rt, loader), "draw": torch.rand(1).item(), "seed": rt.seed}


def train_on(rt: lockstep.Runtime, loader, checkpoint: str | None = None, kill_after: int = 0) -> dict:
    """SGD on the loader's batches, resuming from ``checkpoint`` when it exists and saving it after
    every step; SIGKILL this process after ``kill_after`` steps (0: never). Returns the weights and
    the global batches seen."""
    model = dist_checks.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = rt.setup(model, optimizer)
    state = {"model": model, "optimizer": optimizer, "loader": loader}
    if checkpoint is not None and os.path.exists(checkpoint):
        rt.load(checkpoint, state)
    seen = []
    for step, (index, x, y) in enumerate(loader):
        rt.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        seen.append(sorted(i for part in rt.all_gather(index) for i in part.tolist()))
        if checkpoint is not None:
            rt.save(checkpoint, state)
        if kill_after and step + 1 == kill_after:
            os.kill(os.getpid(), signal.SIGKILL)
    return {"weights": dist_checks.flat_weights(model), "batches": seen}


def sampler_and_stream_batches(stream_workers: int = 2) -> dict:
    """Global batches of a WeightedRandomSampler DataLoader, a length-grouped batch sampler, a stream
    of 1,003 items (2 epochs, ``stream_workers`` workers) and training on that stream; and a shuffled
    training pass's gathered outputs."""
    rt = lockstep.Runtime(accelerator="cpu", seed=3)
    weights = [1.0 + (i % 7) for i in range(200)]
    weighted = DataLoader(Indexed(200), batch_size=24, sampler=WeightedRandomSampler(weights, 150))
    lengths = [(i * 37) % 50 + 1 for i in range(203)]
    result = {
        "weighted": global_batches(rt, rt.loader(weighted, num_workers=0), epochs=2),
        "grouped": global_batches(rt, rt.loader(Indexed(203), batch_sampler=LengthGrouped(lengths, 16),
                                                num_workers=0)),
        "stream": global_batches(rt, rt.loader(IndexedStream(1003), batch_size=32, num_workers=stream_workers),
                                 epochs=2),
        "trained": train_on(rt, rt.loader(IndexedStream(1003), batch_size=32, num_workers=0)),
    }
    result["gathered"] = shuffled_gather(rt)
    return result


def shuffled_gather(rt: lockstep.Runtime | None = None) -> dict:
    """Per-batch dicts of outputs of a shuffled training pass over 101 samples, gathered."""
    rt = rt or lockstep.Runtime(accelerator="cpu", seed=3)
    loader = rt.loader(Indexed(101), batch_size=12, shuffle=True, num_workers=0)
    outputs = [{"index": index, "double": 2 * x} for index, x, _ in loader]
    return rt.gather(outputs)


def stream_end_is_agreed() -> str:
    """A stream with one item more on rank 0 than elsewhere: every rank must fail, none hang."""
    rt = lockstep.Runtime(accelerator="cpu", seed=0)
    try:
        for _ in rt.loader(UnevenStream(), batch_size=rt.world_size, num_workers=0):
            pass
    except RuntimeError as error:
        return str(error)
    return "no error"


def stream_with_a_last_batch_smaller_than_the_ranks() -> list:
    """A training stream of 9 items in global batches of 4 on 3 ranks: its last batch of 1 leaves 2 ranks
    without a row. Every rank must raise (only those ranks did), so a loop that catches the error can go on
    with the same collectives on every rank."""
    rt = lockstep.Runtime(accelerator="cpu", seed=0)
    try:
        for _ in rt.loader(IndexedStream(9), batch_size=4, num_workers=0):
            pass
        said = "no error"
    except ValueError as error:
        said = str(error)
    return [said, rt.all_reduce(torch.tensor(float(rt.rank + 1)), op="sum").item()]


def stream_until_killed(checkpoint: str, stateful: bool, kill_after: int) -> dict:
    """Train on a 1,003-item stream (see ``train_on``); also says whether it resumed, and how many
    items it read."""
    rt = lockstep.Runtime(accelerator="cpu", seed=0)
    stream = (StatefulStream if stateful else IndexedStream)(1003)
    resumed = os.path.exists(checkpoint)
    result = train_on(rt, rt.loader(stream, batch_size=32, num_workers=0), checkpoint, kill_after)
    return {**result, "resumed": resumed, "reads": stream.reads}


def billion_samples() -> dict:
    """A map-style dataset of 10^9 items, shuffled: time and memory to the first batch, and to a
    batch after resuming at step 10^6."""
    def rss_mb() -> float:
        with open("/proc/self/status") as status:
            line = next(line for line in status if line.startswith("VmRSS"))
        return int(line.split()[1]) / 1024

    rt = lockstep.Runtime(accelerator="cpu", seed=0)
    before = rss_mb()
    started = time.perf_counter()
    loader = rt.loader(Indexed(10**9), batch_size=64, shuffle=True, num_workers=0)
    first = next(iter(loader))[0]
    first_s = time.perf_counter() - started
    started = time.perf_counter()
    resumed = rt.loader(Indexed(10**9), batch_size=64, shuffle=True, num_workers=0)
    resumed.load_state_dict({"epoch": 0, "batches_done": 10**6, "batch_size": 64, "order": "feistel-1"})
    later = next(iter(resumed))[0]
    resume_s = time.perf_counter() - started
    return {"first_s": first_s, "resume_s": resume_s, "extra_mb": rss_mb() - before,
            "first": rt.all_gather(first), "later": rt.all_gather(later), "kind": loader.state_dict()["order"]}


def hf_table(n: int):
    import datasets

    rows = [features(i) for i in range(n)]
    table = datasets.Dataset.from_dict({"index": list(range(n)), "x": [x.tolist() for x, _ in rows],
                                        "y": [int(y) for _, y in rows]})
    return table.with_format("torch")


def hf_batches(n: int) -> dict:
    """Global batches from a Hugging Face map-style Dataset (shuffled, rows fetched through
    __getitems__) and from its streaming form (4 shards, 2 workers); and the stream resumed
    through its own state_dict after 5 steps."""
    rt = lockstep.Runtime(accelerator="cpu", seed=1)

    def batches(loader, steps=None):
        seen = []
        for step, batch in enumerate(loader):
            seen.append(sorted(i for part in rt.all_gather(batch["index"]) for i in part.tolist()))
            if steps is not None and step + 1 == steps:
                break
        return seen

    table = hf_table(n)
    stream = rt.loader(table.to_iterable_dataset(num_shards=4), batch_size=8, num_workers=2)
    first = rt.loader(table.to_iterable_dataset(num_shards=4), batch_size=8, num_workers=0)
    head = batches(first, steps=5)
    position = first.state_dict()
    rest = rt.loader(table.to_iterable_dataset(num_shards=4), batch_size=8, num_workers=0)
    rest.load_state_dict(position)
    return {"map": batches(rt.loader(table, batch_size=8, shuffle=True, num_workers=0)),
            "stream": batches(stream), "resumed": head + batches(rest), "position": position}


def zipped_loaders(drop_last: bool, lengths: tuple[int, int] = (11, 12), alternate: bool = False) -> torch.Tensor:
    """Two training loaders zipped (e.g. labeled and unlabeled data), the loss the sum of both batches'
    means: the weights after one pass (at the length of the shorter)."""
    g = torch.Generator().manual_seed(1)
    a, b = [(torch.randn(n, 3, generator=g), torch.randn(n, generator=g)) for n in lengths]
    rt = lockstep.Runtime(accelerator="cpu", seed=0)
    torch.manual_seed(0)
    plain = torch.nn.Linear(3, 1)
    model, optimizer = rt.setup(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    first, second = (rt.loader(torch.utils.data.TensorDataset(*data), batch_size=4, drop_last=drop_last,
                               num_workers=0) for data in (a, b))
    if alternate:  # one loader's batch a step, in turn (multi-task): each step's loss is one batch's
        passes = [iter(first), iter(second)]
        for _ in range(min(len(first), len(second))):
            for batches in passes:  # drawn after the other loader's batch went through its backward
                x, y = next(batches)
                rt.backward(((model(x).squeeze(-1) - y) ** 2).mean())
                optimizer.step()
                optimizer.zero_grad()
    for (xa, ya), (xb, yb) in zip(first, second, strict=False) if not alternate else ():  # the shorter ends it
        rt.backward(((model(xa).squeeze(-1) - ya) ** 2).mean() + ((model(xb).squeeze(-1) - yb) ** 2).mean())
        optimizer.step()
        optimizer.zero_grad()
    return torch.cat([p.detach().flatten() for p in lockstep.unwrap(model).parameters()])


def zipped_by_hand(drop_last: bool, lengths: tuple[int, int] = (11, 12), alternate: bool = False) -> torch.Tensor:
    """The same in one plain loop: batches 4 by 4, in order."""
    g = torch.Generator().manual_seed(1)
    (xa, ya), (xb, yb) = [(torch.randn(n, 3, generator=g), torch.randn(n, generator=g)) for n in lengths]
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = (min(lengths) // 4) if drop_last else -(-min(lengths) // 4)
    for s in range(steps):
        rows = slice(4 * s, 4 * s + 4)
        def loss(x, y, rows=rows):
            return ((model(x[rows]).squeeze(-1) - y[rows]) ** 2).mean()

        for step_loss in ((lambda: loss(xa, ya), lambda: loss(xb, yb)) if alternate else
                          (lambda: loss(xa, ya) + loss(xb, yb),)):  # each loss after the last step
            step_loss().backward()
            optimizer.step()
            optimizer.zero_grad()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


class _TakesTheWholeBatch(torch.nn.Module):
    """``linear`` on the first input; the others (a tensor without elements, a shared one) only passed along."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor, *passed: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


def looked_ahead(how: str) -> torch.Tensor:
    """11 samples in global batches of 4 (the last split 2/1 over 2 ranks) and the loop's ways of holding
    more than one batch: ``"same"``, it fetches the next batch before training on this one (to know which is
    the last, as a port of Accelerate's ``end_of_dataloader`` or a prefetcher does) and gives the model the
    batch's tensors; ``"derived"``, the same with tensors made from them; ``"two"``, it fetches two batches,
    then trains on each (on views of their tensors; ``"two_derived"``, over 7 samples, on tensors made from
    them, which cannot name either batch); ``"two_dicts"``, the same over 7 samples (the second
    batch split 2/1) in dict batches whose first tensor is the target, not the model's input, with a tensor
    without elements and one that every batch shares; ``"skip"``, ``"skip_derived"`` and ``"skip_tuples"``
    (a collate_fn that returns a tuple), a plain loop that passes over batch 1 before its forward. The
    weights after the pass."""
    n = 7 if how in ("two_dicts", "two_derived") else 11
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g)
    rt = lockstep.Runtime(accelerator="cpu", seed=0)
    torch.manual_seed(0)
    plain = torch.nn.Linear(3, 1)
    model, optimizer = rt.setup(_TakesTheWholeBatch(plain) if how == "two_dicts" else plain,
                                torch.optim.SGD(plain.parameters(), lr=0.5))

    def train(xb: torch.Tensor, yb: torch.Tensor) -> None:
        rt.backward(torch.nn.functional.mse_loss(model(xb if how in ("same", "skip", "skip_tuples") else
                                                       xb * 1.0 if how not in ("two", "two_dicts") else xb[:, :]), yb))
        optimizer.step()
        optimizer.zero_grad()

    if how == "two_dicts":
        shared = torch.ones(1)

        def collate(items: list[int]) -> dict[str, torch.Tensor]:
            return {"y": y[items], "x": x[items], "none": torch.empty(len(items), 0), "shared": shared}

        batches = iter(rt.loader(list(range(n)), batch_size=4, shuffle=False, num_workers=0, collate_fn=collate))
        fetched = [next(batches), next(batches)]  # both held at once; the pass has not ended yet
        for batch in fetched:  # the model is given the batch's every tensor, its empty and its shared one too
            rt.backward(torch.nn.functional.mse_loss(model(batch["x"][:, :], batch["none"], batch["shared"]),
                                                     batch["y"]))
            optimizer.step()
            optimizer.zero_grad()
        return torch.cat([p.detach().flatten() for p in lockstep.unwrap(model).parameters()])
    as_tuple = {"collate_fn": lambda rows: tuple(torch.stack(column) for column in zip(*rows, strict=True))}
    batches = iter(rt.loader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=False, num_workers=0,
                             **(as_tuple if how == "skip_tuples" else {})))
    if how.startswith("skip"):
        for index, (xb, yb) in enumerate(batches):
            if index != 1:
                train(xb, yb)
    elif how in ("two", "two_derived"):
        while fetched := [batch for batch in (next(batches, None), next(batches, None)) if batch is not None]:
            for xb, yb in fetched:
                train(xb, yb)
    else:
        ahead = next(batches, None)
        while ahead is not None:
            (xb, yb), ahead = ahead, next(batches, None)  # looked ahead: is this batch the last?
            train(xb, yb)
    return torch.cat([p.detach().flatten() for p in lockstep.unwrap(model).parameters()])


def looked_ahead_by_hand(skip: int | None = None, n: int = 11) -> torch.Tensor:
    """``looked_ahead`` in one plain loop over ``n`` samples: the global batches in order (batch ``skip`` passed
    over)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(n, 3, generator=g), torch.randn(n, 1, generator=g)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for index, start in enumerate(range(0, n, 4)):
        if index != skip:
            torch.nn.functional.mse_loss(model(x[start:start + 4]), y[start:start + 4]).backward()
            optimizer.step()
            optimizer.zero_grad()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def evaluated_under_grad_mode() -> torch.Tensor:
    """A BatchNorm model in eval mode evaluated without ``torch.no_grad`` (a common slip) on 97 samples in
    batches of 12: on 2 ranks, shards of 9 and 8 batches, where DDP's forward would broadcast the buffers in
    every grad-mode forward and the rank with one more batch would wait for the other (20 s, then a Gloo
    timeout). The gathered predictions."""
    rt = lockstep.Runtime(accelerator="cpu", seed=0, timeout=20)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 4))
    model = rt.setup(net)
    model.eval()
    x = torch.randn(97, 3, generator=torch.Generator().manual_seed(1))
    return rt.gather([model(batch).argmax(1) for (batch,) in rt.eval_loader(torch.utils.data.TensorDataset(x),
                                                                            batch_size=12, num_workers=0)])


def evaluated_by_hand() -> torch.Tensor:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 4)).eval()
    with torch.no_grad():
        return net(torch.randn(97, 3, generator=torch.Generator().manual_seed(1))).argmax(1)


def global_batches_smaller_than_the_ranks() -> list[str]:
    """A global batch_size of 1 on more ranks, for a map-style dataset and for a stream: the errors."""
    rt = lockstep.Runtime(accelerator="cpu", seed=0)
    errors = []
    for data in (Indexed(5), IndexedStream(5)):
        try:
            rt.loader(data, batch_size=1, num_workers=0)
            errors.append("no error")
        except ValueError as error:
            errors.append(str(error))
    return errors


def batch_sampler_with_a_batch_of_one() -> str:
    """A batch sampler whose second batch holds 1 sample, on more ranks: the error each rank raises."""
    rt = lockstep.Runtime(accelerator="cpu", seed=0)
    loader = rt.loader(Indexed(5), batch_sampler=[[0, 1, 2, 3], [4]], num_workers=0)
    try:
        for _ in loader:
            pass
    except ValueError as error:
        return str(error)
    return "no error"


def gathered_with_repeats() -> list[list[int]]:
    """A pass over 8 samples drawn 16 times with replacement, in global batches of 4 (each index comes about
    twice), each row's output its place in the pass (step * 4 + its row in the global batch): ``rt.gather``'s
    rows as (index, place), gathered in dataset order."""
    rt = lockstep.Runtime(accelerator="cpu", seed=3)
    data = torch.utils.data.TensorDataset(torch.arange(8))
    loader = rt.loader(data, batch_size=4, sampler=WeightedRandomSampler(torch.ones(8), 16, replacement=True),
                       num_workers=0)
    outputs = []
    for step, (x,) in enumerate(loader):
        first = 2 * rt.rank if rt.world_size == 2 else 0  # this rank's share starts here in the global batch
        outputs.append(torch.stack([x, step * 4 + first + torch.arange(len(x))], 1))
    return rt.gather(outputs).tolist()
