"""Real ranks over Gloo on loopback, compared with single-process and plain-PyTorch references."""

from __future__ import annotations

import pytest
import torch

from checks import dist as checks
from lockstep import DistEnv, Runtime
from lockstep.testing import run_ranks

pytestmark = pytest.mark.timeout(180)


def single_process_runtime(**kwargs) -> Runtime:
    return Runtime(accelerator="cpu", env=DistEnv(), **kwargs)


def _single_process_evaluation():
    rt = single_process_runtime(seed=0)
    model = rt.setup(checks.make_model())
    model.eval()
    with torch.no_grad():
        return model(checks.make_data(1001).tensors[0])


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_runtime_ddp_equals_hand_written_ddp(world, precision):
    errors = run_ranks(checks.parity_with_plain_ddp, world, precision)
    assert max(errors) <= 1e-6, errors


def test_same_weights_on_1_2_3_and_4_processes():
    # 103 samples, global batch 16: the last batch (7) splits 4+3 and 2+2+2+1; on 3 processes, which do
    # not divide 16, every batch splits 6+5+5 and the last 3+2+2.
    reference = checks.train_lockstep(single_process_runtime(seed=0), checks.make_data(103), 16, 2, True)
    for world in (2, 3, 4):
        weights = run_ranks(checks.world_size_invariance, world)
        for rank_weights in weights:
            assert torch.allclose(rank_weights, reference, atol=1e-5, rtol=0), world


@pytest.mark.parametrize("world, batch", [(2, 20), (3, 30), (4, 40), (3, 10)])  # 10 on 3: 4 rows a rank
def test_gathered_evaluation_is_exact_and_in_dataset_order(world, batch):
    expected = _single_process_evaluation()
    results = run_ranks(checks.gathered_evaluation, world, batch)
    for result in results:
        assert result["outputs"].shape == (1001, 4)
        assert torch.equal(result["indices"], torch.arange(1001))
        assert torch.allclose(result["outputs"], expected, atol=1e-6)
    if world == 4:  # 251 + 250 + 250 + 250 rows in batches of 10: rank 0 has one batch more
        assert results[0]["batches"] == [26, 25, 25, 25]
    if batch == 10:  # 334 + 334 + 333 rows in batches of 4 (10 / 3 rounded up)
        assert results[0]["batches"] == [84, 84, 84]


def test_gather_when_a_rank_has_no_rows():
    def few_rows():
        rt = Runtime(accelerator="cpu")
        dataset = torch.utils.data.TensorDataset(torch.arange(2))
        rows = [batch[0] for batch in rt.eval_loader(dataset, batch_size=3, num_workers=0)]
        return rt.gather(rows)

    for gathered in run_ranks(few_rows, 3):
        assert torch.equal(gathered, torch.arange(2))


def test_16_mixed_skips_step_on_inf_gradient_on_every_rank():
    for result in run_ranks(checks.inf_gradient_skips_step, 2):
        assert result == {"skipped": True, "unchanged": True, "then_stepped": True, "then_changed": True}


def test_accumulation_all_reduces_once_with_the_full_batch_gradient():
    for result in run_ranks(checks.accumulation_skips_allreduce, 2):
        assert result["allreduce_calls"] == result["buckets"] >= 1
        assert result["grad_error"] < 1e-6


def test_rank_zero_goes_first(tmp_path):
    orders = run_ranks(checks.rank_zero_goes_first, 3, str(tmp_path / "order.txt"))
    assert orders[0][0] == "0" and sorted(orders[0]) == ["0", "1", "2"]


def test_existing_dataloader_is_recreated_with_its_collate_fn():
    for result in run_ranks(checks.dataloader_is_recreated, 2):
        # global batch 8 over 2 ranks: 5 steps of 4 rows each, through the user's collate_fn
        assert result == {"collate_calls": 5, "rows": 20, "local_rows": [4] * 5}


def test_collectives_on_nested_data():
    def collect():
        rt = Runtime(accelerator="cpu")
        r = rt.rank
        return {
            "sum": rt.all_reduce({"n": r + 1, "t": torch.tensor([r, 1.0]), "s": "kept"}, op="sum"),
            "mean": rt.all_reduce(r, op="mean"),
            "max": rt.all_reduce(torch.tensor(r), op="max"),
            "min": rt.all_reduce([float(r)], op="min"),
            "gather": rt.all_gather((r, torch.ones(r + 1))),
            "bcast": rt.broadcast({"from": r}, src=2),
            "rows": rt.gather({"x": torch.full((r,), r), "names": [f"s{r}"] * r}),
        }

    for out in run_ranks(collect, 3):
        assert out["sum"]["n"] == 6 and out["sum"]["s"] == "kept"
        assert torch.equal(out["sum"]["t"], torch.tensor([3.0, 3.0]))
        assert out["mean"] == 1.0 and int(out["max"]) == 2 and out["min"] == [0.0]
        assert [g[0] for g in out["gather"]] == [0, 1, 2]
        assert [len(g[1]) for g in out["gather"]] == [1, 2, 3]
        assert out["bcast"] == {"from": 2}
        assert torch.equal(out["rows"]["x"], torch.tensor([1, 2, 2]))
        assert out["rows"]["names"] == ["s1", "s2", "s2"]


def test_devices_disagreeing_with_the_launcher_is_an_error():
    def wrong_devices():
        try:
            Runtime(accelerator="cpu", devices=4)
        except ValueError as error:
            return str(error)
        return "no error"

    for message in run_ranks(wrong_devices, 2):
        assert "devices=4 asks for 4 processes per node" in message
        assert "started 2 on this node" in message


def test_a_later_runtime_in_the_process_takes_over_the_heartbeat_and_an_earlier_ones_close_leaves_no_end():
    def several_runtimes():
        import threading
        import time

        from lockstep.runtime._torch_compat import default_store

        first = Runtime(accelerator="cpu", timeout=5)  # a heartbeat every 0.5 s
        later = [Runtime(accelerator="cpu", timeout=5) for _ in range(4)]
        last = later[-1]
        last.barrier()
        last.mark("in_the_last_runtime")
        first.close()  # an earlier Runtime closed while a later one is in use: the rank has not left
        time.sleep(1.5)  # a few heartbeats of the last Runtime
        store = default_store()
        outcome = {"beating": [t.name for t in threading.enumerate() if t.name == "lockstep-heartbeat"],
                   "alive": store.get(f"lockstep/alive/{last.rank}").decode(),
                   "where": store.get(f"lockstep/where/{last.rank}").decode()}
        last.barrier()
        return outcome

    for outcome in run_ranks(several_runtimes, 2):
        assert outcome["beating"] == ["lockstep-heartbeat"], outcome  # one thread, not five
        assert "in in_the_last_runtime" in outcome["alive"], outcome
        assert "ended the script" not in outcome["where"], outcome


def test_print_on_rank_zero_only_and_rank_prefixed_logs():
    def talk():
        import contextlib
        import io
        import logging

        rt = Runtime(accelerator="cpu")
        printed, logged = io.StringIO(), io.StringIO()
        handler = logging.StreamHandler(logged)
        logging.getLogger("lockstep").addHandler(handler)
        logging.getLogger("lockstep").setLevel(logging.INFO)
        with contextlib.redirect_stdout(printed):
            rt.print("hello")
        rt.log.info("step done")
        return printed.getvalue(), logged.getvalue()

    outputs = run_ranks(talk, 2)
    assert outputs[0] == ("hello\n", "[rank 0] step done\n")
    assert outputs[1] == ("", "[rank 1] step done\n")


def test_ddp_options_reach_distributed_data_parallel():
    def configured():
        import lockstep

        rt = Runtime(accelerator="cpu", strategy=lockstep.DDP(static_graph=True, find_unused_parameters=True,
                                                               gradient_as_bucket_view=True))
        ddp = rt.setup(torch.nn.Linear(3, 4)).forward_module
        try:
            Runtime(accelerator="cpu", strategy=lockstep.DDP(sync_batchnorm=True)).setup(torch.nn.BatchNorm1d(4))
        except ValueError as error:
            message = str(error)
        is_ddp = isinstance(ddp, torch.nn.parallel.DistributedDataParallel)
        return is_ddp, ddp.static_graph, ddp.find_unused_parameters, ddp.gradient_as_bucket_view, message

    for is_ddp, static, unused, bucket_view, message in run_ranks(configured, 2):
        assert (is_ddp, static, unused, bucket_view) == (True, True, True, True)
        assert "sync_batchnorm=True needs CUDA devices" in message


def test_tcp_init_method():
    from lockstep.runtime.comm.network import free_port

    def over_tcp(port):
        torch.distributed.destroy_process_group()  # drop the harness's group, make our own
        rt = Runtime(accelerator="cpu", init_method=f"tcp://127.0.0.1:{port}")
        return rt.all_reduce(rt.rank + 1, op="sum")

    assert run_ranks(over_tcp, 2, free_port()) == [3, 3]


def _unseeded_draws() -> list[float]:
    import random

    import numpy

    return [torch.initial_seed(), float(torch.rand(())), float(numpy.random.rand()), random.random()]


def test_ranks_that_seed_nothing_draw_differently_as_new_interpreters_do():
    """lockstep.launch's ranks are forked from a server that imported torch: each draws its own seeds anew
    (torch's, numpy's, Python's), as the processes of torch.multiprocessing.spawn or torchrun do."""
    first, second = run_ranks(_unseeded_draws, 2)
    assert all(a != b for a, b in zip(first, second, strict=True)), (first, second)


def test_per_sample_rng_gives_each_sample_the_same_augmentation_on_any_world_size_and_workers():
    torch.manual_seed(11)
    untouched = float(torch.rand(()))
    results = {(world, workers): run_ranks(checks.per_sample_draws, world, workers)
               for world, workers in [(1, 0), (2, 0), (2, 2)]}
    reference = results[(1, 0)][0]["epochs"]
    assert [len(epoch) for epoch in reference] == [24, 24]
    assert reference[0] != reference[1]  # keyed by the epoch too
    for key, ranks in results.items():
        for result in ranks:
            assert result["epochs"] == reference, key
    assert results[(1, 0)][0]["after"] == untouched  # the main process's generators are restored after each item


@pytest.mark.parametrize("n", [3, 10])
def test_gather_merges_per_batch_dicts_and_namedtuples_even_from_ranks_without_batches(n):
    results = run_ranks(checks.merged_gather, 4, n)
    assert [r["batches"] for r in results] == ([1, 1, 1, 0] if n == 3 else [3, 3, 2, 2])
    for result in results:
        assert set(result["dicts"]) == {"index", "square"}
        assert result["dicts"]["index"].tolist() == list(range(n))
        assert result["dicts"]["square"].tolist() == [i * i for i in range(n)]
        assert isinstance(result["pairs"], checks.Doubled)
        assert result["pairs"].doubled.tolist() == [2 * i for i in range(n)]



def test_a_parameter_without_gradient_under_ddp_is_one_line_naming_it_and_the_option():
    """torch's own error is about 100 lines and names parameter indices; lockstep's is one line."""
    for message in run_ranks(checks.unused_parameter_steps, 2):
        assert "spare.weight, spare.bias" in message and "find_unused_parameters=True" in message, message
        assert "\n" not in message and "used.weight" not in message, message


def test_a_plain_loss_backward_before_a_step_on_an_unevenly_split_batch_is_said_once():
    """loss.backward() kept from a ported script: right while the ranks hold as many rows, not on the short
    last batch (2 rows against 1), where it is said once; rt.backward (with or without clipping) says nothing."""
    assert run_ranks(checks.plain_backward_warnings, 2, False) == [1, 1]
    assert run_ranks(checks.plain_backward_warnings, 2, True) == [0, 0]
    assert run_ranks(checks.plain_backward_warnings, 2, True, True) == [0, 0]
    assert run_ranks(checks.plain_backward_warnings, 2, True, True, 2) == [0, 0]  # two optimizers, one backward
