"""The runtime in one process: precision, validation errors, loaders, resume position."""

from __future__ import annotations

import os
import re
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lockstep
from checks import dist as checks
from lockstep import DistEnv, Runtime
from lockstep.runtime.data.options import check_batch_size
from lockstep.runtime.data.order import Arange, FixedBatches, Shuffled, split_evenly
from lockstep.runtime.data.samplers import GlobalBatchSampler, ShardSampler
from lockstep.runtime.parallel.mesh import Membership

pytestmark = pytest.mark.timeout(60)


def runtime(**kwargs) -> Runtime:
    return Runtime(accelerator="cpu", env=DistEnv(), **kwargs)


def test_16_mixed_skips_the_step_on_an_inf_gradient_and_lowers_the_scale():
    rt = runtime(precision="16-mixed", seed=0)
    model = checks.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = rt.setup(model, optimizer)
    x, y = checks.make_data(8).tensors
    before = checks.flat_weights(model).clone()
    scale = rt.precision.scaler.get_scale()
    rt.backward(F.cross_entropy(model(x), y))
    next(model.parameters()).grad[0, 0] = float("inf")
    optimizer.step()
    assert rt.step_was_skipped
    assert torch.equal(before, checks.flat_weights(model))
    assert rt.precision.scaler.get_scale() == scale / 2
    optimizer.zero_grad()
    rt.backward(F.cross_entropy(model(x), y))
    optimizer.step()
    assert not rt.step_was_skipped
    assert not torch.equal(before, checks.flat_weights(model))


def test_16_mixed_step_equals_unscaled_step():
    rt = runtime(precision="16-mixed", seed=0)
    model = checks.make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = rt.setup(model, optimizer)
    reference = checks.make_model()
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = checks.make_data(8).tensors
    rt.backward(F.cross_entropy(model(x), y))
    norm = rt.clip_grad_norm_(model, optimizer, max_norm=0.5)
    optimizer.step()
    with torch.autocast("cpu", dtype=torch.float16):
        out = reference(x)
    F.cross_entropy(out.float(), y).backward()
    ref_norm = nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    ref_optimizer.step()
    assert torch.allclose(norm, ref_norm, rtol=1e-3)
    assert torch.allclose(checks.flat_weights(model), checks.flat_weights(reference), atol=1e-5)


@pytest.mark.parametrize("together", [True, False])
def test_16_mixed_with_two_optimizers_equals_torchs_recipe_also_when_one_overflows(together):
    """torch's recipe for several optimizers: unscale each, clip, step each, update the scale once. Step 2 puts
    an inf in the first optimizer's gradients only: it skips, the second steps with gradients unscaled by the
    scale they were scaled by, and the scale halves once. Clipped together (by their total norm), or each
    optimizer's own parameters by their own norm."""
    def two():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def optimizers(model):
        return torch.optim.SGD(model[0].parameters(), lr=0.1), torch.optim.SGD(model[2].parameters(), lr=0.1)

    rt = runtime(precision="16-mixed", seed=0)
    model = two()
    model, first, second = rt.setup(model, *optimizers(model))
    reference = two()
    ref_first, ref_second = optimizers(reference)
    scaler = torch.amp.GradScaler("cpu")
    x, y = torch.randn(8, 8, generator=torch.Generator().manual_seed(1)), torch.randn(8, 4)
    for step in range(4):
        rt.backward(F.mse_loss(model(x), y))
        with torch.autocast("cpu", dtype=torch.float16):
            out = reference(x)
        scaler.scale(F.mse_loss(out.float(), y)).backward()
        if step == 2:
            for net in (lockstep.unwrap(model), reference):
                net[0].weight.grad[0, 0] = float("inf")
        scaler.unscale_(ref_first)
        scaler.unscale_(ref_second)
        if together:
            norms = [rt.clip_grad_norm_(model, [first, second], 0.5)]
            ref_norms = [nn.utils.clip_grad_norm_(reference.parameters(), 0.5)]
        else:
            norms = [rt.clip_grad_norm_(model, opt, 0.5) for opt in (first, second)]
            ref_norms = [nn.utils.clip_grad_norm_(reference[i].parameters(), 0.5) for i in (0, 2)]
        for opt, ref_opt in ((first, ref_first), (second, ref_second)):
            opt.step()
            scaler.step(ref_opt)
        scaler.update()
        assert rt.step_was_skipped == (step == 2)
        assert rt.precision.scaler.get_scale() == scaler.get_scale()
        if step != 2:
            assert all(torch.equal(a, b) for a, b in zip(norms, ref_norms, strict=True)), (norms, ref_norms)
        for opt in (first, second, ref_first, ref_second):
            opt.zero_grad()
        assert torch.equal(checks.flat_weights(model), checks.flat_weights(reference)), step


def test_16_mixed_state_loaded_between_steps_leaves_the_next_step_working():
    """The scale's update waits for the next scaled loss: loading the precision's state before it (rt.load to roll
    back) must not leave the scaler thinking the optimizer has stepped."""
    rt = runtime(precision="16-mixed", seed=0)
    model = checks.make_model()
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = checks.make_data(8).tensors
    saved = None
    for step in range(3):
        rt.backward(F.cross_entropy(model(x), y))
        rt.clip_grad_norm_(model, optimizer, 1.0)  # unscales: raises if the scaler thinks it stepped already
        optimizer.step()
        optimizer.zero_grad()
        if step == 0:
            saved = rt.precision.state_dict()
        if step == 1:
            rt.precision.load_state_dict(saved)
    assert rt.precision.scaler.get_scale() == 65536.0 and not rt.step_was_skipped


def test_bf16_mixed_outputs_float32_and_runs_under_autocast():
    rt = runtime(precision="bf16")
    model = rt.setup(nn.Linear(4, 2))
    out = model(torch.randn(3, 4))
    assert out.dtype == torch.float32
    assert next(model.parameters()).dtype == torch.float32


@pytest.mark.parametrize(("precision", "dtype"), [("64-true", torch.float64), ("bf16-true", torch.bfloat16)])
def test_true_precisions_convert_weights_and_inputs(precision, dtype):
    rt = runtime(precision=precision)
    model = rt.setup(nn.Linear(4, 2))
    assert next(model.parameters()).dtype == dtype
    assert model(torch.randn(3, 4)).dtype == dtype


def test_scheduler_works_with_the_patched_optimizer():
    rt = runtime(precision="16-mixed")
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model, optimizer = rt.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    assert isinstance(optimizer, torch.optim.SGD)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rt.backward(model(torch.randn(2, 4)).sum())
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0.5


def test_wrapped_model_keeps_names_and_checkpoint_keys():
    rt = runtime()
    model = checks.make_model()
    keys = list(model.state_dict())
    wrapped = rt.setup(model)
    assert list(wrapped.state_dict()) == keys
    wrapped.load_state_dict(model.state_dict())
    assert getattr(wrapped, "0") is model[0]  # attribute access reaches the user's module
    assert lockstep.unwrap(wrapped) is model


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"precision": "fp4"}, "unknown precision 'fp4'.*float8 \\(or the aliases .*bf16, fp32, fp16, fp8\\)"),
        ({"strategy": "horovod"}, "unknown strategy 'horovod'"),
        ({"devices": 0}, "devices=0: ask for at least one device"),
        ({"devices": [0, 1]}, "lists GPU indices but the accelerator is the CPU"),
        ({"devices": 2, "strategy": "single"}, "devices=2 asks for 2 processes, but this process was started alone"),
        ({"timeout": -1}, "timeout=-1: give a positive, finite number of seconds"),
        ({"backend": "nccl"}, "backend 'nccl'"),
        ({"strategy": "dp"}, "strategy 'dp' needs CUDA GPUs"),
        ({"deterministic": True, "benchmark": True}, "contradict"),
        # of a type that was a bare TypeError from inside, or read wrongly ("no" as debug on)
        ({"timeout": "30"}, "timeout='30': give a positive, finite number of seconds \\(or a timedelta\\)"),
        ({"timeout": float("inf")}, "timeout=inf: give a positive, finite number"),
        ({"devices": 1.5}, "devices=1.5: give a count, 'auto' or a list of GPU indices"),
        ({"devices": [0.5]}, "devices=\\[0.5\\]: give a count"),
        ({"seed": "abc"}, "seed='abc': give a whole number"),
        ({"seed": 1.5}, "seed=1.5: give a whole number"),
        ({"debug": "no"}, "debug='no': give True or False"),
    ],
)
def test_bad_arguments_say_what_to_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        rt = runtime(**kwargs)
        rt.setup(nn.Linear(1, 1))


def test_a_timedelta_timeout_is_taken_and_settings_from_the_environment_that_are_no_setting_are_refused(monkeypatch):
    import datetime

    assert runtime(timeout=datetime.timedelta(minutes=1)).timeout == 60.0
    for name, value, message in (("LOCKSTEP_TIMEOUT", "inf", "positive, finite"), ("LOCKSTEP_TIMEOUT", "nan",
                                 "positive, finite"), ("LOCKSTEP_DEBUG", "maybe", "give 1 \\(debug mode on\\)")):
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=f"{name}='{value}'.*{message}"):
            runtime()
        monkeypatch.delenv(name)


def test_trainer_arguments_of_another_kind_are_refused_or_read_as_meant(tmp_path):
    with pytest.raises(ValueError, match="callbacks holds object, which is no lockstep.Callback"):
        lockstep.Trainer(callbacks=[object()])
    with pytest.raises(ValueError, match="num_nodes=0: must be a whole number, at least 1"):
        lockstep.Trainer(num_nodes=0, max_steps=1)
    from lockstep.train.loggers import CSVLogger, make_loggers

    assert [type(logger) for logger in make_loggers("csv", tmp_path)] == [CSVLogger]  # one logger, not c, s, v


def test_a_gpu_listed_twice_means_two_processes_on_it_over_gloo():
    from lockstep.runtime.comm.process_group import choose_backend
    from lockstep.runtime.parallel.devices import parse_devices

    assert parse_devices("0,0") == (0, 0) and parse_devices([1, 1, 1]) == (1, 1, 1)
    assert parse_devices(-1) == parse_devices("-1") == "auto"  # Lightning's "every device"; before: "GPU indices"
    with pytest.raises(ValueError, match="non-negative"):
        parse_devices([0, -1])
    assert choose_backend("cuda", None) == "nccl"
    assert choose_backend("cuda", None, shares_gpu=True) == "gloo"  # NCCL refuses two ranks on one GPU
    with pytest.raises(ValueError, match="NCCL needs one GPU per rank. Use backend='gloo'"):
        choose_backend("cuda", "nccl", shares_gpu=True)
    for given in (None, "gloo"):  # torch's Gloo crashes in FSDP's collectives on CUDA tensors: refused
        with pytest.raises(ValueError, match="FSDP and the device mesh .* over Gloo on CUDA tensors"):
            choose_backend("cuda", given, shares_gpu=True, sharded=True)
    assert choose_backend("cpu", None, sharded=True) == "gloo" and choose_backend("cuda", None, sharded=True) == "nccl"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
        Runtime(accelerator="cuda", env=DistEnv())


def test_a_global_batch_is_any_positive_integer_and_anything_else_is_refused_by_name():
    assert check_batch_size(10) == 10  # on 4 ranks: 3 + 3 + 2 + 2 (tests/dist: the same weights on 3 processes)
    for bad in (0, -8, True, 8.0, "8", None):
        with pytest.raises(ValueError, match=f"batch_size={bad!r}: give the global batch size, a positive integer"):
            check_batch_size(bad)  # type: ignore[arg-type]


def test_split_evenly_covers_every_item_once():
    for total in range(0, 12):
        for parts in range(1, 5):
            pieces = [split_evenly(total, parts, p) for p in range(parts)]
            assert pieces[0][0] == 0 and pieces[-1][1] == total
            assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:], strict=False))
            assert max(b - a for a, b in pieces) - min(b - a for a, b in pieces) <= 1


def _stream(world: int, shuffle: bool = True) -> list[list[int]]:
    """The global batches of one epoch, re-assembled from every rank's share."""
    samplers = [GlobalBatchSampler(FixedBatches(Shuffled(23, 0) if shuffle else Arange(23), 8, False),
                                   Membership(r, world)) for r in range(world)]
    for sampler in samplers:
        sampler.place(0, 0)
    shares = [list(s) for s in samplers]
    return [sorted(i for r in range(world) for i in shares[r][step]) for step in range(len(shares[0]))]


def test_sample_stream_does_not_depend_on_world_size():
    assert _stream(1) == _stream(2) == _stream(4)
    assert sorted(i for batch in _stream(2) for i in batch) == list(range(23))


def test_shard_sampler_gives_contiguous_shards():
    shards = [[i for batch in ShardSampler(10, 2, r, 3) for i in batch] for r in range(3)]
    assert shards == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]


def test_loader_resumes_mid_epoch_at_the_same_batch():
    rt = runtime(seed=5)
    dataset = torch.utils.data.TensorDataset(torch.arange(50))
    loader = rt.loader(dataset, batch_size=8, shuffle=True, num_workers=0)
    full = [b[0].tolist() for b in loader] + [b[0].tolist() for b in loader]
    interrupted = rt.loader(dataset, batch_size=8, shuffle=True, num_workers=0)
    seen = []
    for i, batch in enumerate(interrupted):
        seen.append(batch[0].tolist())
        if i == 2:
            state = interrupted.state_dict()
            break
    resumed = rt.loader(dataset, batch_size=8, shuffle=True, num_workers=0)
    resumed.load_state_dict(state)
    seen += [b[0].tolist() for b in resumed] + [b[0].tolist() for b in resumed]
    assert seen == full
    assert resumed.epoch == 1


def test_loader_resume_with_another_batch_size_is_refused():
    rt = runtime()
    dataset = torch.utils.data.TensorDataset(torch.arange(10))
    loader = rt.loader(dataset, batch_size=2, num_workers=0)
    with pytest.raises(ValueError, match="same global batch size"):
        loader.load_state_dict({"epoch": 0, "batches_done": 1, "batch_size": 4})


def test_seed_everything_repeats_initial_weights():
    lockstep.seed_everything(11)
    first = nn.Linear(3, 3).weight.clone()
    lockstep.seed_everything(11)
    assert torch.equal(first, nn.Linear(3, 3).weight)


def test_single_process_collectives_are_the_identity():
    rt = runtime()
    data = {"a": torch.ones(2), "b": 3}
    assert rt.all_reduce(data) is data
    assert rt.all_gather(5) == [5]
    assert torch.equal(rt.gather([torch.ones(2), torch.zeros(1)]), torch.tensor([1.0, 1.0, 0.0]))
    rt.barrier()
    with rt.rank_zero_first():
        pass


def test_deterministic_switches_torch_to_deterministic_kernels():
    previous = torch.are_deterministic_algorithms_enabled()
    try:
        runtime(deterministic=True)
        assert torch.are_deterministic_algorithms_enabled()
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    finally:
        torch.use_deterministic_algorithms(previous)
        torch.backends.cudnn.deterministic = False


def _token_steps(rt: Runtime, divide: int | None, steps: int = 2) -> tuple[nn.Module, nn.Module]:
    """``steps`` SGD steps of 4 micro-batches of a token loss with ``num_items`` (each loss divided by
    ``divide`` when given), and the same steps hand-written: the mean over each step's tokens."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(16, 32), nn.Tanh(), nn.Linear(32, 16))
    reference = nn.Sequential(nn.Embedding(16, 32), nn.Tanh(), nn.Linear(32, 16))
    reference.load_state_dict(model.state_dict())
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    wrapped, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    generator = torch.Generator().manual_seed(0)
    for _ in range(steps):
        micro = []
        for _ in range(4):
            tokens = torch.randint(0, 16, (2, 12), generator=generator)
            labels = tokens.roll(-1, 1)
            labels[:, int(torch.randint(2, 12, (), generator=generator)):] = -100
            micro.append((tokens, labels))
            loss = F.cross_entropy(wrapped(tokens).flatten(0, 1), labels.flatten(), ignore_index=-100)
            rt.backward(loss / divide if divide else loss, num_items=(labels != -100).sum())
        optimizer.step()
        optimizer.zero_grad()
        total = sum(F.cross_entropy(reference(t).flatten(0, 1), y.flatten(), ignore_index=-100, reduction="sum")
                    for t, y in micro)
        (total / sum((y != -100).sum() for _, y in micro)).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    return model, reference


def test_accumulation_with_num_items_is_not_divided_by_the_steps_and_a_division_is_said():
    """The plain-loop habit ``loss / k`` with num_items would shrink the gradient k times: said at the first
    step (a warning: a loss may be a mean of k terms itself). Undivided, the steps equal the hand-written
    mean over each step's tokens."""
    model, reference = _token_steps(runtime(), divide=None)
    assert checks.flat_weights(model).sub(checks.flat_weights(reference)).abs().max() < 1e-6
    with pytest.warns(UserWarning, match="every loss of the first optimizer step was divided by 4, its number of "
                                         "micro-batches.*shrinks the gradient 4 times.*nothing is wrong"):
        model, reference = _token_steps(runtime(), divide=4)
    assert checks.flat_weights(model).sub(checks.flat_weights(reference)).abs().max() > 1e-3  # it was shrunk
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _token_steps(runtime(), divide=3, steps=1)  # a division by something else is the user's own business


def test_num_items_may_be_a_weight_sum_below_one_and_keeps_a_float64_losss_precision():
    """A weighted mean told its weight sum as num_items (fractional, below 1 over the whole step): the
    step's gradient is that of the weighted mean over the global batch, to float64 precision."""
    rt = runtime(precision="64-true")
    torch.manual_seed(0)
    model = nn.Linear(3, 1).double()
    reference = nn.Linear(3, 1).double()
    reference.load_state_dict(model.state_dict())
    wrapped, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.5))
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    x, y = torch.randn(16, 3, dtype=torch.float64), torch.randn(16, 1, dtype=torch.float64)
    weights = torch.linspace(1, 2, 16, dtype=torch.float64) * 0.01 / 3  # a step's sum: 0.04 (and not a float32)
    for rows in (slice(0, 8), slice(8, 16)):
        for half in (slice(rows.start, rows.start + 4), slice(rows.start + 4, rows.stop)):  # two micro-batches
            w = weights[half]
            rt.backward((w * (wrapped(x[half]) - y[half]).square().squeeze(1)).sum() / w.sum(), num_items=w.sum())
        optimizer.step()
        optimizer.zero_grad()
        w = weights[rows]
        ((w * (reference(x[rows]) - y[rows]).square().squeeze(1)).sum() / w.sum()).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    assert checks.flat_weights(model).sub(checks.flat_weights(reference)).abs().max() < 1e-12


def test_num_items_normalises_over_the_step_and_refuses_a_mix_within_one_step():
    rt = runtime()
    model = torch.nn.Linear(3, 1, bias=False)
    torch.nn.init.ones_(model.weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model, optimizer = rt.setup(model, optimizer)
    x = torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 0.0, 4.0]])
    # Two micro-batches, means over 1 and 2 items: the step's gradient is that of the sum over 3 items / 3.
    rt.backward(model(x[:1]).sum(), num_items=1)
    rt.backward(model(x[1:]).sum() / 2, num_items=torch.tensor(2))
    optimizer.step()
    assert torch.allclose(model.weight, 1 - torch.tensor([[1.0, 2.0, 4.0]]) / 3)
    optimizer.zero_grad()
    rt.backward(model(x).sum(), num_items=3)
    with pytest.raises(ValueError, match="num_items for some micro-batches"):
        rt.backward(model(x).sum())


def test_num_items_without_an_optimizer_given_to_setup_is_refused():
    """The division by the step's items happens in the step of an optimizer rt.setup returned: one built after
    setup and never given to it would step on gradients still multiplied by num_items (1.25 times the
    mean's, here), so the backward says so."""
    rt = runtime()
    model = rt.setup(torch.nn.Linear(3, 1))
    torch.optim.SGD(model.parameters(), lr=1.0)  # built after setup: lockstep never sees it
    with pytest.raises(lockstep.ConfigError, match="no optimizer was given to rt.setup"):
        rt.backward(model(torch.ones(2, 3)).sum(), num_items=2)


def test_every_error_lockstep_raises_on_purpose_is_a_lockstep_error_and_keeps_its_standard_base():
    """No ``raise`` in lockstep's source names a built-in exception type: each is one of lockstep.errors,
    so ``except lockstep.LockstepError`` catches every refusal, and ``except ValueError`` still does."""
    import ast
    import builtins
    from pathlib import Path

    import lockstep
    from lockstep.runtime.parallel.mesh import MeshLayout
    from lockstep.runtime.parallel.precision import make_precision
    from lockstep.runtime.parallel.strategy import make_strategy

    built_in = {name for name in dir(builtins) if isinstance(getattr(builtins, name), type)
                and issubclass(getattr(builtins, name), BaseException)} - {"SystemExit", "KeyboardInterrupt"}
    plain = []
    for path in Path(lockstep.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            raised = node.exc if isinstance(node, ast.Raise) else None
            target = raised.func if isinstance(raised, ast.Call) else raised
            if isinstance(target, ast.Name) and target.id in built_in:
                plain.append(f"{path.name}:{node.lineno} raises {target.id}")
    # a module's __getattr__ (lazy names) must raise AttributeError: Python's protocol
    assert [p for p in plain if not p.startswith("_lazy.py:")] == [], plain
    for refused in (lambda: make_strategy("zero3", 2), lambda: MeshLayout.for_world(6, tp=4),
                    lambda: make_strategy("ddp", 6, lockstep.Parallel(tp=4)), lambda: lockstep.FSDP(tp=2),
                    lambda: make_precision("bf17", torch.device("cpu")),
                    lambda: lockstep.Runtime(accelerator="cpu", env=lockstep.DistEnv()).loader(
                        torch.utils.data.TensorDataset(torch.zeros(0, 1)), batch_size=2)):
        with pytest.raises(lockstep.LockstepError) as caught:
            refused()
        assert isinstance(caught.value, ValueError) and isinstance(caught.value, lockstep.ConfigError)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_change_of_membership_between_two_steps_re_splits_the_next_global_batch_over_the_new_members(workers):
    """Three replicas; one leaves after step 1 and comes back (with a live one's loader position) after
    step 3: at every step the union of the live members' batches is that step's global batch (each
    sample once), as on one process, without rebuilding a Runtime or a loader. With DataLoader workers,
    which drew batches ahead under the old membership, too."""
    data = torch.utils.data.TensorDataset(torch.arange(60))
    one = Runtime(accelerator="cpu", seed=5, env=DistEnv())
    reference = [sorted(x.tolist()) for (x,) in one.loader(data, batch_size=12, shuffle=True)]
    one.close()
    members = [Runtime(accelerator="cpu", seed=5, env=DistEnv()) for _ in range(3)]
    loaders = [rt.loader(data, batch_size=12, shuffle=True, num_workers=workers) for rt in members]
    batches = [iter(loader) for loader in loaders]
    plan = [(0, 1, 2), (0, 1, 2), (0, 2), (0, 2), (0, 1, 2)]  # the live replicas of each step
    for step, live in enumerate(plan):
        if step and set(live) - set(plan[step - 1]):  # back: it takes the position of a live replica
            loaders[1].load_state_dict(loaders[0].state_dict())
            batches[1] = iter(loaders[1])
        for place, replica in enumerate(live):
            members[replica].membership.change(place, len(live))
        shares = [next(batches[replica])[0].tolist() for replica in live]
        assert sorted(i for share in shares for i in share) == reference[step]
        assert max(map(len, shares)) - min(map(len, shares)) <= 1  # split evenly over the live ones
    for rt in members:
        rt.close()


def test_a_report_that_waits_for_heartbeats_is_cut_short_by_the_launchers_term_not_lost():
    """A launcher stops every rank with TERM once one has left; the rank writing the job's report then
    gives it at once (without the heartbeats it waited for) instead of dying mid-report."""
    import signal
    import threading

    from lockstep.runtime.faults.watchdog import _sleep_unless_stopped

    before = signal.getsignal(signal.SIGTERM)
    start = time.monotonic()
    assert _sleep_unless_stopped(0.05)
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGTERM)).start()
    assert not _sleep_unless_stopped(20)
    assert time.monotonic() - start < 5
    assert signal.getsignal(signal.SIGTERM) is before


def test_statistics_that_each_rank_moves_with_its_own_rows_are_batchnorms_not_syncbatchnorms():
    from lockstep.runtime.parallel.wrappers import tracks_statistics

    assert tracks_statistics(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)))
    assert not tracks_statistics(nn.Sequential(nn.Linear(2, 2), nn.SyncBatchNorm(2)))
    assert not tracks_statistics(nn.BatchNorm1d(2, track_running_stats=False))


def test_a_backward_after_an_eval_mode_forward_on_an_eval_loader_batch_under_grad_mode_is_refused():
    """Such a forward runs without the data-parallel wrapper (the ranks' evaluation shards differ in length),
    so its gradients would not be averaged: rt.backward says so instead of training on them."""
    rt = lockstep.Runtime(accelerator="cpu", seed=0)
    model = rt.setup(torch.nn.Linear(3, 1))
    data = torch.utils.data.TensorDataset(torch.randn(8, 3), torch.randn(8, 1))
    model.eval()
    for x, y in rt.eval_loader(data, batch_size=4, num_workers=0):
        loss = torch.nn.functional.mse_loss(model(x), y)
        with pytest.raises(lockstep.UsageError, match="rt.backward after a forward on a batch of rt.eval_loader"):
            rt.backward(loss)
        break
    model.train()  # in train mode the same batch goes through the wrapper, and trains
    for x, y in rt.eval_loader(data, batch_size=4, num_workers=0):
        rt.backward(torch.nn.functional.mse_loss(model(x), y))
        break
    rt.close()


def test_ddps_model_no_sync_on_the_set_up_model_names_locksteps_spelling():
    rt = runtime()
    model = rt.setup(torch.nn.Linear(2, 2))
    with pytest.raises(lockstep.UsageError, match=r"write `with rt.no_sync\(model\):`"):
        with model.no_sync():
            pass
    with rt.no_sync(model):  # the spelling it names works
        rt.backward(model(torch.ones(1, 2)).sum())


@pytest.mark.parametrize("precision, waits_for", [("32-true", "division by the step's num_items"),
                                                   ("16-mixed", "unscaling (16-mixed)")])
def test_torchs_clip_grad_norm_before_lockstep_finished_the_gradients_is_refused_naming_rt_clip(precision, waits_for):
    """A port's torch.nn.utils.clip_grad_norm_ would read gradients not yet divided by the step's items (or still
    scaled): 0.22 off in a user's trial, on one process. Refused, naming rt.clip_grad_norm_; fine elsewhere."""
    rt = runtime(precision=precision)
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(4, 3)
    items = 4 if precision == "32-true" else None
    rt.backward(model(x).square().mean(), num_items=items)
    with pytest.raises(lockstep.UsageError, match=f"before lockstep finished them \\(their {re.escape(waits_for)}\\).*"
                                                  r"rt.clip_grad_norm_\(model, optimizer, max_norm\)"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
    reference = torch.nn.Linear(3, 2)  # another model's parameters, meanwhile: torch's own clip
    reference(x).square().mean().backward()
    assert torch.isfinite(torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01))
    norm = rt.clip_grad_norm_(model, optimizer, 0.01)  # the spelling it names (which calls torch's itself)
    assert torch.isfinite(norm)
    optimizer.step()
    optimizer.zero_grad()
    rt.backward(model(x).square().mean())  # no items, 32-true: final at once, torch's own clip reads them
    if precision == "32-true":
        by_hand = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in model.parameters()]))
        assert torch.isclose(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01), by_hand)


@pytest.mark.parametrize("kind", ["SGD", "LBFGS"])
def test_an_optimizer_stepped_with_a_closure_gets_gradients_divided_by_the_closures_num_items(kind):
    """The closure runs the backward inside the step (LBFGS: several times): its num_items division comes
    before the optimizer reads the gradients. Before, SGD stepped on the undivided sum (2.7e-2 off)."""
    torch.manual_seed(0)
    x, labels = torch.randn(6, 4), torch.tensor([0, 1, 2, -100, 1, -100])

    def run(with_runtime: bool) -> torch.Tensor:
        torch.manual_seed(1)
        model = nn.Linear(4, 3)
        make = torch.optim.SGD if kind == "SGD" else torch.optim.LBFGS
        optimizer = make(model.parameters(), lr=0.5, **({"max_iter": 3} if kind == "LBFGS" else {}))
        rt = lockstep.Runtime(accelerator="cpu") if with_runtime else None
        if rt is not None:
            model, optimizer = rt.setup(model, optimizer)

        def closure():
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), labels, ignore_index=-100)  # the mean over the 4 labelled rows
            if rt is None:
                loss.backward()
            else:
                rt.backward(loss, num_items=(labels != -100).sum())
            return loss

        for _ in range(3):
            optimizer.step(closure)
        return torch.cat([p.detach().flatten() for p in lockstep.unwrap(model).parameters()])

    assert torch.allclose(run(True), run(False), atol=1e-6)


def test_a_rank_position_read_from_the_store_is_shown_bounded_and_printable():
    """What another rank (or anyone who reaches the store) wrote is quoted by hang reports: at most 1,000
    printable characters (a 2 MB value with terminal escapes once became the error's text whole)."""
    from lockstep.runtime.faults.watchdog import Watchdog

    class Store:
        values = {"lockstep/where/0": b"forward #3 at train.py:12 in main\nin training_step",
                  "lockstep/where/1": b"\x1b[2Jended the script " + b"x" * 2_000_000}

        def check(self, keys):
            return keys[0] in self.values

        def get(self, key):
            return self.values[key]

    watchdog = Watchdog(0, 3, 30.0, False)
    watchdog.store = Store()
    found = watchdog.positions()
    assert found[0] == "forward #3 at train.py:12 in main\nin training_step" and 2 not in found
    assert found[1].startswith("[2Jended the script xx") and len(found[1]) == 1003


def test_a_strategy_named_in_capitals_self_launches_as_the_lower_case_name(monkeypatch):
    """Every other place reads strategy names without case; self-launch refused "DDP" ("started alone")."""
    import lockstep.runtime.launch.elastic as elastic
    from lockstep.runtime import RuntimeConfig
    from lockstep.runtime.runtime import launch_workers_if_asked

    asked: list[int] = []
    monkeypatch.setattr(elastic, "self_launch", asked.append)
    alone = lockstep.DistEnv.from_environ({}, argv=[])
    for name in ("ddp", "DDP", "Fsdp"):
        launch_workers_if_asked(RuntimeConfig(accelerator="cpu", devices=2, strategy=name).resolved(), alone)
    assert asked == [2, 2, 2]
