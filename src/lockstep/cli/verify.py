"""``lockstep verify SCRIPT --devices N``: prove that a distributed run computes what one process computes.

The script runs twice through ``lockstep run``, for its first ``--steps`` optimizer steps: on one
process, then on ``--devices`` processes (and ``--strategy``). Each run records per step the
global batch's loss, the gradient norm and every weight (``lockstep.runtime.verify``). The two
records are compared step by step; the first step and parameter beyond the tolerance are
reported, with the usual causes, and the exit status is 1. It never imports the script.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch loads when a comparison runs, not for --help
    import torch

from lockstep.env.settings import VERIFY_VARIABLES
from lockstep.errors import ConfigError

EXPECTED = {
    "dropout": "the model has Dropout with p > 0: each rank draws the masks of its own rows, so they depend on "
               "the world size (docs/models.md). Set p=0 for the check.",
    "batchnorm": "the model has BatchNorm: in training each rank normalises with its own rows' statistics. "
                 "Check with the model in a form without it, or use DDP(sync_batchnorm=True) on GPUs.",
    "adam": "the optimizer is Adam/AdamW: its update divides by the root of the squared gradients, so in the "
            "first steps, where those are tiny, summation-order differences (1e-7) grow; a larger --rtol or SGD "
            "for the check tells them from a real bug.",
}


def _add_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--devices", type=int, help="processes (or GPUs) of the run to check (required)")
    parser.add_argument("--strategy", help="strategy of the run to check (ddp, fsdp, ...; the script's own wins)")
    parser.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--precision", help="precision of both runs (the script's own wins)")
    parser.add_argument("--parallel", metavar="NAME=VALUE,...",
                        help="the mesh of the run to check, as lockstep run's --parallel (the script's own wins)")
    parser.add_argument("--against", metavar="OPTIONS",
                        help="compare with the run that `lockstep run OPTIONS` makes (e.g. \"--devices 4\") "
                        "instead of one process")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps to compare (default 5)")
    parser.add_argument("--rtol", type=float, default=1e-4, help="relative tolerance (default 1e-4)")
    parser.add_argument("--atol", type=float, default=1e-6, help="absolute tolerance (default 1e-6)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds each run may take (default 600)")
    parser.add_argument("--keep", metavar="DIR", help="keep the two runs' records in DIR")


def add_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = commands.add_parser(
        "verify", allow_abbrev=False, help="check that SCRIPT on N processes computes what it computes on one",
        description="Run SCRIPT's first --steps optimizer steps on one process and on --devices processes "
        "(through lockstep run) and compare, step by step, the global batch's loss, the gradient norm and "
        "every weight. Exits 1 at the first step beyond the tolerance, naming it and the parameter. "
        "verify's options may come before or after SCRIPT; the other arguments go to SCRIPT, and so does "
        "everything after a '--'.",
    )
    _add_options(parser)
    parser.add_argument("script", metavar="SCRIPT", help="the training script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for the script")
    parser.set_defaults(func=verify_command)


def _take_own_options(args: argparse.Namespace) -> None:
    """verify's options written after SCRIPT are verify's (``lockstep verify train.py --devices 2``); the
    other arguments, and all after a ``--``, stay the script's."""
    rest = list(args.script_args)
    theirs: list[str] = []
    if "--" in rest:
        rest, theirs = rest[:rest.index("--")], rest[rest.index("--") + 1:]
    options = argparse.ArgumentParser(prog="lockstep verify", allow_abbrev=False, add_help=False)
    _add_options(options)
    for action in options._actions:
        action.default = argparse.SUPPRESS  # only the options given after SCRIPT land in ``given``
    given, unknown = options.parse_known_args(rest)
    vars(args).update(vars(given))
    args.script_args = unknown + theirs


def _run(args: argparse.Namespace, options: list[str], folder: Path, trace: int = 0,
         fingerprints: bool = False) -> str | None:
    """One run of the script with ``lockstep run OPTIONS`` (``trace``: to that step, tracing its modules); None,
    or what went wrong."""
    command = [sys.executable, "-m", "lockstep.cli.main", "run", "--accelerator", args.accelerator, *options]
    command += [f"--precision={args.precision}"] if args.precision else []
    environment = {**os.environ, VERIFY_VARIABLES[0]: str(folder), VERIFY_VARIABLES[1]: str(args.steps),
                   VERIFY_VARIABLES[2]: str(trace), VERIFY_VARIABLES[3]: "1" if fingerprints else ""}
    _clear_records(folder)
    try:
        done = subprocess.run([*command, args.script, *args.script_args], env=environment, capture_output=True,
                              text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return f"it did not finish in {args.timeout:.0f} s"
    if done.returncode != 0:
        return f"it failed (exit status {done.returncode}):\n{done.stderr[-4000:]}"
    if not (folder / "step-0001.pt").is_file():
        return ("it ended before its first optimizer step: the script must set its model up with lockstep "
                "(Runtime.setup or the Trainer) and step an optimizer.")
    return None


def _clear_records(folder: Path) -> None:
    """An earlier check's records in ``folder`` (a ``--keep`` folder used again) removed, and only those: a run
    that records nothing must not be compared as if it had recorded them."""
    for record in [*folder.glob("step-[0-9]*.pt"), folder / "model.json"]:
        record.unlink(missing_ok=True)
    for trace in folder.glob("trace-[0-9]*"):
        if (trace / "index.jsonl").is_file() or (trace / "rank.json").is_file():
            shutil.rmtree(trace)


def _steps(folder: Path) -> list[dict[str, Any]]:
    import torch

    return [torch.load(path, map_location="cpu", weights_only=True) for path in sorted(folder.glob("step-*.pt"))]


#: A parameter's whole update may differ between the runs by this many times ``--rtol`` of it (1 % by default).
UPDATES = 100

#: How a report begins where the runs agree only because nothing was computed.
NOTHING_COMPARED = "nothing was compared"


def _close(a: float, b: float, rtol: float, atol: float) -> bool:
    """Within the tolerance; a loss or norm that is not a number never agrees, not even with another."""
    return math.isclose(a, b, rel_tol=rtol, abs_tol=atol)


def _weights_gap(reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor], rtol: float, atol: float,
                 start: dict[str, torch.Tensor] | None = None, steps: int = 1) -> tuple[float, str, bool]:
    """The largest weight difference among the parameters beyond the tolerance (among all if none is), its
    parameter, and whether some parameter is beyond the tolerance.

    A parameter is beyond it where a weight differs by more than ``atol`` plus ``rtol`` of the largest weight,
    or, with ``start`` (the weights before the first step), where its update as a whole (the change since then)
    differs from the reference's by more than ``UPDATES`` × ``rtol`` of it, beyond the rounding of ``steps``
    steps: a learning rate scaled by the world size shows however large the weights, while one weight's update
    may differ more (Adam's, where a gradient is near its eps)."""
    import torch

    if set(reference) != set(other):
        missing = sorted(set(reference) ^ set(other))[:3]
        raise ConfigError(f"the two runs' models have different parameters ({', '.join(missing)} ...)")
    largest, where, beyond = 0.0, "", False
    for name, value in reference.items():
        if not value.is_floating_point() or not value.numel():
            continue
        reference_value = value.double()
        difference = other[name].double() - reference_value
        gap = float(difference.abs().max())
        over = gap > atol + rtol * float(reference_value.abs().max())
        if not over and start is not None and name in start:
            update = float((reference_value - start[name].double()).norm())
            rounding = 2 * steps * torch.finfo(value.dtype).eps * float(reference_value.norm())
            over = float(difference.norm()) > UPDATES * rtol * update + rounding
        if (over and not beyond) or (over == beyond and gap > largest):
            largest, where, beyond = gap, name, beyond or over
    return largest, where, beyond


def _moved_ratio(reference: dict[str, Any], other: dict[str, Any], start: dict[str, Any] | None,
                 other_start: dict[str, Any] | None, name: str) -> float | None:
    """How far the run moved parameter ``name`` from its start, as a multiple of the reference's move (the
    projection of its update on the reference's), or None without the starts or a move."""
    if start is None or other_start is None or name not in start or name not in other_start:
        return None
    theirs = (other[name].double() - other_start[name].double()).flatten()
    ours = (reference[name].double() - start[name].double()).flatten()
    square = float(ours @ ours)
    return float(theirs @ ours) / square if square > 0 else None


def compare(reference: list[dict[str, Any]], other: list[dict[str, Any]], rtol: float, atol: float,
            against: str = "one process") -> tuple[list[str], str | None]:
    """The report's table lines, and the first divergence (None if every step agrees); ``against``: what the
    reference run was."""
    lines = [f"{'step':>4}  {'loss, 1 process':>16}  {'loss':>16}  {'grad norm, 1':>14}  {'grad norm':>14}  "
             f"{'max |weight diff|':>17}  parameter"]
    start = reference[0].get("start") if reference else None
    other_start = other[0].get("start") if other else None
    if start is not None and other_start is not None:
        gap, name, beyond = _weights_gap(start, other_start, 0.0, atol)
        if beyond:
            return lines, (f"the start: the weights differ before the first step, most in {name} (by {gap:.3g} from "
                           f"those on {against}): the model is initialised otherwise (a seed per rank, or weights "
                           "loaded by one rank only)")
    for ref, got in zip(reference, other, strict=False):
        gap, name, beyond = _weights_gap(ref["weights"], got["weights"], rtol, atol, start, ref["step"])
        lines.append(f"{ref['step']:>4}  {ref['loss']:>16.9g}  {got['loss']:>16.9g}  {ref['grad_norm']:>14.7g}  "
                     f"{got['grad_norm']:>14.7g}  {gap:>17.3g}  {name}")
        if not all(math.isfinite(value) for value in (ref["loss"], got["loss"])):
            return lines, (f"step {ref['step']}: the loss is not a number ({got['loss']:.9g}, and {ref['loss']:.9g} on "
                           f"{against}): nothing from this step on can be compared")
        if not _close(ref["loss"], got["loss"], rtol, atol):
            return lines, (f"step {ref['step']}: the loss differs ({got['loss']:.9g} against {ref['loss']:.9g} on "
                           f"{against}): the forward or the loss computes something per rank")
        if not _close(ref["grad_norm"], got["grad_norm"], rtol, atol):
            return lines, (f"step {ref['step']}: the gradient norm differs ({got['grad_norm']:.7g} against "
                           f"{ref['grad_norm']:.7g} on {against}) while the loss agrees within the tolerance: the "
                           "backward, or a forward difference too small to show in the loss, computes something per "
                           "rank")
        if beyond:
            ratio = _moved_ratio(ref["weights"], got["weights"], start, other_start, name)
            scaled = (f"; the update there is {ratio:.3g}x the one on {against} (a learning rate or a loss scaled "
                      "by the number of processes?)") if ratio is not None and abs(ratio - 1) > 0.01 else ""
            return lines, (f"step {ref['step']}: the weights differ, most in {name} (by {gap:.3g} from the weights "
                           f"on {against}) while the loss and the gradient norm agree{scaled}")
    if len(other) < len(reference):
        return lines, f"the run stopped after {len(other)} steps, {against} made {len(reference)}"
    if len(reference) < len(other):
        return lines, f"the run on {against} stopped after {len(reference)} steps, the run checked made {len(other)}"
    if all(step["grad_norm"] == 0 for step in [*reference, *other]):
        return lines, (f"{NOTHING_COMPARED}: the gradients were zero at every step of both runs, so no step "
                       "moved the model (an optimizer whose parameters are not the model's, a loss detached from it, "
                       "or a learning rate of 0)")
    return lines, None


def _causes(folder: Path, divergence: str, named: bool = False) -> list[str]:
    """The usual causes of ``divergence`` that the model shows; ``named``: the first difference was found (its
    line says the likely cause), so only what it cannot show is added (Adam's growth of tiny differences)."""
    try:
        model = json.loads((folder / "model.json").read_text())
    except (OSError, ValueError):
        return []
    found: list[str] = []
    if model.get("dropout") and not named:
        found.append(EXPECTED["dropout"])
    if any("BatchNorm" in layer for layer in model.get("layers", [])) and not named:
        found.append(EXPECTED["batchnorm"])
    if any(name in ("Adam", "AdamW") for name in model.get("optimizers", [])) and "weights" in divergence \
            and "the update there is" not in divergence:  # a scaled update is no growth of tiny differences
        found.append(EXPECTED["adam"])
    if "loss differs" in divergence and not found and not named:
        found.append("a loss averaged over a count that differs by rank (tokens, valid labels) must say the count: "
                     "rt.backward(loss, num_items=n), or return {'loss': ..., 'num_items': n} from training_step "
                     "(docs/models.md, 'Token-averaged losses').")
    return found


def verify_command(args: argparse.Namespace) -> int:
    _take_own_options(args)
    problem = _bad_option(args)
    if problem:
        print(f"lockstep verify: {problem}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _stopped)  # the runs stopped and the scratch folder removed, as on Ctrl-C
    try:
        return _check(args)
    except KeyboardInterrupt as stop:
        print(f"lockstep verify: {stop or 'stopped by SIGINT'}: the run under way was stopped, and nothing was "
              "compared.", file=sys.stderr)
        return 128 + (signal.SIGTERM if str(stop).endswith("SIGTERM") else signal.SIGINT)


def _check(args: argparse.Namespace) -> int:
    """Both runs, their comparison and its report; the exit status."""
    with tempfile.TemporaryDirectory(prefix="lockstep-verify-") as scratch:
        root = Path(args.keep) if args.keep else Path(scratch)
        runs = _runs(args, root)
        for label, (options, folder) in runs.items():
            print(f"lockstep verify: running {args.script} on {label} for {args.steps} steps ...", flush=True)
            problem = _run(args, options, folder)
            if problem:
                print(f"lockstep verify: the run on {label} could not be checked: {problem}", file=sys.stderr)
                return 2
        try:
            one, many = _steps(root / "one"), _steps(root / "many")
            lines, divergence = compare(one, many, args.rtol, args.atol, next(iter(runs)))
        except ValueError as error:
            print(f"lockstep verify: {error}", file=sys.stderr)
            return 1
        where = _where(args, root, divergence, runs) if divergence else []
        causes = _causes(root / "many", divergence, named=bool(where)) if divergence else []
    print("\n".join(lines))
    reference, setup = list(runs)
    if divergence is not None and divergence.startswith(NOTHING_COMPARED):
        print(f"lockstep verify: {divergence}.", file=sys.stderr)
        return 1
    if divergence is None:
        ended = f" (the script ended there, before --steps {args.steps})" if len(one) < args.steps else ""
        print(f"lockstep verify: the run on {setup} computes what {reference} computes: "
              f"{len(one)} steps agree within rtol {args.rtol:g}, atol {args.atol:g}{ended}.")
        return 0
    print(f"lockstep verify: the run on {setup} DIVERGES at {divergence}.", file=sys.stderr)
    for line in where:
        print(line, file=sys.stderr)
    for cause in causes:
        print(f"  expected here: {cause}", file=sys.stderr)
    return 1


def _bad_option(args: argparse.Namespace) -> str | None:
    """What is wrong with verify's own options (None: nothing), before any run."""
    if args.devices is None:
        return "give --devices N, the processes of the run to check."
    if args.devices < 2 or args.steps < 1:
        return "give --devices 2 or more and --steps 1 or more."
    if not (args.rtol >= 0 and args.atol >= 0 and args.timeout > 0):
        return f"--rtol and --atol must be 0 or more and --timeout more than 0 (given {args.rtol:g}, {args.atol:g}, " \
               f"{args.timeout:g})."
    if args.keep:
        try:
            Path(args.keep).mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryFile(dir=args.keep):
                pass
        except OSError as error:
            return f"--keep {args.keep}: cannot write there ({error.strerror or error}); give a folder you can write."
    return None


def _stopped(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


def _runs(args: argparse.Namespace, root: Path) -> dict[str, tuple[list[str], Path]]:
    """The reference run and the run to check: their labels, their ``lockstep run`` options, their folders."""
    chosen = [(name, value) for name, value in (("strategy", args.strategy), ("parallel", args.parallel)) if value]
    checked = ["--devices", str(args.devices), *(f"--{name}={value}" for name, value in chosen)]
    setup = f"{args.devices} processes" + "".join(f", {name} {value}" for name, value in chosen)
    reference = shlex.split(args.against) if args.against else ["--devices", "1"]
    return {("one process" if not args.against else f"lockstep run {args.against}"): (reference, root / "one"),
            setup: (checked, root / "many")}


def _where(args: argparse.Namespace, root: Path, divergence: str,
           runs: dict[str, tuple[list[str], Path]]) -> list[str]:
    """Both runs again to the diverging step, every module's outputs traced: the ``first difference:`` line and
    its hint (nothing when the divergence has no step, e.g. a run that stopped early)."""
    from lockstep.cli.first_difference import (
        first_backward_difference,
        first_difference,
        first_fingerprint_difference,
        first_reduced_difference,
    )

    found = re.match(r"step (\d+): ", divergence)
    if found is None or divergence.startswith(NOTHING_COMPARED):
        return []
    step = int(found.group(1))
    (reference, _), (checked, _) = runs.values()
    same = reference == checked  # one layout against itself: exact, by fingerprints
    print(f"lockstep verify: running both again to step {step}, tracing every module's "
          f"{'fingerprints (torch.hash_tensor, per row)' if same else 'outputs'} ...", flush=True)
    traced = []
    for label, (options, folder) in runs.items():
        traced.append(folder.with_name(folder.name + "-trace"))
        problem = _run(args, options, traced[-1], trace=step, fingerprints=same)
        if problem:
            return [f"lockstep verify: the traced run on {label} failed, no module named: {problem}"]
    if same:
        exact = first_fingerprint_difference(traced[0], traced[1])
        return [exact.line(step), f"  likely: {exact.hint()}"] if exact is not None else [
            f"first difference: none in the traced modules at step {step}: every fingerprint is equal"]
    finding = first_difference(traced[0], traced[1], args.rtol, args.atol)
    if finding is not None:
        return [finding.line(step), f"  likely: {finding.hint()}"]
    if "the loss differs" in divergence:
        return [f"first difference: the loss at step {step}, where every module's output agrees",
                "  likely: a loss averaged over a count that differs by rank (tokens, valid labels) without saying "
                "the count: rt.backward(loss, num_items=n), or {'loss': ..., 'num_items': n} from training_step."]
    later = (first_backward_difference(traced[0], traced[1], args.rtol, args.atol)
             or first_reduced_difference(traced[0], traced[1], args.rtol, args.atol))
    if later is not None:
        return [later.line(step), f"  likely: {later.hint()}"]
    return [f"first difference: the update at step {step}: every module's output, the gradients reaching them and "
            "after their reduction, and the loss agree",
            "  likely: a backward that is not rt.backward(loss) (loss.backward() with an uneven last batch), "
            "gradients changed by hand per rank, an optimizer that steps per rank, or a learning rate set from the "
            "number of processes."]
