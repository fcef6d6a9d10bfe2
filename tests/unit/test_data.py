"""Data as real jobs have it: the lazy permutation, user samplers, streams, huge datasets and
outputs in dataset order, each against a single-process run or a hand computation."""

from __future__ import annotations

import functools
import gc
import math
import random
import time

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lockstep
from checks import data as checks
from checks import trainer as trainer_checks
from lockstep import DistEnv, Runtime
from lockstep.runtime.data.order import RANDPERM_MAX, FeistelPermutation, Shuffled
from lockstep.runtime.data.streams import StreamShard
from lockstep.runtime.parallel.mesh import Membership
from lockstep.runtime.seed import mix_seed

pytestmark = pytest.mark.timeout(180)


def runtime(**kwargs) -> Runtime:
    return Runtime(accelerator="cpu", env=DistEnv(), **kwargs)


def _ks_to_uniform(values: torch.Tensor, n: int) -> float:
    """Kolmogorov-Smirnov distance between the empirical distribution of ``values`` in [0, n) and uniform."""
    x = (values.double().sort().values + 0.5) / n
    m = len(x)
    above = torch.arange(1, m + 1, dtype=torch.float64) / m - x
    below = x - torch.arange(0, m, dtype=torch.float64) / m
    return float(torch.maximum(above, below).max())


class _StreamClassifier(trainer_checks.Classifier):
    def training_step(self, batch, batch_idx):
        _, x, y = batch
        return super().training_step((x, y), batch_idx)


def _drop_a_loader_with_workers() -> None:
    rt = runtime()
    loader = rt.loader(checks.IndexedStream(40), batch_size=8, num_workers=2)
    assert len(list(loader)) == 5


# -- the permutation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 31, 97, 1000, 1024, 4093, 65536, 65537, 100003])
def test_feistel_permutation_is_a_bijection(n):
    for seed in (0, 1, 12345):
        images = FeistelPermutation(n, seed)(torch.arange(n))
        assert torch.equal(images.sort().values, torch.arange(n))
    if n > 8:  # different seeds give different orders
        assert not torch.equal(FeistelPermutation(n, 0)(torch.arange(n)), FeistelPermutation(n, 1)(torch.arange(n)))


def test_feistel_first_batches_are_as_uniform_as_randperms():
    """The first batch (32 of n = 10,007) over 1,000 seeds, for Feistel and for randperm. The test: a
    one-sample Kolmogorov-Smirnov test against uniform on [0, n) of each position's values and of
    all values pooled (critical distance 1.63/sqrt(samples) at the 1% level), and the correlation
    of neighbouring positions (its standard error is about 0.006)."""
    n, seeds, batch = 10_007, 1000, 32
    feistel = torch.stack([FeistelPermutation(n, seed)(torch.arange(batch)) for seed in range(seeds)])
    randperm = torch.stack([torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:batch]
                            for seed in range(seeds)])
    critical = 1.63 / math.sqrt(seeds)
    for name, draws in (("feistel", feistel), ("randperm", randperm)):
        distances = [_ks_to_uniform(draws[:, p], n) for p in range(batch)]
        # At the 1% level about one position in 100 fails by chance; allow 2 of 32.
        assert sum(d > critical for d in distances) <= 2, (name, distances)
        pooled = _ks_to_uniform(draws.reshape(-1), n)
        assert pooled < 1.63 / math.sqrt(seeds * batch), (name, pooled)
        neighbours = torch.corrcoef(torch.stack([draws[:, :-1].reshape(-1), draws[:, 1:].reshape(-1)]).double())[0, 1]
        assert abs(float(neighbours)) < 0.03, (name, float(neighbours))


def test_small_datasets_keep_the_randperm_order_and_large_ones_use_feistel():
    small = Shuffled(1000, seed=7)
    small.set_epoch(3)
    expected = torch.randperm(1000, generator=torch.Generator().manual_seed(mix_seed(7, 3)))
    assert small.kind == "randperm" and small.take(0, 1000) == expected.tolist()
    assert Shuffled(RANDPERM_MAX, 0).kind == "randperm" and Shuffled(RANDPERM_MAX + 1, 0).kind == "feistel-1"


def test_a_checkpoint_with_another_order_is_refused():
    rt = runtime()
    loader = rt.loader(checks.Indexed(RANDPERM_MAX + 1), batch_size=8, shuffle=True, num_workers=0)
    for old in ({"epoch": 0, "batches_done": 3, "batch_size": 8},  # written before orders were recorded
                {"epoch": 0, "batches_done": 3, "batch_size": 8, "order": "randperm"}):
        with pytest.raises(ValueError, match="data order is 'randperm', this loader's is 'feistel-1'"):
            loader.load_state_dict(old)


# -- single process: the rules and their errors --------------------------------------------------------
def test_gather_refuses_outputs_that_are_not_one_row_per_sample():
    rt = runtime()
    loader = rt.loader(checks.Indexed(10), batch_size=4, shuffle=True, num_workers=0)
    outputs = [index for index, _, _ in loader]
    assert torch.equal(rt.gather(outputs), torch.arange(10))
    with pytest.raises(ValueError, match=r"a list of 2 tensors, neither one per batch of the loader's last pass "
                                         r"\(3 batches of 4, 4, 2 rows here\) nor one per sample \(10\)"):
        rt.gather(outputs[:2])
    with pytest.raises(ValueError, match="holds 8 rows, but the loader's last pass handed out 10"):
        rt.gather(torch.cat(outputs[:2]))
    assert len(rt.gather(outputs[:2], order="rank")) == 8
    partial = rt.loader(checks.Indexed(10), batch_size=4, shuffle=True, num_workers=0)
    seen = []
    for index, _, _ in partial:  # a pass left early: what it handed out so far
        seen.append(index)
        break
    assert torch.equal(rt.gather(seen), seen[0].sort().values)
    assert torch.equal(rt.gather(outputs, loader=loader), torch.arange(10))


def test_gather_does_not_read_a_batchs_list_of_fields_as_its_rows():
    """Per-batch outputs written as a list ``[x * 2, x * 3]`` in batches of 2 rows: as many fields as rows, each
    batch's list was read as its 2 rows, and 8 "rows" came back, the fields' tensors, with no error."""
    rt = runtime()
    listed = [[index * 2, index * 3] for index, _, _ in rt.eval_loader(checks.Indexed(8), batch_size=2)]
    with pytest.raises(ValueError, match=r"a list of 4 lists of tensors, each a batch's fields \(\[logits, labels\]\), "
                                         "not its rows: collect each batch's fields as a tuple or a dict"):
        rt.gather(listed)
    doubled, tripled = rt.gather([(index * 2, index * 3) for index, _, _ in rt.eval_loader(checks.Indexed(8),
                                                                                              batch_size=2)])
    assert torch.equal(doubled, torch.arange(8) * 2) and torch.equal(tripled, torch.arange(8) * 3)
    texts = [[f"s{i}" for i in index.tolist()] for index, _, _ in rt.eval_loader(checks.Indexed(8), batch_size=2)]
    assert rt.gather(texts) == [f"s{i}" for i in range(8)]  # a batch's list of its rows' texts stays its rows


def test_gather_takes_one_output_per_sample_as_its_rows_even_where_their_lengths_add_up_to_the_samples():
    """Detections per image (0, 1 or 2 each here) collected one per sample: their lengths add up to the 6
    samples, and they were joined as per-batch chunks, row 0 holding sample 1's detection, with no error."""
    rt = runtime()
    detections = []
    for index, _, _ in rt.eval_loader(checks.Indexed(6), batch_size=4):
        detections.extend(torch.arange(int(i) % 3) + 100 * i for i in index)
    assert [d.tolist() for d in rt.gather(detections)] == [[], [100], [200, 201], [], [400], [500, 501]]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_tensor_dataset_is_fetched_a_batch_at_a_time_with_what_default_collate_gives(workers):
    """The rows of a TensorDataset's batch come from one index per tensor; the batches equal those of
    a DataLoader that fetches each item and collates them, in values, dtypes and container."""
    data = TensorDataset(torch.randn(50, 3), torch.arange(50), torch.rand(50) > 0.5)
    rt = runtime(seed=3)
    loader = rt.loader(data, batch_size=8, shuffle=True, num_workers=workers)
    assert type(loader.loader.dataset).__name__ == "TensorRows"  # the batched fetch is the one tested
    for _ in range(2):  # two epochs
        batches = list(loader)
        by_item = [torch.utils.data.default_collate([data[i] for i in index.tolist()]) for _, index, _ in batches]
        assert len(batches) == 7
        for got, expected in zip(batches, by_item, strict=True):
            assert type(got) is type(expected) is list
            for a, b in zip(got, expected, strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b)
    evaluation = rt.eval_loader(data, batch_size=8, num_workers=workers)
    assert torch.equal(torch.cat([i for _, i, _ in evaluation]), torch.arange(50))


def test_a_dataset_that_changes_what_an_item_is_is_fetched_item_by_item():
    class Doubled(TensorDataset):
        def __getitem__(self, index):
            x, y = super().__getitem__(index)
            return 2 * x, y

    data = Doubled(torch.arange(10.0), torch.arange(10))
    rt = runtime()
    assert [x.tolist() for x, _ in rt.loader(data, batch_size=5, num_workers=0)] == [
        [0.0, 2.0, 4.0, 6.0, 8.0], [10.0, 12.0, 14.0, 16.0, 18.0]]
    with_collate = rt.loader(TensorDataset(torch.arange(4)), batch_size=2, num_workers=0, collate_fn=len)
    assert list(with_collate) == [2, 2]  # a collate_fn of the user's own sees the items


def test_a_tensor_dataset_with_its_own_batched_fetch_is_read_through_it():
    class Scaled(TensorDataset):
        def __getitems__(self, indices):  # the batched fetch torch's DataLoader uses where a dataset has one
            return [(self.tensors[0][i] * 100,) for i in indices]

    rt = runtime()
    plain = torch.utils.data.DataLoader(Scaled(torch.arange(6)), batch_size=3)
    expected = [batch[0].tolist() for batch in plain]
    assert expected == [[0, 100, 200], [300, 400, 500]]
    # before: the subclass was read as a plain TensorDataset ([[0, 1, 2], [3, 4, 5]])
    assert [batch[0].tolist() for batch in rt.loader(Scaled(torch.arange(6)), batch_size=3, num_workers=0)] == expected


def test_a_loader_without_workers_fetches_what_the_dataloader_would_and_names_the_fetch_in_a_profile():
    """Without workers the batches are fetched in this process (not through the DataLoader's iterator): the same
    batches, from a dataset's items and the user's collate, as a DataLoader over the same index batches; under
    torch.profiler each fetch is one named range, as the DataLoader's own is."""
    class Items(torch.utils.data.Dataset):
        def __len__(self):
            return 30

        def __getitem__(self, index):
            return {"x": torch.full((2,), float(index)), "i": index}

    def collate(items):
        return {"x": torch.stack([item["x"] for item in items]), "i": [item["i"] for item in items]}

    rt = runtime(seed=5)
    loader = rt.loader(Items(), batch_size=8, shuffle=True, num_workers=0, collate_fn=collate)
    for _ in range(2):  # two epochs: each its own order
        got = list(loader)
        order = [loader.sampler.local_indices(step) for step in range(4)]  # the pass's batches, as drawn
        expected = list(DataLoader(Items(), batch_sampler=order, collate_fn=collate))
        assert sorted(i for batch in order for i in batch) == list(range(30))
        assert len(got) == 4 and [b["i"] for b in got] == [b["i"] for b in expected]
        assert all(torch.equal(a["x"], b["x"]) for a, b in zip(got, expected, strict=True))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        assert len(list(loader)) == 4
    assert sum(event.name == "lockstep.loader.fetch" for event in profile.events()) == 4


def test_loader_options_that_contradict_each_other_are_refused():
    rt = runtime()
    data = checks.Indexed(10)
    weighted = torch.utils.data.WeightedRandomSampler([1.0] * 10, 10)
    with pytest.raises(ValueError, match="sampler= and shuffle=True contradict"):
        rt.loader(data, batch_size=2, shuffle=True, sampler=weighted)
    with pytest.raises(ValueError, match="batch_sampler= chooses the global batches itself: drop batch_size="):
        rt.loader(data, batch_size=2, batch_sampler=[[0, 1]])
    with pytest.raises(ValueError, match="no sampler="):
        rt.eval_loader(data, batch_size=2, sampler=weighted)
    with pytest.raises(ValueError, match="IndexedStream is a stream"):
        rt.loader(checks.IndexedStream(10), batch_size=2, shuffle=True)
    with pytest.raises(ValueError, match="has no __len__"):
        rt.loader(object(), batch_size=2)
    with pytest.raises(ValueError, match="timeout=5 is how long to wait for a worker's batch, and num_workers=0"):
        rt.loader(data, batch_size=2, num_workers=0, timeout=5)  # ignored by the fetch without workers


def test_an_evaluation_dataloader_keeps_the_samples_its_sampler_chose_or_is_refused():
    """A validation DataLoader over a SubsetRandomSampler (a train/val split) evaluates those samples, each once,
    in the order of its indices; a sampler that could repeat or weigh samples is refused by name, not dropped."""
    rt = runtime()
    data = checks.Indexed(20)
    chosen = [17, 3, 9, 12, 5]
    subset = torch.utils.data.SubsetRandomSampler(chosen)
    for loader in (DataLoader(data, batch_size=2, sampler=subset),
                   DataLoader(data, batch_size=None, sampler=torch.utils.data.BatchSampler(subset, 2, False))):
        evaluated = rt.eval_loader(loader, batch_size=2, num_workers=0)
        assert torch.cat([i for i, _, _ in evaluated]).tolist() == chosen
    for chooser in (dict(sampler=torch.utils.data.WeightedRandomSampler([1.0] * 20, 20)),
                    dict(batch_sampler=[[0, 1], [0, 1]])):
        with pytest.raises(ValueError, match="chooses which samples to take.*Subset"):
            rt.eval_loader(DataLoader(data, **chooser), batch_size=2)
    class Unrepeated(torch.utils.data.DistributedSampler):  # no padding: each rank's own samples, its way
        def __iter__(self):
            return iter(range(self.rank, len(self.dataset), self.num_replicas))

    split = Unrepeated(data, num_replicas=1, rank=0)
    for loader in (DataLoader(data, batch_size=4, sampler=split),
                   DataLoader(data, batch_size=None, sampler=torch.utils.data.BatchSampler(split, 4, False))):
        assert torch.cat([i for i, _, _ in rt.eval_loader(loader, batch_size=4, num_workers=0)]).tolist() == list(
            range(20))  # over the ranks, every sample once: evaluation takes them all in order
    unbatched = DataLoader(data, batch_size=None)  # torch: one sample at a time; lockstep batches with batch_size
    assert [len(i) for i, _, _ in rt.loader(unbatched, batch_size=8, num_workers=0)] == [8, 8, 4]
    assert [len(items) for items in rt.eval_loader(DataLoader(data, batch_size=None, collate_fn=list), batch_size=8,
                                                    num_workers=0)] == [8, 8, 4]  # its own collate_fn, kept
    everything = DataLoader(data, batch_size=4, shuffle=True)  # an order of every sample: dropped
    assert torch.cat([i for i, _, _ in rt.eval_loader(everything, batch_size=4, num_workers=0)]).tolist() == list(
        range(20))


def test_a_dataloader_brings_its_sampler_and_a_distributed_sampler_becomes_shuffle():
    rt = runtime(seed=4)
    data = checks.Indexed(30)
    weighted = DataLoader(data, batch_size=6, sampler=torch.utils.data.WeightedRandomSampler([1.0] * 30, 12))
    assert [len(index) for index, _, _ in rt.loader(weighted, num_workers=0)] == [6, 6]
    distributed = DataLoader(data, batch_size=6, sampler=torch.utils.data.DistributedSampler(
        data, num_replicas=1, rank=0, shuffle=True))
    loader = rt.loader(distributed, num_workers=0)
    assert loader.state_dict()["order"] == "randperm"
    assert sorted(i for index, _, _ in loader for i in index.tolist()) == list(range(30))

    class OwnSplit(torch.utils.data.DistributedSampler):  # chooses this rank's samples its own way
        def __iter__(self):
            return iter([0] * self.num_samples)

    class EvenOnly(torch.utils.data.RandomSampler):  # a RandomSampler subclass that chooses its samples itself
        def __iter__(self):
            return iter([i for i in super().__iter__() if i % 2 == 0])

    for chooser in (EvenOnly(data), type("Evens", (torch.utils.data.SequentialSampler,),
                                         {"__iter__": lambda self: iter(range(0, 30, 2))})(data)):
        kept = rt.loader(DataLoader(data, batch_size=5, sampler=chooser), num_workers=0)  # torch's order replaced it
        assert sorted(i for index, _, _ in kept for i in index.tolist()) == list(range(0, 30, 2))
        with pytest.raises(ValueError, match="chooses which samples to take"):
            rt.eval_loader(DataLoader(data, batch_size=5, sampler=chooser))
    own = OwnSplit(data, num_replicas=1, rank=0)
    for given in (dict(data=DataLoader(data, batch_size=6, sampler=own)), dict(data=data, batch_size=6, sampler=own)):
        with pytest.raises(ValueError, match="OwnSplit is a DistributedSampler with its own __iter__"):
            rt.loader(**given)
    # batch_size=None with a sampler of batches (torch's batched-fetch idiom): the sampler gives the batches
    of_batches = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(data), 8, False)
    batched = DataLoader(data, batch_size=None, sampler=of_batches)
    assert [index.tolist() for index, _, _ in rt.loader(batched, num_workers=0)] == [list(b) for b in of_batches]
    with pytest.raises(ValueError, match="hands dataset\\[indices\\] to its collate_fn"):
        rt.loader(DataLoader(data, batch_size=None, sampler=of_batches, collate_fn=len))


def test_a_batch_sampler_over_a_distributed_sampler_of_several_ranks_is_refused():
    """A plain DDP script's BatchSampler(DistributedSampler(...)) yields this rank's batches: lockstep split each
    again, and every rank trained on half of its own (half the data an epoch, with no error)."""
    rt = runtime()
    data = checks.Indexed(16)
    per_rank = torch.utils.data.BatchSampler(torch.utils.data.DistributedSampler(data, num_replicas=2, rank=0), 4,
                                             False)
    for given in (dict(data=DataLoader(data, batch_sampler=per_rank)), dict(data=data, batch_sampler=per_rank)):
        with pytest.raises(ValueError, match="draws from a DistributedSampler of 2 replicas"):
            rt.loader(**given, num_workers=0)
    whole = torch.utils.data.BatchSampler(torch.utils.data.DistributedSampler(data, num_replicas=1, rank=0), 4, False)
    loader = rt.loader(DataLoader(data, batch_sampler=whole), num_workers=0)
    assert sorted(i for index, _, _ in loader for i in index.tolist()) == list(range(16))


@pytest.mark.parametrize("length, drop_last, at", [(5, False, 1), (15, False, 3), (9, True, 2), (17, True, 3)])
def test_a_stream_whose_len_is_not_what_it_yields_is_refused_at_the_batch_that_shows_it(length, drop_last, at):
    """The global batch sizes, hence the loss weights, follow from __len__: 12 items said to be `length`."""
    class Sized(checks.IndexedStream):
        def __len__(self):
            return length

    rt = runtime()
    with pytest.raises(ValueError, match=f"Sized yielded .* for global batch {at} where its __len__ \\({length}\\)"):
        list(rt.loader(Sized(12), batch_size=4, drop_last=drop_last, num_workers=0))


@pytest.mark.parametrize("length, drop_last", [(9, False), (10, True), (11, True)])
@pytest.mark.parametrize("evaluation", [False, True])
def test_a_seekable_stream_longer_than_its_len_is_refused_not_cut_short(length, drop_last, evaluation):
    """A stream whose iterator can skip is read only for this rank's items, its batches sized from __len__: 12
    records said to be `length` were cut to `length`, an evaluation over fewer samples than the stream, with no
    error (a stream without skip was refused)."""
    class Said(checks.SeekableRecords):
        def __len__(self):
            return length

    rt = runtime()
    make = rt.eval_loader if evaluation else functools.partial(rt.loader, drop_last=drop_last)
    with pytest.raises(ValueError, match=f"Said yields more items than the {length} its __len__ promises"):
        list(make(Said(12), batch_size=4, num_workers=0))
    assert [i.tolist() for i, _, _ in make(checks.SeekableRecords(12), batch_size=4, num_workers=0)] == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]  # the same stream, told its length

    class Unclamped(checks.SeekableRecords):  # a seek that says it passed over items past the end
        def __iter__(self):
            cursor = super().__iter__()
            cursor.skip = lambda count: setattr(cursor, "position", cursor.position + count) or count
            return cursor

    assert len(list(make(Unclamped(12), batch_size=4, num_workers=0))) == 3


def test_stream_drop_last_and_a_last_batch_smaller_than_the_world():
    rt = runtime()
    kept = [index.tolist() for index, _, _ in rt.loader(checks.IndexedStream(10), batch_size=4, num_workers=0)]
    dropped = [index.tolist() for index, _, _ in rt.loader(checks.IndexedStream(10), batch_size=4,
                                                            drop_last=True, num_workers=0)]
    assert kept == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]] and dropped == kept[:2]
    evaluated = [index.tolist() for index, _, _ in rt.eval_loader(checks.IndexedStream(10), batch_size=4,
                                                                   num_workers=0)]
    assert evaluated == kept


def test_trainer_trains_on_a_stream_by_max_steps(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="give the Trainer max_steps"):
        trainer_checks.quiet_trainer(max_epochs=1).fit(_StreamClassifier(), checks.IndexedStream(100), batch_size=10)
    trainer = trainer_checks.quiet_trainer(max_steps=25)
    trainer.fit(_StreamClassifier(), checks.IndexedStream(100), batch_size=10)
    assert trainer.global_step == 25 and trainer.current_epoch == 2  # two passes of 10 steps, then 5


def test_trainer_takes_a_dataloader_with_a_weighted_sampler(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = TensorDataset(torch.randn(40, 8), torch.randint(0, 4, (40,)))
    loader = DataLoader(data, batch_size=8, sampler=torch.utils.data.WeightedRandomSampler([1.0] * 40, 24))
    trainer = trainer_checks.quiet_trainer(max_epochs=2)
    trainer.fit(trainer_checks.Classifier(), loader)
    assert trainer.global_step == 6 and trainer.steps_per_epoch == 3


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("evaluation", [False, True])
def test_a_seekable_stream_is_read_only_for_each_ranks_share(world, evaluation):
    """Rank by rank, a stream whose iterator can skip gives the same shares as one read whole, and
    decodes only its own items (and one item for a rank whose share of the last batch is empty)."""
    def shares(stream, rank):
        shard = StreamShard(stream, n, 8, Membership(rank, world), drop_last=False,
                            collate_fn=lambda items: [i for i, _, _ in items], pad_empty=evaluation)
        shard.start_step, shard.skip = 2, 16  # a resumed pass: steps 0 and 1 were trained on
        return [(step, size, rows) for step, size, rows in shard]

    n = 8 * 12 + 3  # the last batch holds 3 items: with 4 ranks, one rank's share is empty
    for rank in range(world):
        seekable = checks.SeekableRecords(n)
        got, expected = shares(seekable, rank), shares(checks.IndexedStream(n), rank)  # a generator: read whole
        if not evaluation and world == 4 and rank == 3:
            assert got[-1][2] is None and expected[-1][2] is None
        assert got == expected
        assert [step for step, _, _ in got] == list(range(2, 13)) and got[-1][1] == 3
        own = sum(max(len(rows), 1) if rows is not None else 0 for _, _, rows in got)
        assert seekable.decoded == own


def test_a_seekable_stream_with_workers_gives_batches_in_order():
    rt = runtime()
    loader = rt.loader(checks.SeekableRecords(100), batch_size=8, num_workers=2)
    assert [index.tolist() for index, _, _ in loader] == [list(range(s, min(s + 8, 100))) for s in range(0, 100, 8)]


def test_a_stream_with_persistent_workers_moves_to_a_loaded_position():
    rt = runtime()
    loader = rt.loader(checks.IndexedStream(40), batch_size=8, num_workers=2)
    assert [index[0].item() for index, _, _ in loader] == [0, 8, 16, 24, 32]
    loader.load_state_dict({"epoch": 1, "batches_done": 2, "batch_size": 8, "order": "stream"})
    assert [index[0].item() for index, _, _ in loader] == [16, 24, 32]
    assert [index[0].item() for index, _, _ in loader] == [0, 8, 16, 24, 32]  # the next epoch starts at 0


@pytest.mark.parametrize("workers", [2, 3])
@pytest.mark.parametrize("stream", ["IndexedStream", "SeekableRecords"])
def test_a_stream_resumed_at_any_step_with_workers_comes_in_order(stream, workers):
    """The DataLoader asks worker 0 first at every pass: from a resumed pass's first step on, whatever its
    number (at step 1 of 2 workers, worker 0 took step 2 and the batches came out of order)."""
    for done in range(1, 5):
        loader = runtime().loader(getattr(checks, stream)(40), batch_size=8, num_workers=workers)
        loader.load_state_dict({"epoch": 0, "batches_done": done, "batch_size": 8, "order": "stream"})
        assert [index[0].item() for index, _, _ in loader] == list(range(8 * done, 40, 8))


def _augmented(items):
    """A collate_fn that augments: each row's index, and a random draw (where docs/data.md puts the work)."""
    return torch.tensor([item[0] for item in items]), torch.rand(len(items))


def test_a_streams_augmentations_in_collate_fn_do_not_depend_on_the_workers_and_a_resume_draws_them_again():
    """Workers seed their generators before each batch's collate_fn from (seed, rank, epoch, step): 2 workers
    draw what 3 draw, and a pass resumed at batch 2 (new workers) what the uninterrupted pass drew there."""
    def draws(workers: int, done: int = 0) -> list[list[float]]:
        loader = runtime().loader(checks.IndexedStream(40), batch_size=8, num_workers=workers, collate_fn=_augmented)
        if done:
            loader.load_state_dict({"epoch": 1, "batches_done": done, "batch_size": 8, "order": "stream"})
            return [[round(v, 6) for v in noise.tolist()] for _, noise in loader]
        return [[round(v, 6) for v in noise.tolist()] for _epoch in range(2) for _, noise in loader]

    two = draws(2)
    assert len({v for batch in two for v in batch}) == 80  # every batch and epoch its own draws
    assert draws(3) == two
    assert draws(2, done=2) == two[5 + 2:]  # epoch 1 from its batch 2


@pytest.mark.parametrize("data", ["stream", "batch sampler"])
def test_a_state_saved_at_a_passs_end_resumes_at_the_next_epochs_start(data):
    """A hand-written loop that saves its loader after each epoch: the loader given that state trains the next
    epoch, whole (it gave an empty pass, an epoch lost, where batches_done alone cannot tell the pass ended)."""
    def make():
        if data == "stream":
            return runtime().loader(checks.IndexedStream(40), batch_size=8, num_workers=0)
        return runtime().loader(checks.Indexed(24), batch_sampler=checks.EpochCounted(), num_workers=0)

    uninterrupted = make()
    passes = [[index.tolist() for index, _, _ in uninterrupted] for _ in range(3)]
    saved = make()
    for _ in saved:
        pass
    assert saved.state_dict()["ended"] is True
    resumed = make()
    resumed.load_state_dict(saved.state_dict())
    assert [[index.tolist() for index, _, _ in resumed] for _ in range(2)] == passes[1:]
    assert resumed.epoch == 2


class ShuffledByEpoch(torch.utils.data.IterableDataset):
    """24 items in an order drawn from the epoch that set_epoch gave."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = list(range(24))
        random.Random(self.epoch).shuffle(order)
        return iter(torch.tensor([i]) for i in order)


def test_a_streams_set_epoch_reaches_its_persistent_workers_copies():
    """Each persistent worker holds a copy of the stream made when it started: set_epoch is called on that copy
    at each pass (it reached the main process's alone: every epoch repeated the first one's order), and a
    position in another epoch starts new workers."""
    def passes(workers: int, moved_to: int | None = None) -> list[list[list[int]]]:
        loader = runtime().loader(ShuffledByEpoch(), batch_size=4, num_workers=workers)
        seen = []
        for number in range(3):
            if number == 1 and moved_to is not None:
                loader.load_state_dict({"epoch": moved_to, "batches_done": 0, "batch_size": 4, "order": "stream"})
            seen.append([batch.flatten().tolist() for batch in loader])
        return seen

    alone = passes(0)
    assert alone[0] != alone[1] != alone[2]
    assert passes(2) == alone
    assert passes(2, moved_to=5) == passes(0, moved_to=5) != alone


class Positioned(torch.utils.data.IterableDataset):
    """Keeps its own position, as a live dict its state_dict returns, and rewinds to its start in set_epoch."""

    def __init__(self) -> None:
        self.state = {"at": 0}

    def set_epoch(self, epoch: int) -> None:
        self.state = {"at": 0}

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.state = dict(state)

    def __iter__(self):
        while self.state["at"] < 10:
            self.state["at"] += 1
            yield torch.tensor([float(self.state["at"])])


def test_a_stream_that_keeps_its_own_position_resumes_after_the_batch_handed_out():
    """The loader draws a batch ahead: what it saves is the stream's position after the batch handed out (a copy,
    the live dict moves on), and a resumed pass loads it after set_epoch, which would rewind the stream."""
    loader = runtime().loader(Positioned(), batch_size=2, num_workers=0)
    batches = iter(loader)
    assert [next(batches).flatten().tolist() for _ in range(2)] == [[1, 2], [3, 4]]
    saved = loader.state_dict()
    assert saved["stream"] == {"at": 4} and saved["batches_done"] == 2
    resumed = runtime().loader(Positioned(), batch_size=2, num_workers=0)
    resumed.load_state_dict(saved)
    assert [batch.flatten().tolist() for batch in resumed] == [[5, 6], [7, 8], [9, 10]]


def test_a_one_shot_iterator_trains_one_pass_and_a_second_pass_is_refused_by_name():
    loader = runtime().loader((torch.tensor([float(i)]) for i in range(12)), batch_size=4, num_workers=0)
    assert [batch.flatten().tolist() for batch in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    with pytest.raises(ValueError, match="is a one-shot iterator .* pass 2 would find it empty"):
        next(iter(loader))  # it gave an empty pass, and a hand-written loop trained on nothing


def test_persistent_workers_of_a_loader_freed_by_the_garbage_collector_stop_at_once():
    """The Runtime and its loader end in a reference cycle, which only the garbage collector frees.
    Its workers must be told to stop while their queues still work: without that, the DataLoader
    waited out a 5 s join timeout for each worker (10 s here), at whatever moment the collector ran."""
    _drop_a_loader_with_workers()
    start = time.monotonic()
    gc.collect()
    assert time.monotonic() - start < 4



def test_a_ported_distributed_sampler_set_epoch_line_is_harmless():
    """``train_loader.sampler.set_epoch(epoch)`` from a plain DDP script: nothing changes, each pass of the
    loader is still the next epoch (the same batches as without the line)."""
    import lockstep

    data = torch.utils.data.TensorDataset(torch.arange(20))
    rt = lockstep.Runtime(accelerator="cpu", env=lockstep.DistEnv(), seed=3)
    plain = rt.loader(data, batch_size=4, shuffle=True)
    ported = rt.loader(data, batch_size=4, shuffle=True)
    for epoch in range(3):
        ported.sampler.set_epoch(epoch + 7)  # any number: lockstep seeds each pass itself
        assert [b[0].tolist() for b in ported] == [b[0].tolist() for b in plain]
    rt.eval_loader(data, batch_size=4).sampler.set_epoch(1)


def test_a_last_global_batch_with_fewer_rows_than_ranks_is_refused_before_the_first_step_naming_drop_last():
    """18 samples in global batches of 8 on 4 data-parallel ranks: the last batch's 2 rows would leave two ranks
    without rows (a dict batch fails to collate, a Hugging Face model fails on zero rows)."""
    import lockstep
    from lockstep.runtime.data.assembly import Loaders
    from lockstep.runtime.parallel.mesh import Membership

    def loaders(rank: int, size: int) -> Loaders:
        return Loaders(Membership(rank, size), size, torch.device("cpu"), 0, None, False, False, None, print,
                       every_rank=lambda n: [n] * size)

    data = torch.utils.data.TensorDataset(torch.arange(18))
    with pytest.raises(lockstep.ConfigError, match=r"holds 2 sample\(s\) \(18 samples in batches of 8\), fewer than "
                                                   r"the 4 data-parallel ranks.*drop_last=True"):
        loaders(3, 4).training(data, 8, {})
    assert len(loaders(3, 4).training(data, 8, {"drop_last": True})) == 2
    assert len(loaders(1, 2).training(data, 8, {})) == 3  # 2 rows over 2 ranks: one each


def test_a_sampler_over_numpy_indices_trains_and_evaluates_on_them():
    """``SubsetRandomSampler(np.arange(...))``, a split made with numpy: its np.int64 indices are dataset indices."""
    import numpy as np

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return 30

        def __getitem__(self, index):
            return int(index)

    def sampler():
        return torch.utils.data.SubsetRandomSampler(np.arange(0, 30, 3))

    rt = runtime()
    plain = sorted(int(i) for batch in DataLoader(Rows(), batch_size=4, sampler=sampler()) for i in batch)
    trained = rt.loader(Rows(), batch_size=4, sampler=sampler(), num_workers=0)
    assert sorted(int(i) for batch in trained for i in batch) == plain == list(range(0, 30, 3))
    evaluated = rt.eval_loader(DataLoader(Rows(), batch_size=4, sampler=sampler()), num_workers=0)
    assert [int(i) for batch in evaluated for i in batch] == list(range(0, 30, 3))  # in the listed order
    with pytest.raises(lockstep.UsageError, match=r"yielded 1\.5"):
        list(rt.loader(Rows(), batch_size=4, sampler=[0, 1.5, 2, 3], num_workers=0))


class _Opened(torch.utils.data.Dataset):
    """torch's "open the file in each worker" recipe: worker_init_fn sets the handle on the worker's dataset."""

    def __init__(self) -> None:
        self.handle = None

    def __len__(self):
        return 10

    def __getitem__(self, index):
        if self.handle is None:
            raise RuntimeError("not opened: worker_init_fn did not reach this dataset")
        return index + self.handle


def _open_in_worker(worker_id):
    torch.utils.data.get_worker_info().dataset.handle = 1000


class _Range(torch.utils.data.IterableDataset):
    def __init__(self) -> None:
        self.start, self.end = 0, 10

    def __iter__(self):
        return iter(range(self.start, self.end))


def _narrow_in_worker(worker_id):  # torch's recipe for splitting an IterableDataset over the workers
    info = torch.utils.data.get_worker_info()
    assert info.dataset.end == 10  # the stream's own attributes read as they are
    info.dataset.start = worker_id * 5


def test_worker_init_fn_sees_the_users_dataset_and_may_not_narrow_a_stream_lockstep_splits():
    rt = runtime()
    plain = [int(i) for batch in DataLoader(_Opened(), batch_size=4, num_workers=2, worker_init_fn=_open_in_worker)
             for i in batch]
    loader = rt.loader(_Opened(), batch_size=4, num_workers=2, worker_init_fn=_open_in_worker)
    assert [int(i) for batch in loader for i in batch] == plain == list(range(1000, 1010))  # before: not opened
    # before: AttributeError ('StreamShard' object has no attribute 'end'), from inside torch's worker
    stream = rt.loader(_Range(), batch_size=4, num_workers=2, worker_init_fn=_narrow_in_worker)
    with pytest.raises(lockstep.UsageError, match=r"worker_init_fn set 'start' on the stream \(_Range\).*drop data"):
        list(stream)


def test_gather_names_the_field_that_holds_one_number_per_batch():
    rt = runtime()
    outputs = [{"index": index, "loss": index.float().mean()}  # a batch's loss beside its rows
               for index, _, _ in rt.eval_loader(checks.Indexed(6), batch_size=4)]
    with pytest.raises(lockstep.ConfigError, match=r"\['loss'\]: one number per batch \(2 of them.*not one per "
                                                   r"sample \(6\)"):
        rt.gather(outputs)
    assert rt.gather([{"index": o["index"]} for o in outputs])["index"].tolist() == list(range(6))
