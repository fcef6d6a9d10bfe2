"""Models and rank functions for the torch.compile tests (importable by spawned workers)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import lockstep
from checks import fsdp as fsdp_checks
from checks.dist import layout


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.embed = nn.Linear(8, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Stage(nn.Module):
    def __init__(self, width_in: int, width: int) -> None:
        super().__init__()
        self.norm, self.linear = nn.LayerNorm(width_in), nn.Linear(width_in, width)

    def forward(self, x):
        return F.gelu(self.linear(self.norm(x)))


class Widening(nn.Module):
    """Repeated blocks of one class in 5 layouts (each wider than the last): more than compile=True takes as
    regions (4), so it compiles the model whole."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.embed = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(Stage(8 + 4 * i, 12 + 4 * i) for i in range(5))
        self.head = nn.Linear(28, 4)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def train(rt: lockstep.Runtime, model: nn.Module, compile, steps: int = 4) -> torch.Tensor:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = rt.setup(model, optimizer, compile=compile)
    generator = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=generator), torch.randint(0, 4, (64,)))
    for step, (x, y) in enumerate(rt.loader(data, batch_size=16, num_workers=0)):
        rt.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        if step + 1 == steps:
            break
    return fsdp_checks.full_weights(model), model


def compiled_against_eager(strategy: str = "ddp", user_compiled: bool = False, model: str = "Net") -> dict:
    """Eager, then compiled through lockstep, on this rank; what dynamo counted in between. ``model``: ``Net``
    (alike blocks: regions) or ``Widening`` (blocks of 5 layouts: compiled whole)."""
    from torch._dynamo.utils import counters

    build = {"Net": Net, "Widening": Widening}[model]
    if strategy == "fsdp":
        strategy = lockstep.FSDP(shard_modules=(Block, Stage))
    rt = lockstep.Runtime(accelerator="cpu", seed=0, **layout(strategy))
    eager, _ = train(rt, build(), compile=None)
    counters.clear()
    net = build()
    compiled, wrapped = train(rt, torch.compile(net) if user_compiled else net, compile=None if user_compiled else True)
    return {
        "eager": eager,
        "compiled": compiled,
        "names": rt.compiled,
        "keys": sorted(wrapped.state_dict()),
        "graph_breaks": dict(counters["graph_break"]),
        "frames": counters["stats"]["unique_graphs"],
    }
