"""Models built on the meta device (``rt.init_module(empty=True)``), which allocates nothing, then
materialised by ``rt.setup`` under any strategy (under FSDP only this rank's shards); and optimizers
built before setup, re-pointed to the parameters setup made."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from lockstep.errors import ConfigError
from lockstep.runtime.seed import mix_seed

_INIT_STREAM = 11  # the seed stream of meta-device initialisation on devices without DTensor RNG


def is_empty(module: nn.Module) -> bool:
    """True when the module was built on the meta device (``rt.init_module(empty=True)``)."""
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


def materialize(module: nn.Module, device: torch.device, seed: int = 0) -> None:
    """Allocate a meta-device module (sharded or not) on ``device`` and initialise it with each
    submodule's ``reset_parameters``, so no process ever holds more than its shards.

    Where DTensor has no random generator of its own (the CPU), each rank draws its shards from a
    stream of its own, seeded from (seed, rank): shards differ, and the global RNG is left as it was.
    """
    without_init = [name or type(module).__name__ for name, m in module.named_modules()
                    if _owns_tensors(m) and not hasattr(m, "reset_parameters")]
    if without_init:
        raise ConfigError(
            f"rt.init_module(empty=True) builds the model without memory, and {without_init[:3]} hold parameters "
            "or buffers but define no reset_parameters() to initialise them: add reset_parameters(), or build "
            "the model without empty=True."
        )
    module.to_empty(device=device)
    rank = dist.get_rank() if dist.is_initialized() else 0
    own_stream = device.type == "cpu" and rank > 0
    with torch.random.fork_rng(devices=[]), torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
        if own_stream:
            torch.manual_seed(mix_seed(seed, rank, _INIT_STREAM))
        for submodule in module.modules():
            if _owns_tensors(submodule):
                submodule.reset_parameters()  # type: ignore[operator]


def _owns_tensors(module: nn.Module) -> bool:
    return any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(recurse=False))


def repoint_optimizers(
    before: dict[str, nn.Parameter], module: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
    elsewhere: bool = False,
) -> None:
    """Make optimizers built from the model's parameters before setup hold the parameters it has now.

    Sharding and materialising replace parameter objects; the names stay. Group hyperparameters
    are kept. An optimizer that has already stepped (its state is keyed by the old parameters), or
    that holds tensors that are not the model's parameters, cannot be re-pointed. ``elsewhere``: the
    parameters that ``module`` no longer has are held by other ranks (pipeline stages) and leave the
    optimizers.
    """
    now = dict(module.named_parameters())
    by_id = {id(param): now[name] for name, param in before.items() if name in now}
    gone = {id(param) for name, param in before.items() if name not in now} if elsewhere else set()
    if not gone and all(by_id.get(id(p)) is p for p in before.values()):
        return  # nothing was replaced (DDP, one device)
    for optimizer in optimizers:
        if optimizer.state:
            raise ConfigError(
                f"{type(optimizer).__name__} has already taken steps, and setup replaced the model's parameters "
                "(FSDP shards them): give rt.setup an optimizer that has taken no step yet, built from "
                "model.parameters() (setup re-points it to the new parameters)."
            )
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) not in gone]
            stray = [p for p in group["params"] if id(p) not in by_id]
            if stray:
                raise ConfigError(
                    f"{type(optimizer).__name__} holds {len(stray)} tensor(s) that are not parameters of the model "
                    "given to rt.setup, so they cannot follow the model into its shards: build the optimizer "
                    "after rt.setup, from the model it returns."
                )
            group["params"] = [by_id[id(p)] for p in group["params"]]
