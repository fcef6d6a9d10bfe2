"""lockstep's Trainer against torchtitan, on torchtitan's own Llama 3: tokens/s, MFU and peak memory, one GPU,
in alternating rounds.

Both sides train the same model definition, torchtitan's ``Transformer`` (``torchtitan.models.llama3``),
shaped as Llama 3.2 1B (16 layers, width 2048, 32 heads, 8 KV heads, MLP 8192, vocabulary 128256, an
untied output layer: 1.50 B parameters), on the same random tokens (a fixed seed, no tokenizer or data
set), batch, sequence length, AdamW (fused on CUDA, lr 3e-4), gradient clipping at 1.0 (torchtitan's
default) and bf16:

- **torchtitan**: its own ``parallelize_llama`` (activation checkpointing, per-block ``torch.compile``
  and, with several GPUs, FSDP2, as its trainer applies them), its float8 model converter, its weight
  initialisation, bf16 autocast (what torchtitan uses on one GPU, where it applies no FSDP), its loss
  (cross-entropy on float32 logits, compiled with the model) and a plain loop;
- **lockstep**: ``lockstep.Trainer(compile=..., activation_checkpointing=..., precision="bf16-mixed" or
  "float8", gradient_clip_val=1.0)`` on a ``lockstep.Module`` holding the same ``Transformer``, its
  ``training_step`` calling the same loss (``torch.compile``-d in the compiled modes, as torchtitan does).

Modes: ``eager``, ``compile``, ``compile+ac`` (full activation checkpointing), ``compile+ac+float8``
(torchao's float8 linears, compute capability 8.9+). Each (side, mode) runs in a fresh process, so that
its peak memory is its own; a round runs every mode on both sides, the side that goes first alternating
from round to round. Reported per mode: the median tokens/s of each side over the rounds (with the
rounds' range), lockstep's ratio to torchtitan paired by round, the MFU by torchtitan's formula
(``6 (N - N_embedding) + 12 L d T`` FLOPs per token over the device's dense bf16 peak) on each side, the
MFU the Trainer logged and its ratio to the formula's, and ``torch.cuda.max_memory_allocated``.

torchtitan version: 0.2.2 (PyPI, 2026-02-20), the release developed against torch 2.11's line; 0.3.0
came later, for newer torch, and needs packages (``spmd_types``, ``torch_checkpointing``, ``grain``)
that 0.2.2 does not. Only its model, parallelize, config, model-converter and distributed modules are
imported, without its package ``__init__`` files (which import every model and its trainer's parts);
its model module still imports its train-spec protocol, and with it ``tokenizers``, ``torchdata``,
``tensorboard`` and ``datasets`` (with ``pyarrow`` and ``pandas``). ``benchmarks/gpu/wheels.sh`` downloads
these wheels and ``tyro``'s for the GPU machine; ``triton`` comes with every CUDA build of torch (torchtitan's
MoE kernels import it).

    python benchmarks/gpu/torchtitan_side_by_side.py [--modes compile,compile+ac] [--rounds 2] [--steps 20]
    python benchmarks/gpu/torchtitan_side_by_side.py --tiny   # a 2-layer model on the CPU: checks it runs
    python benchmarks/gpu/torchtitan_side_by_side.py --modes compile --rounds 1 --trace FOLDER
        # each child also traces its first 3 timed steps with torch.profiler (left out of its tokens/s): the
        # op tables by device and CPU time, the device's busy fraction, the Chrome trace, in FOLDER
    ... --results benchmarks/gpu/results.json   # the table into the results file, beside the other benchmarks
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import statistics
import sys
import types
from typing import Any

import torch
import torch.nn.functional as F

import lockstep

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llama import Clock, Watch, data  # noqa: E402  (benchmarks/gpu/llama.py: the same clock and data)
from rounds import measured, median, record, report, spread  # noqa: E402

MODES = ("eager", "compile", "compile+ac", "compile+ac+float8")
SIDES = ("torchtitan", "lockstep")
SIZES = {  # dim, layers, heads, kv heads, vocabulary (the MLP: 8192 for 1b from torchtitan's rounding)
    "1b": (2048, 16, 32, 8, 128256),
    "tiny": (64, 2, 4, 2, 512),
}


def import_torchtitan(where: str | None) -> types.SimpleNamespace:
    """torchtitan's Llama 3 model, its parallelize function, its job config, its parallel dimensions and its
    model converters. ``where``: the folder holding the ``torchtitan`` package (default: the installed one).
    The packages on the way are registered bare, so their ``__init__`` files (which import torchtitan's data
    pipeline and every model) do not run."""
    if where is None:
        spec = importlib.util.find_spec("torchtitan")
        if spec is None or spec.origin is None:
            raise SystemExit("torchtitan is not installed: pip install --no-deps torchtitan==0.2.2 tyro "
                             "docstring_parser typeguard, or give --torchtitan FOLDER.")
        where = os.path.dirname(os.path.dirname(spec.origin))
    for name in ("torchtitan", "torchtitan.models", "torchtitan.models.llama3"):
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [os.path.join(where, *name.split("."))]
            sys.modules[name] = package
    load = importlib.import_module
    model, config = load("torchtitan.models.llama3.model.model"), load("torchtitan.config")
    return types.SimpleNamespace(
        Transformer=model.Transformer, ModelArgs=load("torchtitan.models.llama3.model.args").TransformerModelArgs,
        parallelize=load("torchtitan.models.llama3.infra.parallelize").parallelize_llama, JobConfig=config.JobConfig,
        ParallelDims=load("torchtitan.distributed").ParallelDims,
        converters=load("torchtitan.protocols.model_converter").build_model_converters,
        register_float8=lambda: load("torchtitan.components.quantization"))


def model_args(tt: types.SimpleNamespace, size: str, seq: int) -> Any:
    dim, layers, heads, kv_heads, vocab = SIZES[size]
    return tt.ModelArgs(dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads, vocab_size=vocab,
                        multiple_of=256, ffn_dim_multiplier=1.5, rope_theta=500000, max_seq_len=seq)


def formula_flops_per_token(model: torch.nn.Module, seq: int) -> float:
    """torchtitan's count: 6 (N - N_embedding) + 12 L d T (attention's QK^T and AV, forward and backward)."""
    params = sum(p.numel() for p in model.parameters())
    embedding = model.tok_embeddings.weight.numel()
    args = model.model_args
    return 6 * (params - embedding) + 12 * args.n_layers * args.dim * seq


def cross_entropy(pred: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """torchtitan's loss: the mean cross-entropy over float32 logits."""
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1))


def run_torchtitan(args: argparse.Namespace, device: str) -> tuple[Clock, list[float], torch.nn.Module]:
    tt = import_torchtitan(args.torchtitan)
    job = tt.JobConfig()
    job.training.seq_len = args.seq
    job.compile.enable = "compile" in args.mode
    job.activation_checkpoint.mode = "full" if "+ac" in args.mode else "none"
    if "float8" in args.mode:
        tt.register_float8()
        job.model.converters = ["quantize.linear.float8"]
    dims = tt.ParallelDims(dp_replicate=1, dp_shard=-1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    with torch.device("meta"):
        model = tt.Transformer(model_args(tt, args.size, args.seq))
    tt.converters(job, dims).convert(model)
    tt.parallelize(model, dims, job)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=device == "cuda")
    loss_fn = torch.compile(cross_entropy) if job.compile.enable else cross_entropy
    clock = traced_clock(args, device)
    clock.tick()
    loader = torch.utils.data.DataLoader(data(args.warmup + args.steps, args.batch, args.seq, SIZES[args.size][4]),
                                         batch_size=args.batch, pin_memory=device == "cuda", num_workers=2)
    for (tokens,) in loader:
        tokens = tokens.to(device, non_blocking=True)
        with torch.autocast(device, dtype=torch.bfloat16):  # torchtitan's maybe_enable_amp without FSDP
            loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.tick()
    return clock, [], model


class TitanLM(lockstep.Module):
    """torchtitan's Transformer in a lockstep Module: the same loss (compiled where torchtitan compiles it),
    the same optimizer."""

    def __init__(self, model: torch.nn.Module, device: str, compile_loss: bool) -> None:
        super().__init__()
        self.model, self.device_type = model, device
        self.loss_fn = torch.compile(cross_entropy) if compile_loss else cross_entropy

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens = batch[0]
        return self.loss_fn(self.model(tokens[:, :-1]), tokens[:, 1:])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=3e-4, fused=self.device_type == "cuda")


def run_lockstep(args: argparse.Namespace, device: str) -> tuple[Clock, list[float], torch.nn.Module]:
    tt = import_torchtitan(args.torchtitan)
    with torch.device(device):
        model = tt.Transformer(model_args(tt, args.size, args.seq))
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    clock = traced_clock(args, device)
    watch = Watch(clock)
    trainer = lockstep.Trainer(accelerator=device, precision="float8" if "float8" in args.mode else "bf16-mixed",
                               compile="compile" in args.mode,
                               activation_checkpointing="full" if "+ac" in args.mode else None,
                               gradient_clip_val=1.0, max_epochs=1, seed=0, log_every_n_steps=2 if args.tiny else 5,
                               loggers=(), enable_progress_bar=False, num_workers=2, callbacks=[watch],
                               log_dir=args.log_dir)
    tokens = data(args.warmup + args.steps, args.batch, args.seq, SIZES[args.size][4])
    trainer.fit(TitanLM(model, device, "compile" in args.mode), tokens, batch_size=args.batch)
    return clock, watch.mfu, model


TRACED_STEPS = 3


def traced_clock(args: argparse.Namespace, device: str) -> Clock:
    """The step clock; with ``--trace FOLDER``, with a ``torch.profiler`` over its first 3 timed steps, written
    there by ``write_trace``."""
    if not args.trace:
        return Clock(device, args.warmup)
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    return Clock(device, args.warmup, profile(activities=activities), TRACED_STEPS)


def write_trace(args: argparse.Namespace, clock: Clock) -> dict[str, Any]:
    """The trace's table (ops by their own device time, then CPU time) and its Chrome trace, in ``--trace``;
    returns the device's busy fraction over the traced steps (kernel time over the steps' wall time)."""
    profiler = clock.profiler
    os.makedirs(args.trace, exist_ok=True)
    stem = os.path.join(args.trace, f"{args.side}_{args.mode}")
    from torch.autograd import DeviceType

    # the device's own events (kernels, copies), as torch's table totals them: not also the CPU ops that
    # launched them, nor the annotations
    device_s = sum(e.self_device_time_total for e in profiler.events()
                   if e.device_type == DeviceType.CUDA and not e.is_user_annotation) / 1e6
    traced_s = sum(clock.steps[:TRACED_STEPS])
    busy = device_s / traced_s if traced_s else None
    with open(stem + ".txt", "w") as out:
        out.write(f"{args.side} {args.mode}: {TRACED_STEPS} steps traced, {traced_s * 1e3:.1f} ms of wall time, "
                  f"{device_s * 1e3:.1f} ms of device time in kernels and copies (busy {busy})\n\n")
        for key in ("self_device_time_total", "self_cpu_time_total"):
            out.write(profiler.key_averages().table(sort_by=key, row_limit=30) + "\n")
    profiler.export_chrome_trace(stem + ".json")
    return {"device_busy": busy}


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """One side and mode in this process: its measurements."""
    from lockstep.train.flops import peak_flops

    device = "cuda" if torch.cuda.is_available() else "cpu"
    clock, trainer_mfu, model = (run_torchtitan if args.side == "torchtitan" else run_lockstep)(args, device)
    timed = clock.steps[TRACED_STEPS:] if args.trace else clock.steps  # the traced steps ran slower
    tokens_per_s = args.batch * args.seq / statistics.median(timed)
    peak = peak_flops(torch.device(device), "bf16-mixed")
    traced = write_trace(args, clock) if args.trace else {}
    return {"side": args.side, "mode": args.mode, "tokens_per_s": tokens_per_s, **traced,
            "formula_mfu": tokens_per_s * formula_flops_per_token(model, args.seq) / peak if peak else None,
            "trainer_mfu": statistics.median(trainer_mfu) if trainer_mfu else None,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None,
            "params": sum(p.numel() for p in model.parameters())}


def child(args: argparse.Namespace, side: str, mode: str) -> dict[str, Any] | None:
    command = [sys.executable, __file__, "--side", side, "--mode", mode, "--steps", str(args.steps), "--warmup",
               str(args.warmup), "--seq", str(args.seq), "--batch", str(args.batch), "--log-dir", args.log_dir,
               *(["--tiny"] if args.tiny else []), *(["--torchtitan", args.torchtitan] if args.torchtitan else []),
               *(["--trace", args.trace] if args.trace else [])]
    return measured(command, f"{side} {mode}")


Rounds = list[dict[tuple[str, str], dict[str, Any]]]


def side_values(rounds: Rounds, mode: str, side: str, key: str) -> list[float]:
    """``key`` of each round's ``side`` in ``mode``, where it was measured."""
    return [r[(side, mode)][key] for r in rounds if (side, mode) in r and r[(side, mode)][key] is not None]


def pairs(rounds: Rounds, mode: str) -> list[dict[str, float]]:
    """Each round that measured both sides of ``mode``: their tokens/s and lockstep's ratio to torchtitan."""
    return [{"torchtitan_tokens_s": r[("torchtitan", mode)]["tokens_per_s"],
             "lockstep_tokens_s": r[("lockstep", mode)]["tokens_per_s"],
             "ratio": r[("lockstep", mode)]["tokens_per_s"] / r[("torchtitan", mode)]["tokens_per_s"]}
            for r in rounds if ("lockstep", mode) in r and ("torchtitan", mode) in r]


def mfu_agreement(rounds: Rounds, mode: str) -> list[float]:
    """Each lockstep round's MFU as the Trainer logged it over the MFU by torchtitan's formula."""
    got = [r[("lockstep", mode)] for r in rounds if ("lockstep", mode) in r]
    return [x["trainer_mfu"] / x["formula_mfu"] for x in got if x["trainer_mfu"] and x["formula_mfu"]]


def summary(rounds: Rounds, mode: str) -> dict[str, Any]:
    """One mode over the rounds: each side's median tokens/s and peak memory, lockstep's MFU by torchtitan's
    formula and as the Trainer logged it, and every round's pair."""
    paired = pairs(rounds, mode)
    return {"mode": mode, "torchtitan_tokens_s": median(side_values(rounds, mode, "torchtitan", "tokens_per_s")),
            "lockstep_tokens_s": median(side_values(rounds, mode, "lockstep", "tokens_per_s")),
            "lockstep_over_torchtitan": median([p["ratio"] for p in paired]),
            "torchtitan_peak_gib": median(side_values(rounds, mode, "torchtitan", "peak_gib")),
            "lockstep_peak_gib": median(side_values(rounds, mode, "lockstep", "peak_gib")),
            "torchtitan_formula_mfu": median(side_values(rounds, mode, "torchtitan", "formula_mfu")),
            "formula_mfu": median(side_values(rounds, mode, "lockstep", "formula_mfu")),
            "trainer_mfu": median(side_values(rounds, mode, "lockstep", "trainer_mfu")), "rounds": paired,
            "trainer_mfu_over_formula": median(mfu_agreement(rounds, mode))}


def record_rounds(args: argparse.Namespace, rounds: Rounds) -> None:
    """The modes measured so far into ``--results``, each replacing an earlier entry of its mode."""
    measured_modes = [m for m in args.modes.split(",") if any(k[1] == m for r in rounds for k in r)]

    def update(results: dict[str, Any]) -> None:
        kept = [e for e in results.get("torchtitan", []) if isinstance(e, dict) and e.get("mode") not in measured_modes]
        setup = f"batch {args.batch} x {args.seq}, {args.steps} timed steps after {args.warmup}"
        results["torchtitan"] = kept + [{**summary(rounds, mode), "setup": setup} for mode in measured_modes]

    record(args.results, update)


def print_table(args: argparse.Namespace, rounds: Rounds) -> None:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    first = next(iter(rounds[0].values()), None) if rounds else None
    if first is None:
        return
    print(f"\n{device}, torch {torch.__version__}; torchtitan's Llama 3, {first['params'] / 1e9:.2f} B parameters, "
          f"batch {args.batch} x {args.seq} tokens, {args.steps} timed steps after {args.warmup}, "
          f"{len(rounds)} round(s) (median [range])")
    print(f"{'mode':<19}{'torchtitan tok/s':>27}{'lockstep tok/s':>27}{'lockstep/tt':>24}{'MFU tt':>9}"
          f"{'MFU ls':>9}{'Trainer MFU/formula':>22}{'GiB tt':>9}{'GiB ls':>9}")
    for mode in args.modes.split(","):

        def cell(side: str, key: str, form: str) -> str:
            return spread(side_values(rounds, mode, side, key), form)  # noqa: B023 - used at once

        print(f"{mode:<19}{cell('torchtitan', 'tokens_per_s', '.0f'):>27}{cell('lockstep', 'tokens_per_s', '.0f'):>27}"
              f"{spread([p['ratio'] for p in pairs(rounds, mode)], '.3f'):>24}"
              f"{cell('torchtitan', 'formula_mfu', '.3f'):>9}{cell('lockstep', 'formula_mfu', '.3f'):>9}"
              f"{spread(mfu_agreement(rounds, mode), '.3f'):>22}{cell('torchtitan', 'peak_gib', '.1f'):>9}"
              f"{cell('lockstep', 'peak_gib', '.1f'):>9}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="compile,compile+ac,compile+ac+float8")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer model, sequence 64: checks the script runs")
    parser.add_argument("--torchtitan", help="the folder that holds the torchtitan package (default: installed)")
    parser.add_argument("--side", help=argparse.SUPPRESS)  # one side and mode, in a child process
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--log-dir", default=os.environ.get("TMPDIR", "/tmp") + "/lockstep-torchtitan-bench")
    parser.add_argument("--results", help="a JSON file to put the table into (benchmarks/gpu/results.json)")
    parser.add_argument("--trace", help="a folder for a torch.profiler trace of each child's first 3 timed steps")
    args = parser.parse_args()
    args.size = "tiny" if args.tiny else "1b"
    if args.tiny:
        args.seq, args.batch, args.steps, args.warmup = 64, 2, min(args.steps, 6), min(args.warmup, 2)
    if args.side:
        report(lambda: run_one(args))
        return
    rounds: Rounds = []
    for index in range(args.rounds):
        rounds.append({})
        for mode in args.modes.split(","):
            for side in SIDES if index % 2 == 0 else SIDES[::-1]:
                result = child(args, side, mode)
                if result is not None:
                    rounds[-1][(side, mode)] = result
                    record_rounds(args, rounds)  # after each child: a run cut short keeps what it measured
    print_table(args, rounds)


if __name__ == "__main__":
    main()
