"""What of a state dict given to ``rt.save``/``rt.load`` is sharded (models with their optimizers,
saved by parameter name through DCP) and what is a small object (rank 0's, saved as it is)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from lockstep.errors import CheckpointError
from lockstep.runtime._torch_compat import DCP_STATE_INIT_STEP, full_tensor
from lockstep.runtime.parallel.wrappers import unwrap

OPTIMIZERS_BY_PARAMETER = "by_parameter"  # lockstep.json's "optimizer_layout" since pipeline parallel


class ModelState:
    """A model and the optimizers over its parameters, as DCP saves them: keyed by parameter names,
    so they load into any sharding (FSDP on any number of ranks, DDP, one process, pipeline stages).

    ``by_parameter``: the optimizers' hyperparameters too are stored per parameter name
    (``flatten_optimizer_state_dict``), not as lists of names per group: on pipeline stages each rank's
    groups list only its own parameters, and one list per group would keep one rank's. Checkpoints
    written before (without ``optimizer_layout`` in ``lockstep.json``) load with ``by_parameter=False``."""

    def __init__(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer] = (),
                 by_parameter: bool = True) -> None:
        self.model, self.optimizers = unwrap(model), list(optimizers)
        self.options = StateDictOptions(flatten_optimizer_state_dict=by_parameter)
        self.stored: set[str] | None = None  # loading: the checkpoint's keys of this part (its optimizers')

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"model": get_model_state_dict(self.model)}
        if self.optimizers:
            with self._state_init_steps():
                state["optimizers"] = get_optimizer_state_dict(self.model, self.optimizers, options=self.options)
            if self.stored is not None:
                state["optimizers"] = self._saved_state_only(state["optimizers"])
        return state

    def model_keys(self) -> list[str]:
        """The names DCP gives this rank's weights (a pipeline stage's own only)."""
        return list(get_model_state_dict(self.model))

    def _saved_state_only(self, optimizers: dict[str, Any]) -> dict[str, Any]:
        """Loading: a parameter whose optimizer state the checkpoint does not hold (it had taken no step
        yet when saved: a layer unfrozen later, a branch not yet used) loads with none, as it was, instead
        of the state DCP made up for it (a missing key)."""
        stored = self.stored or set()
        missing = {key for key in optimizers if key.startswith("state.") and f"optimizers.{key}" not in stored}
        made_up = {id(optimizers[key]) for key in missing if isinstance(optimizers[key], torch.Tensor)}  # tensors:
        for optimizer in self.optimizers:  # a Python number (an int step) may be another parameter's too
            for param in [p for p, kept in optimizer.state.items()
                          if any(isinstance(v, torch.Tensor) and id(v) in made_up for v in kept.values())]:
                del optimizer.state[param]
        return {key: value for key, value in optimizers.items() if key not in missing}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state["model"])
        if self.optimizers:
            with self._state_init_steps():
                set_optimizer_state_dict(self.model, self.optimizers, state["optimizers"], options=self.options)

    @contextlib.contextmanager
    def _state_init_steps(self) -> Iterator[None]:
        """While DCP handles the optimizers, a ``step()`` it calls is the optimizer's own (``DCP_STATE_INIT_STEP``)."""
        for optimizer in self.optimizers:
            optimizer.__dict__[DCP_STATE_INIT_STEP] = True
        try:
            yield
        finally:
            for optimizer in self.optimizers:
                optimizer.__dict__.pop(DCP_STATE_INIT_STEP, None)


def is_stateful(value: Any) -> bool:
    """An object saved through its own ``state_dict`` (a loader, a scheduler), not as a value."""
    return hasattr(value, "state_dict") and not isinstance(value, torch.Tensor)


def split_state(state: dict[str, Any], by_parameter: bool = True,
                ) -> tuple[dict[str, ModelState], dict[str, Any], dict[str, str]]:
    """A dict given to ``rt.save``/``rt.load`` as: each model with the optimizers over its parameters
    (sharded parts; ``by_parameter``: see ``ModelState``), the other values' states (rank 0's), and which
    model each optimizer belongs to."""
    models = {name: value for name, value in state.items() if isinstance(value, nn.Module)}
    owners = {name: {id(p) for p in unwrap(model).parameters()} for name, model in models.items()}
    optimizer_of: dict[str, str] = {}
    for name, value in state.items():
        if isinstance(value, torch.optim.Optimizer):
            params = {id(p) for group in value.param_groups for p in group["params"]}
            owner = next((model for model, ids in owners.items() if params <= ids), None)
            if owner is None:
                raise CheckpointError(
                    f"state[{name!r}] is an optimizer over parameters of no model in the same dict: save it "
                    "together with its model (e.g. {'model': model, 'optimizer': optimizer})."
                )
            optimizer_of[name] = owner
    sharded = {name: ModelState(model, [state[o] for o in sorted(optimizer_of) if optimizer_of[o] == name],
                                by_parameter) for name, model in models.items()}
    objects = {name: value.state_dict() if is_stateful(value) else value
               for name, value in state.items() if name not in models and name not in optimizer_of}
    return sharded, objects, optimizer_of


def full_state_dict(module: nn.Module, cpu_offload: bool) -> dict[str, torch.Tensor]:
    """The whole ``module``'s state dict with FSDP shards gathered, as plain CPU tensors; every rank
    calls it. ``cpu_offload``: only rank 0 gets it (the others an empty dict)."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:  # a DTensor (FSDP on
        return {name: full_tensor(value).detach().cpu() for name, value in module.state_dict().items()}  # 1 rank)
    state: dict[str, Any] = get_model_state_dict(
        module, options=StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload))
    return {name: value.detach().cpu() for name, value in state.items()}
