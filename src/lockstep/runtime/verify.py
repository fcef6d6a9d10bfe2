"""The worker side of ``lockstep verify``: record the first optimizer steps of a run, then stop it.

``lockstep verify`` runs a script twice (one process, then the setup to check) with
``LOCKSTEP_VERIFY=FOLDER`` and ``LOCKSTEP_VERIFY_STEPS=K``. Under it, each Runtime records per
optimizer step, from every model set up and every backward:

- the loss of the global batch (over every rank and micro-batch of the step, as the gradients see
  it: sample-weighted, or item-weighted with ``num_items``);
- the gradient norm of the whole model, right before the optimizer uses the gradients;
- every weight and buffer after the step, gathered whole (FSDP shards too); the first step's record
  also holds them before it (``start``), so that each step's update is compared, not only the weights.

Rank 0 writes ``FOLDER/step-NNNN.pt`` per step and ``FOLDER/model.json`` (what the check must
explain: layer types, optimizers). After step K every rank leaves with exit status 0.

With ``LOCKSTEP_VERIFY_TRACE=T`` (the step verify found first different), every module's output in step T
is traced too (``lockstep.runtime.trace``), and the run ends after step T.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lockstep.runtime._torch_compat import full_tensor
from lockstep.runtime.parallel.wrappers import unwrap
from lockstep.runtime.trace import ModuleTrace


class StepRecorder:
    """Losses, gradient norms and weights of the first ``steps`` optimizer steps (see the module text)."""

    def __init__(self, folder: Path, steps: int, rank: int, all_reduce_sum: Callable[[torch.Tensor], Any],
                 full_state_dict: Callable[[nn.Module], dict[str, torch.Tensor]], barrier: Callable[[], None],
                 holders: int = 0, trace: tuple[int, ModuleTrace] | None = None) -> None:
        self.folder, self.rank = folder, rank
        self.trace_step: int = trace[0] if trace is not None else 0
        self.trace: ModuleTrace | None = trace[1] if trace is not None else None
        self.steps = min(steps, self.trace_step) if self.trace_step else steps
        self.holders = holders  # pipeline stages: how many ranks hold each parameter (0: every rank all)
        self._all_reduce_sum, self._full_state_dict, self._barrier = all_reduce_sum, full_state_dict, barrier
        self.models: list[nn.Module] = []
        self.optimizers: list[str] = []
        self._loss = torch.zeros(2, dtype=torch.float64)  # this rank's weighted loss sum and its weight
        self._grad_norm: float | None = None
        self._start: dict[str, torch.Tensor] | None = None  # the weights before the first step
        self.step = 0
        if rank == 0:
            folder.mkdir(parents=True, exist_ok=True)

    def watch(self, model: nn.Module, optimizers: tuple[torch.optim.Optimizer, ...]) -> None:
        self.models.append(model)
        self.optimizers += [type(o).__name__ for o in optimizers]
        if self.trace is not None and self.step == self.trace_step - 1:  # the traced step is the next one
            self.trace.start([model])

    def backward(self, loss: torch.Tensor, weight: float | torch.Tensor) -> None:
        """A backward of ``loss`` (this rank's mean) standing for ``weight`` (samples' share, or items)."""
        weight = torch.as_tensor(weight).detach().double().cpu()
        self._loss += torch.stack([loss.detach().double().cpu() * weight, weight])

    def before_step(self) -> None:
        """The gradients as the optimizer will use them (every rank: a collective for the loss)."""
        squares = torch.zeros((), dtype=torch.float64)
        tracing = self.trace is not None and self.step == self.trace_step - 1
        for index, model in enumerate(self.models):
            for name, param in model.named_parameters():
                if param.grad is not None:
                    grad = full_tensor(param.grad)
                    squares += grad.detach().double().pow(2).sum().cpu()
                    if tracing:  # the gradient as reduced over the ranks, by the parameter's name
                        assert self.trace is not None
                        self.trace.reduced(f"{index}.{name}" if len(self.models) > 1 else name, grad)
        if self.holders:  # each rank holds its stage's parameters: the sum over every rank, each counted once
            squares = self._all_reduce_sum(squares) / self.holders
        self._grad_norm = float(squares.sqrt())
        if self.step == 0:  # the parameters only: a training forward has already moved buffers (BatchNorm's)
            buffers = {self._prefix(index) + name for index, model in enumerate(self.models)
                       for name, _ in unwrap(model).named_buffers()}
            self._start = {name: value.detach().clone()  # copies: a one-process state dict holds the parameters
                           for name, value in self._weights().items() if name not in buffers}

    def _prefix(self, index: int) -> str:
        return f"{index}." if len(self.models) > 1 else ""

    def _weights(self) -> dict[str, torch.Tensor]:
        """Every model's whole weights and buffers (every rank: FSDP gathers its shards)."""
        weights = {}
        for index, model in enumerate(self.models):
            weights.update({self._prefix(index) + name: value for name, value in self._full_state_dict(model).items()})
        return weights

    def after_step(self) -> None:
        """The step is done: record it; after the last one, end the process."""
        total, weight = self._all_reduce_sum(self._loss.clone()).tolist()
        self._loss.zero_()
        self.step += 1
        weights = self._weights()
        if self.rank == 0:
            if self.step == 1:
                layers = sorted({type(m).__name__ for model in self.models for m in model.modules()})
                dropout = any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0
                              for model in self.models for m in model.modules())
                (self.folder / "model.json").write_text(json.dumps(
                    {"layers": layers, "dropout": dropout, "optimizers": self.optimizers}))
            record = {"step": self.step, "loss": total / weight if weight else float("nan"),
                      "grad_norm": self._grad_norm, "weights": weights}
            if self.step == 1 and self._start is not None:
                record["start"] = self._start
            torch.save(record, self.folder / f"step-{self.step:04d}.pt")
        self._start = None
        if self.trace is not None and self.step == self.trace_step - 1:
            self.trace.start(self.models)
        if self.step >= self.steps:
            if self.trace is not None:
                self.trace.stop()
            self._barrier()  # rank 0 has written its files
            raise SystemExit(0)
