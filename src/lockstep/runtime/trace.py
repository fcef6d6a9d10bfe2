"""The module trace of one optimizer step, for ``lockstep verify``'s ``first difference:`` line.

When verify has found the first step where a run leaves the one-process result, it runs both sides again up to
that step with ``LOCKSTEP_VERIFY_TRACE=K``. In step K each rank records the output (and the first input) of every
module of the models set up (a forward hook on each, while gradients are on: training forwards only), and in
the backward the gradient that reaches each output (a hook on that tensor), with the dataset indices of the
rows it was given, so that the rows of all data-parallel ranks can be joined in dataset order and compared
with the one process's. Each tensor goes to disk as it is made (one in memory at a time):
``FOLDER/trace-RANK/NNNNNN.pt``, listed in ``index.jsonl`` (module, class, call, file, forward or backward) in
the order they were made; ``FOLDER/trace-RANK/rank.json`` says where the rank sits.

A tensor-parallel output held as a ``DTensor`` is gathered whole (every tensor-parallel peer calls the same
hook, so the gather is matched); a local shard is recorded as it is and joined by the comparison.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lockstep.runtime._torch_compat import full_tensor, is_dtensor
from lockstep.runtime.parallel.pipeline.stages import Skipped
from lockstep.runtime.tree import first_tensor


class ModuleTrace:
    """Every module's outputs in one step, written by one rank. ``rows``: the dataset indices of the training
    batch this rank holds now (None where no lockstep loader handed it out)."""

    def __init__(self, folder: Path, rank: int, place: dict[str, Any], rows: Callable[[], list[int] | None],
                 step: int, warms_up: Callable[[], bool], fingerprint: bool = False) -> None:
        self.folder = folder / f"trace-{rank}"
        self.place, self.rows = place, rows
        # the same layout twice: one torch.hash_tensor per row of this rank's tensor instead of the tensor
        self._kept = _fingerprint if fingerprint else _kept
        # the model kind's warm-up (pipeline stages: each stage once on empty tensors, at the run's first step)
        # is no micro-batch of the step: its calls are left out
        self.step, self._warms_up = step, warms_up
        self.skip_first = False
        self._handles: list[RemovableHandle] = []
        self._calls: dict[str, int] = {}
        self._count = 0

    def start(self, models: list[nn.Module]) -> None:
        self.skip_first = self.step == 1 and self._warms_up()
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "rank.json").write_text(json.dumps(self.place))
        for index, model in enumerate(models):
            prefix = f"{index}." if len(models) > 1 else ""
            for name, module in model.named_modules():
                if isinstance(module, Skipped):  # another pipeline stage's module stands there
                    continue
                label = prefix + name if name else (prefix.rstrip(".") or "(the model)")
                self._handles.append(module.register_forward_hook(self._hook(label, type(module).__name__),
                                                                  with_kwargs=True))

    def _hook(self, name: str, kind: str) -> Callable[..., None]:
        def record(_module: nn.Module, args: Any, kwargs: dict[str, Any], output: Any) -> None:
            if not torch.is_grad_enabled():  # evaluation, a pipeline's probe: not the training step's rows
                return
            tensor, given = first_tensor(output), first_tensor(args) if args else first_tensor(kwargs)
            if tensor is None:
                return
            call = self._calls.get(name, 0)
            self._calls[name] = call + 1
            if self.skip_first and call == 0:
                return
            rows = self.rows()
            self._write({"output": self._kept(tensor), "input": self._kept(given) if given is not None else None,
                         "rows": rows}, name, kind, call, "forward")
            if tensor.requires_grad and self._handles:  # the gradient reaching this output, in the backward
                tensor.register_hook(self._gradient(name, kind, call, rows))
        return record

    def _gradient(self, name: str, kind: str, call: int, rows: list[int] | None) -> Callable[[torch.Tensor], None]:
        def record(grad: torch.Tensor) -> None:
            if self._handles:  # the trace has not stopped
                self._write({"output": self._kept(grad), "input": None, "rows": rows}, name, kind, call, "backward")
        return record

    def reduced(self, name: str, grad: torch.Tensor) -> None:
        """A parameter's gradient after the gradients' reduction over the ranks, as the optimizer takes it."""
        self._write({"output": self._kept(grad), "input": None, "rows": None}, name, "parameter", 0, "reduced")

    def _write(self, record: dict[str, Any], name: str, kind: str, call: int, phase: str) -> None:
        file = f"{self._count:06d}.pt"
        torch.save(record, self.folder / file)
        with open(self.folder / "index.jsonl", "a") as index:
            index.write(json.dumps({"name": name, "kind": kind, "call": call, "file": file, "phase": phase}) + "\n")
        self._count += 1

    def stop(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def _kept(tensor: torch.Tensor) -> torch.Tensor:
    """A plain float32 CPU copy (a DTensor gathered whole; a collective's pending result waited for)."""
    whole = full_tensor(tensor).detach()
    return torch.empty(whole.shape, dtype=torch.float32).copy_(whole)


def _fingerprint(tensor: torch.Tensor) -> torch.Tensor:
    """One ``torch.hash_tensor`` per row of this rank's own values (a DTensor's local shard): equal on two runs
    exactly when the row's values are equal bit for bit (up to the XOR reduction's blind spots: two elements
    of a row swapped)."""
    local = tensor.to_local() if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]
    local = torch.empty(local.shape, dtype=local.dtype).copy_(local.detach())
    rows = local.reshape(local.shape[0], -1) if local.dim() else local.reshape(1, 1)
    return torch.hash_tensor(rows, dim=1)
