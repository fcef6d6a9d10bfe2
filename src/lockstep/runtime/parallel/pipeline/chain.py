"""The chain check: a model cut into stages computes the whole model only when its forward is a chain through
the stages' modules. Each stage runs the model's own forward with the other stages' modules skipped, so
code that the forward runs between its blocks (``x = torch.tanh(block(x))``, ``x = x + block(x)``, a scale
on the embeddings' output) runs again on every stage: a different function, trained without a word.

At the first forward through the stages (a training step's first micro-batch, under ``torch.no_grad``, or
the first evaluation), each stage checks its two edges: that its first module receives what the stage was
handed, and that it hands on what its last module returned. The verdicts are agreed over every rank, so a
broken chain is refused by name on all of them instead of ending in a hang.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from lockstep.errors import ConfigError
from lockstep.runtime.tree import first_tensor


def _same(handed: torch.Tensor | None, seen: torch.Tensor | None) -> bool:
    """Whether two edge values are one: equal shapes and values, compared in the lower of their precisions (a
    stage under autocast hands on float32 what its last block computed in bfloat16)."""
    if handed is None or seen is None:
        return True  # nothing to compare (no tensor found on one side): not a finding
    if handed.shape != seen.shape or handed.is_floating_point() != seen.is_floating_point():
        return False
    if handed.is_floating_point() and torch.finfo(handed.dtype).bits > torch.finfo(seen.dtype).bits:
        handed = handed.to(seen.dtype)
    elif handed.dtype != seen.dtype:
        seen = seen.to(handed.dtype)
    return bool(torch.equal(handed, seen))


class ChainCheck:
    """The edges of this rank's stages, watched through one forward. ``stages``: every stage's module names,
    in the order the forward calls them; ``mine``: this rank's stage indices, one per view."""

    def __init__(self, stages: list[list[str]], mine: list[int]) -> None:
        self.stages, self.mine = stages, mine
        self._seen: dict[tuple[int, str], torch.Tensor | None] = {}

    @contextlib.contextmanager
    def watching(self, views: list[nn.Module]) -> Iterator[None]:
        """Hooks on each view and on its stage's first and last module while the body runs one forward."""
        handles = []
        last_stage = len(self.stages) - 1
        for view, index in zip(views, self.mine, strict=True):
            names = self.stages[index]
            if index > 0:
                handles.append(view.register_forward_pre_hook(self._record(index, "handed in"), with_kwargs=True))
                first = view.get_submodule(names[0])
                handles.append(first.register_forward_pre_hook(self._record(index, "received"), with_kwargs=True))
            if index < last_stage:
                handles.append(view.register_forward_hook(self._record_output(index, "handed on")))
                handles.append(view.get_submodule(names[-1]).register_forward_hook(
                    self._record_output(index, "returned")))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _record(self, index: int, edge: str) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self._seen.setdefault((index, edge), first_tensor(args) if args else first_tensor(kwargs))
        return hook

    def _record_output(self, index: int, edge: str) -> Callable[..., None]:
        def hook(_module: nn.Module, _args: tuple[Any, ...], output: Any) -> None:
            self._seen.setdefault((index, edge), first_tensor(output))
        return hook

    def finding(self) -> str | None:
        """What this rank's stages found (None: both edges of each stage hold)."""
        seen = self._seen
        for index in self.mine:
            names = self.stages[index]
            if index > 0 and not _same(seen.get((index, "handed in")), seen.get((index, "received"))):
                return (f"stage {index}'s first module {names[0]} receives not what stage {index - 1} handed on: the "
                        "forward changes the value before it reaches that module")
            if index < len(self.stages) - 1 and not _same(seen.get((index, "handed on")),
                                                          seen.get((index, "returned"))):
                return (f"stage {index} hands on not what its last module {names[-1]} returned: the forward "
                        "changes the value after that module")
        return None

    def settle(self, all_gather: Callable[[Any], list[Any]]) -> None:
        """The findings of every rank, refused on all of them when one stage broke the chain."""
        findings = [found for found in all_gather(self.finding()) if found]
        self._seen.clear()
        if findings:
            raise ConfigError(
                f"pipeline parallel runs the model's forward on every stage with the other stages' modules "
                f"skipped, so it needs a forward that is a chain through its blocks, but {findings[0]} (e.g. "
                "x = torch.tanh(block(x)), x = x + block(x), or a scale on the embeddings' output, between "
                "blocks). That code would run again on every stage and train another model. Move it into the "
                "blocks' own forward (the residual and the activation inside each block), or cut the model "
                "where its forward is a chain (pp_stages=...).")
