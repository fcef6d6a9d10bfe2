"""Where two runs first differ, module by module: ``lockstep verify``'s ``first difference:`` line.

Each run traced every module's outputs in one optimizer step (``lockstep.runtime.trace``). A module's outputs
on a run of several ranks are joined into the whole global batch: on each data-parallel rank, its calls in
order (the micro-batches of the step); the tensor-parallel peers' shards side by side (or one copy where they
agree); then the rows of every data-parallel rank, put in dataset order by the indices each rank was handed.
The one process's outputs are put in the same order, so a module is compared with the same module of the
one-process model. Modules are compared in the order the one process ran them (a module's output is recorded
when it returns: its submodules come first); one module's outputs are in memory at a time. The first module
whose output differs while its input agrees is where the difference began; where its input differs too, the
difference began in the code of a module around it, between its submodules: the innermost one whose input
still agrees is named.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

_DROPOUT = ("Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "FeatureAlphaDropout")


@dataclass(frozen=True)
class Finding:
    """The first module whose outputs differ: its name (as ``named_modules()`` gives it), class, the largest
    difference, and whether it is the first module the step ran (its input, the data, differs then)."""

    name: str
    kind: str
    difference: float
    first: bool
    before: str = ""  # the module whose input the difference reached first, inside this one
    phase: str = "forward"
    rank: int | None = None  # by fingerprints (one layout against itself): the rank, and ``difference`` in rows

    def line(self, step: int) -> str:
        if self.rank is not None:
            what = {"forward": "output", "backward": "output's gradient", "reduced": "reduced gradient"}[self.phase]
            return (f"first difference: {self.phase} {self.name} ({self.kind}) at step {step} on rank {self.rank}: "
                    f"its {what} differs in {self.difference:.0f} row(s), compared exactly by fingerprints")
        if self.phase == "reduced":
            return (f"first difference: the gradient of {self.name} after the gradients' reduction ({self.kind}) at "
                    f"step {step} (every module's output and the gradient reaching it agree), max difference "
                    f"{self.difference:.3g}")
        if self.phase == "backward":
            after = (f", where the gradient reaching {self.before}'s output agrees: the change is in the backward "
                     f"between them, {self.before}'s or its enclosing module's") if self.before else ""
            return (f"first difference: backward {self.name} ({self.kind}) at step {step}: the gradient reaching its "
                    f"output differs{after} (every forward output and the loss agree), max difference "
                    f"{self.difference:.3g}")
        inside = f", in its own code before {self.before}" if self.before else ""
        return (f"first difference: forward {self.name} ({self.kind}){inside} at step {step}, max difference "
                f"{self.difference:.3g}")

    def hint(self) -> str:
        if self.rank is not None:
            return ("the same layout computed two different results: something in or before this module is not "
                    "deterministic (an atomic add on the GPU, a kernel chosen by timing, an unseeded draw, a "
                    "collective whose order of summation varies). Runtime(deterministic=True) rules out the first "
                    "two.")
        if self.phase == "reduced":
            return ("the gradients were changed between the backward and the optimizer step (scaled, clipped or "
                    "all-reduced by hand, summed where the ranks' mean is the one process's gradient), or by the "
                    "reduction itself (a communication hook, a backward under no_sync at the step's last batch).")
        if self.phase == "backward":
            consumer = f" ({self.before}, or the module around it)" if self.before else ""
            return (f"the gradient was changed per rank between the loss and {self.name}'s output: a gradient hook "
                    "(tensor.register_hook), a custom autograd function's backward, or a loss scaled by hand per rank "
                    f"in the code that consumes this output{consumer}. The gradients of the modules the backward "
                    "reached before agree.")
        if self.kind in _DROPOUT:
            return ("dropout: each rank draws the masks of its own rows, so they depend on the world size. Set p=0 "
                    "for the check (docs/models.md).")
        if "BatchNorm" in self.kind:
            return ("batch statistics: in training each rank normalises with its own rows' mean and variance. Check "
                    "with the model in a form without it, or DDP(sync_batchnorm=True) on GPUs.")
        if self.first:
            return ("the first module the step ran: its input, the data, differs. A transform in the dataset or the "
                    "collate function that depends on the rank or on the worker?")
        return (f"code in {self.name}'s own forward computes something per rank: a value that depends on the rank, a "
                "statistic over the batch's rows (x.mean(0), x.std(0), a normalisation by the batch) that sees only "
                "this rank's rows, or a random draw that differs by rank; or its own weights differ between the "
                "ranks (an earlier step updated their copies differently). Its input and the submodules' outputs "
                "before it agree.")


class _Trace:
    """One run's trace: every rank's records, by module name, read one module at a time."""

    def __init__(self, folder: Path, phase: str = "forward") -> None:
        self.disagreement = 0.0  # of the tensor-parallel peers, in the last joined()
        self.ranks: list[tuple[dict[str, Any], dict[str, list[Path]]]] = []
        self.order: list[tuple[str, str]] = []  # (name, class) in the order the first rank ran them
        self.scale = 1.0  # what a backward record is multiplied by (first_backward_difference sets it)
        for rank_folder in sorted(folder.glob("trace-*"), key=lambda p: int(p.name.split("-")[1])):
            place = json.loads((rank_folder / "rank.json").read_text())
            files: dict[str, list[Path]] = {}
            for line in (rank_folder / "index.jsonl").read_text().splitlines():
                entry = json.loads(line)
                if entry.get("phase", "forward") != phase:
                    continue
                if entry["name"] not in files and not self.ranks:
                    self.order.append((entry["name"], entry["kind"]))
                files.setdefault(entry["name"], []).append(rank_folder / entry["file"])
            self.ranks.append((place, files))

    def first_record(self, name: str) -> torch.Tensor | None:
        """The first rank's record of ``name`` (a reduced gradient: every rank that holds it has the same)."""
        import torch

        for _, files in self.ranks:
            if name in files:
                return torch.load(files[name][0], weights_only=True)["output"]  # type: ignore[no-any-return]
        return None

    def joined(self, name: str, which: str = "output", width: int | None = None) -> torch.Tensor | None:
        """The module's outputs (or inputs) over the whole global batch, rows in dataset order (None: not
        row-shaped). ``width``: the last dimension of the one process's, which tensor-parallel shards join to.
        Where tensor-parallel peers hold the whole output but not the same values, ``self.disagreement`` says
        by how much."""
        import torch

        self.disagreement = 0.0
        groups: dict[int, list[tuple[torch.Tensor, list[int] | None]]] = {}
        for place, files in self.ranks:
            if name not in files:
                continue  # a pipeline stage without the module
            records = [torch.load(path, weights_only=True) for path in files[name]]
            if any(r[which] is None for r in records):
                return None
            output = _rows_joined([r[which].reshape(1) if r[which].dim() == 0 else r[which] for r in records])
            if output is None:
                return None
            output = output * self.scale
            rows = _rows_of(records, which)
            groups.setdefault(place["data_parallel_rank"], []).append((output, rows))
        parts = []
        for peers in (groups[rank] for rank in sorted(groups)):
            joined, apart = _across_peers([out for out, _ in peers], width)
            self.disagreement = max(self.disagreement, apart)
            rows = peers[0][1]
            if joined is None or (rows is not None and joined.shape[0] != len(rows)):
                return None
            parts.append((joined, rows))
        if not parts:
            return None
        if any(rows is None for _, rows in parts):
            return parts[0][0] if len(parts) == 1 else None
        order = torch.tensor([i for _, rows in parts for i in rows]).argsort(stable=True)  # type: ignore[union-attr]
        joined = _rows_joined([output for output, _ in parts])
        return joined[order] if joined is not None else None


def _rows_joined(outputs: list[torch.Tensor]) -> torch.Tensor | None:
    """The outputs' rows one after the other; None where their other dimensions differ (batches padded to
    their own lengths, per call or per rank): not comparable row by row."""
    import torch

    if any(out.shape[1:] != outputs[0].shape[1:] for out in outputs):
        return None
    return torch.cat(outputs)


def _rows_of(records: list[dict[str, Any]], which: str) -> list[int] | None:
    """The dataset index of each row of the calls' outputs, in order. A call on the whole batch takes the
    batch's indices; calls on parts of it (a pipeline stage's micro-batches, in order) take the next rows."""
    rows: list[int] = []
    batch: list[int] | None = None
    cursor = 0
    for record in records:
        given, count = record["rows"], (record[which].shape[0] if record[which].dim() else 1)
        if given is None:
            return None
        if given != batch or count == len(given) or cursor + count > len(given):
            batch, cursor = given, 0
        rows += given[cursor:cursor + count]
        cursor += count
    return rows


def _across_peers(outputs: list[torch.Tensor], width: int | None) -> tuple[torch.Tensor | None, float]:
    """The tensor-parallel peers' outputs of one data-parallel rank: the first peer's where it has the one
    process's width (replicated, or gathered whole), with how far the others are from it; else the shards of
    the last dimension side by side."""
    import torch

    first = outputs[0]
    if len(outputs) == 1 or width is None or (first.dim() and first.shape[-1] == width):
        apart = max((float((out - first).abs().max()) for out in outputs[1:] if out.shape == first.shape),
                    default=0.0)
        return first, apart
    if all(out.shape[:-1] == first.shape[:-1] for out in outputs) and sum(o.shape[-1] for o in outputs) == width:
        return torch.cat(outputs, dim=-1), 0.0
    return None, 0.0


def _gap(reference: _Trace, other: _Trace, name: str, which: str, rtol: float, atol: float) -> float | None:
    """The largest difference of a module's joined outputs (or inputs) beyond the tolerance; None where they
    agree or cannot be compared row by row (a module called on other shapes per rank)."""
    import torch

    expected = reference.joined(name, which)
    got = other.joined(name, which, expected.shape[-1] if expected is not None and expected.dim() else None)
    if expected is None or got is None or expected.shape != got.shape:
        return None
    apart = max(reference.disagreement, other.disagreement)  # tensor-parallel peers that hold other values
    if torch.allclose(got, expected, rtol=rtol, atol=atol, equal_nan=False) and apart <= atol:
        return None
    return max(float((got - expected).abs().nan_to_num(float("inf")).max()), apart)


def first_backward_difference(one: Path, many: Path, rtol: float, atol: float) -> Finding | None:
    """Where every forward output and the loss agree: the first module, in the order the one process's backward
    reached them, whose output's gradient differs (joined as the outputs are, per row of the global batch, and
    put on the one process's scale)."""
    reference, other = _Trace(one, "backward"), _Trace(many, "backward")
    other.scale = _gradient_scale(reference, other)
    agreed = ""  # the module reached last whose output's gradient agrees: its backward made the one that differs
    for name, kind in reference.order:
        difference = _gap(reference, other, name, "output", rtol, atol)
        if difference is not None:
            return Finding(name, kind, difference, False, before=agreed, phase="backward")
        agreed = name
    return None


def first_fingerprint_difference(one: Path, many: Path) -> Finding | None:
    """One layout against itself: each rank's records compared with the same rank's, in the order it made them
    (forward, backward, reduced gradients), by their fingerprints; the earliest difference (on the lowest rank)."""
    import torch

    found: list[tuple[int, int, Finding]] = []
    for folder in sorted(many.glob("trace-*"), key=lambda p: int(p.name.split("-")[1])):
        rank, other = int(folder.name.split("-")[1]), one / folder.name
        if not other.is_dir():
            continue
        mine = {(e["name"], e.get("phase", "forward"), e["call"]): e["file"] for e in _entries(other)}
        for position, entry in enumerate(_entries(folder)):
            key = (entry["name"], entry.get("phase", "forward"), entry["call"])
            if key not in mine:
                continue
            got = torch.load(folder / entry["file"], weights_only=True)["output"]
            expected = torch.load(other / mine[key], weights_only=True)["output"]
            if got.shape != expected.shape or not torch.equal(got, expected):
                rows = int((got != expected).sum()) if got.shape == expected.shape else int(got.numel())
                found.append((position, rank, Finding(key[0], entry["kind"], rows, False, phase=key[1], rank=rank)))
                break
    return min(found, key=lambda item: item[:2])[2] if found else None


def _entries(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / "index.jsonl").read_text().splitlines()]


def first_reduced_difference(one: Path, many: Path, rtol: float, atol: float) -> Finding | None:
    """Where every module's output and gradient agree: the first parameter (in the model's order) whose gradient
    after the reduction over the ranks differs from the one process's (each rank holding it has it whole)."""
    import torch

    reference, other = _Trace(one, "reduced"), _Trace(many, "reduced")
    strategy = str(other.ranks[0][0].get("strategy", "")) if other.ranks else ""
    collective = _REDUCTIONS.get(strategy, "the gradients' reduction")
    for name, _ in reference.order:
        expected, got = reference.first_record(name), other.first_record(name)
        if expected is None or got is None or expected.shape != got.shape:
            continue
        if not torch.allclose(got, expected, rtol=rtol, atol=atol):
            return Finding(name, collective, float((got - expected).abs().nan_to_num(float("inf")).max()), False,
                           phase="reduced")
    return None


#: The collective that reduces the gradients, by strategy (its result is each parameter's gradient).
_REDUCTIONS = {"ddp": "DDP's all-reduce of the gradient buckets", "fsdp": "FSDP's reduce-scatter of the gradients",
               "dp": "DataParallel's reduce onto the first device"}


def _gradient_scale(reference: _Trace, other: _Trace) -> float:
    """One number for the whole backward: a rank's backward runs on its loss times a factor (the data-parallel
    size, or ``num_items``' n / c with c a power of two chosen per run), which DDP and FSDP divide out of the
    parameters' gradients. It is measured on the first gradient the backward reached (the model's output,
    whose loss agreed), as the least-squares factor between the two runs."""
    for name, _ in reference.order:
        expected = reference.joined(name, "output")
        got = other.joined(name, "output", expected.shape[-1] if expected is not None and expected.dim() else None)
        if expected is not None and got is not None and expected.shape == got.shape:
            norm = float((expected.double() * expected.double()).sum())
            factor = float((got.double() * expected.double()).sum()) / norm if norm > 0 else 1.0
            return 1.0 / factor if factor > 0 and math.isfinite(factor) else 1.0
    return 1.0


def first_difference(one: Path, many: Path, rtol: float, atol: float) -> Finding | None:
    """The first module (in the one process's order) whose joined outputs differ beyond the tolerance; where its
    input differs too, the innermost module around it whose input still agrees: the difference began in that
    module's own code, before the other ran."""
    reference, other = _Trace(one), _Trace(many)
    kinds = dict(reference.order)
    for position, (name, kind) in enumerate(reference.order):
        difference = _gap(reference, other, name, "output", rtol, atol)
        if difference is None:
            continue
        if _gap(reference, other, name, "input", rtol, atol) is None:
            return Finding(name, kind, difference, position == 0)
        parts = name.split(".")
        for depth in range(len(parts) - 1, 0, -1):  # the modules around it, innermost first
            outer = ".".join(parts[:depth])
            if outer in kinds and _gap(reference, other, outer, "input", rtol, atol) is None:
                return Finding(outer, kinds[outer], difference, False, before=name)
        return Finding(name, kind, difference, position == 0)
    return None
