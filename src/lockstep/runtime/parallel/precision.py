"""Numeric precision as small objects: how to convert the model, run forward, scale and step."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

from lockstep.errors import ConfigError
from lockstep.runtime._torch_compat import forget_unscale
from lockstep.runtime.tree import map_tensors

if TYPE_CHECKING:  # FSDP's types load with FSDP, when a model is sharded
    from torch.distributed.fsdp import MixedPrecisionPolicy


class Precision(Protocol):
    name: str
    transforms_forward: bool  # False: forward needs no context and no input/output conversion

    def convert_module(self, module: nn.Module) -> nn.Module: ...
    def convert_input(self, data: Any) -> Any: ...
    def convert_output(self, data: Any) -> Any: ...
    def forward_context(self) -> contextlib.AbstractContextManager[Any]: ...
    def autocast(self) -> contextlib.AbstractContextManager[Any]: ...
    def scale(self, loss: torch.Tensor) -> torch.Tensor: ...
    def backward(self, loss: torch.Tensor) -> None: ...
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None: ...
    def scaled(self, optimizer: torch.optim.Optimizer) -> bool: ...
    def step_not_taken(self, optimizer: torch.optim.Optimizer) -> None: ...
    def optimizer_step(self, optimizer: torch.optim.Optimizer, step: Callable[[], Any]) -> Any: ...
    @property
    def last_step_skipped(self) -> bool: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def fsdp_policy(self) -> MixedPrecisionPolicy | None: ...


def _cast_floats(data: Any, dtype: torch.dtype) -> Any:
    return map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, data)


class TruePrecision:
    """Parameters, inputs and maths all in one dtype (``32-true``, ``64-true``, ``bf16-true``)."""

    _nothing = contextlib.nullcontext()

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name = name
        self.dtype = dtype
        self.transforms_forward = dtype != torch.float32

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module.to(self.dtype)

    def convert_input(self, data: Any) -> Any:
        return data if self.dtype == torch.float32 else _cast_floats(data, self.dtype)

    def convert_output(self, data: Any) -> Any:
        return data

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        return self._nothing

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The mixed precision of a forward that no FSDP policy casts (a pipeline stage outside FSDP)."""
        return self._nothing

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` as its backward must see it (times the GradScaler's scale with ``16-mixed``)."""
        return loss

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        return None

    def scaled(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s gradients, after a backward, are still multiplied by the loss scale."""
        return False

    def step_not_taken(self, optimizer: torch.optim.Optimizer) -> None:
        return None

    def optimizer_step(self, optimizer: torch.optim.Optimizer, step: Callable[[], Any]) -> Any:
        return step()

    @property
    def last_step_skipped(self) -> bool:
        return False

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None

    def fsdp_policy(self) -> MixedPrecisionPolicy | None:
        return None  # the parameters already have the dtype (convert_module), and so do the reductions


class MixedPrecision(TruePrecision):
    """float32 weights, forward under autocast; ``16-mixed`` also scales the loss (GradScaler).

    Outputs leave the model as float32 so that a loss computed outside ``forward`` is accurate.
    A step whose gradients hold inf/NaN is skipped and the scale lowered; ``last_step_skipped``
    tells (it reads the scale, a host sync, only when asked).

    ``sharded`` (FSDP): instead of autocast, FSDP casts the gathered parameters to the low dtype and
    reduces gradients in float32 (``fsdp_policy``); the grad scaler agrees on inf/NaN over all ranks.
    """

    def __init__(self, name: str, dtype: torch.dtype, device_type: str, sharded: bool = False) -> None:
        super().__init__(name, dtype)
        self.device_type = device_type
        self.sharded = sharded
        self.scaler: torch.amp.GradScaler | None = None
        if dtype == torch.float16:
            self.scaler = _sharded_grad_scaler(device_type) if sharded else torch.amp.GradScaler(device_type)
        self.transforms_forward = True
        self._unscaled: set[int] = set()
        self._scale_before: float | None = None
        self._scale_after: float | None = None
        self._pending = False  # stepped since the last update of the scale

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module

    def convert_input(self, data: Any) -> Any:
        return data

    def convert_output(self, data: Any) -> Any:
        return map_tensors(
            lambda t: t.float() if t.dtype in (torch.float16, torch.bfloat16) else t, data
        )

    def forward_context(self) -> contextlib.AbstractContextManager[Any]:
        return self._nothing if self.sharded else self.autocast()

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        return torch.autocast(self.device_type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        if self.scaler is None:
            return loss
        self._update()  # the last step's optimizers have all stepped: the next scale
        return self.scaler.scale(loss)

    def fsdp_policy(self) -> MixedPrecisionPolicy | None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        return MixedPrecisionPolicy(param_dtype=self.dtype, reduce_dtype=torch.float32)

    def backward(self, loss: torch.Tensor) -> None:
        self.scale(loss).backward()

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None and id(optimizer) not in self._unscaled:
            with _quiet_scaler_on_shards():
                self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    def scaled(self, optimizer: torch.optim.Optimizer) -> bool:
        return self.scaler is not None and id(optimizer) not in self._unscaled

    def step_not_taken(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer``'s step is not taken and its gradients are dropped (a fault-tolerant step that did not
        commit): an unscale of them (``rt.clip_grad_norm_``) is forgotten, so the next step unscales its own."""
        if self.scaler is not None and id(optimizer) in self._unscaled:
            self._unscaled.discard(id(optimizer))
            forget_unscale(self.scaler, optimizer)

    def optimizer_step(self, optimizer: torch.optim.Optimizer, step: Callable[[], Any]) -> Any:
        """The scaler's step of ``optimizer``; its update (the next scale) waits until every optimizer of the
        step has stepped (the next backward, or whoever asks for the scale or the state first): an update
        between two optimizers' steps would unscale the second one's gradients by a scale they were not
        scaled by, and move the scale once per optimizer."""
        if self.scaler is None:
            return step()
        if not self._pending:
            self._scale_before, self._scale_after, self._pending = self.scaler.get_scale(), None, True
        with _quiet_scaler_on_shards():
            result = self.scaler.step(optimizer)  # calls optimizer.step() unless grads hold inf/NaN
        self._unscaled.discard(id(optimizer))
        return result

    def _update(self) -> None:
        if self._pending:
            assert self.scaler is not None
            self.scaler.update()
            self._pending = False

    @property
    def last_step_skipped(self) -> bool:
        if self.scaler is None or self._scale_before is None:
            return False
        self._update()
        if self._scale_after is None:
            self._scale_after = self.scaler.get_scale()
        return self._scale_after < self._scale_before

    def state_dict(self) -> dict[str, Any]:
        self._update()  # the scale the next step uses
        return {"scaler": self.scaler.state_dict()} if self.scaler is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and "scaler" in state:
            self._update()  # the optimizers' stepped states cleared, before the loaded scale replaces this one
            self.scaler.load_state_dict(state["scaler"])


def _sharded_grad_scaler(device_type: str) -> torch.amp.GradScaler:
    """FSDP's grad scaler, which agrees on inf/NaN over all ranks (its import loads FSDP)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device_type)


@contextlib.contextmanager
def _quiet_scaler_on_shards() -> Iterator[None]:
    """The sharded grad scaler's inf check makes DTensor warn about its (1,)-shaped flag, each step."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1")
        yield


class Float8Mixed(MixedPrecision):
    """``float8``: ``bf16-mixed``, with the matrix products of every ``nn.Linear`` whose sizes divide
    by 16 run in float8 with dynamic scaling (torchao's ``convert_to_float8_training``). Fast on GPUs
    of compute capability 8.9 or newer (Ada, Hopper) under ``compile=True``; it also runs, slowly,
    on a CPU whose torch has float8 matrix products (2.13 has), which is how it is tested there."""

    def convert_module(self, module: nn.Module) -> nn.Module:
        from torchao.float8 import convert_to_float8_training

        def fits(child: nn.Module, name: str) -> bool:
            return isinstance(child, nn.Linear) and child.in_features % 16 == 0 and child.out_features % 16 == 0

        return convert_to_float8_training(module, module_filter_fn=fits)


def _check_float8(device: torch.device) -> None:
    """Refuse float8 where its matmuls cannot run: CUDA below compute capability 8.9, a device whose
    torch has no float8 matrix product, or no torchao."""
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise ConfigError("precision 'float8' runs through torchao, which is not installed: pip install torchao."
                          ) from None
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ConfigError(f"precision 'float8' needs compute capability 8.9 or newer (Ada, Hopper); "
                              f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}: "
                              "use 'bf16-mixed'.")
    elif not _float8_matmul_runs(device):
        raise ConfigError(f"precision 'float8' needs float8 matrix products, which torch {torch.__version__} "
                          f"does not run on {device.type}: use 'bf16-mixed' (or a GPU of compute capability 8.9+).")


def _float8_matmul_runs(device: torch.device) -> bool:
    """Whether a tiny tensor-wise scaled float8 matmul runs on ``device`` and gives the right sum."""
    from torch.nn import functional

    scaled_mm = getattr(functional, "scaled_mm", None)
    if scaled_mm is None:
        return False
    try:
        ones = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
        scale = torch.ones((), device=device)
        tensor_wise = functional.ScalingType.TensorWise
        product = scaled_mm(ones, ones.t(), scale, tensor_wise, scale, tensor_wise)
        return bool(product[0, 0].item() == 16)
    except (RuntimeError, TypeError, AttributeError):  # torch's unsupported-operation error is a RuntimeError
        return False


_ALIASES = {"32": "32-true", "64": "64-true", "16": "16-mixed", "bf16": "bf16-mixed",
            "fp32": "32-true", "fp16": "16-mixed", "fp8": "float8"}
PRECISIONS = ("32-true", "64-true", "16-mixed", "bf16-mixed", "bf16-true", "float8")
PRECISION_NAMES = (*PRECISIONS, *_ALIASES)  # what precision= and --precision take
PRECISION_ALIASES = _ALIASES


def make_precision(name: str | int, device: torch.device, sharded: bool = False) -> Precision:
    """Build the precision object for ``name`` on ``device``, checking the device supports it.

    ``sharded``: for FSDP, whose mixed precision casts the parameters instead of autocast."""
    key = _ALIASES.get(str(name), str(name))
    if key not in PRECISIONS:
        raise ConfigError(
            f"unknown precision {name!r}: use one of {', '.join(PRECISIONS)} "
            f"(or the aliases {', '.join(_ALIASES)})."
        )
    if key == "32-true":
        return TruePrecision(key, torch.float32)
    if key == "64-true":
        return TruePrecision(key, torch.float64)
    if key == "float8":
        _check_float8(device)
        return Float8Mixed(key, torch.bfloat16, device.type, sharded)
    if device.type == "cuda" and key.startswith("bf16") and not torch.cuda.is_bf16_supported():
        raise ConfigError(
            f"precision {key!r} needs a GPU with bfloat16 support (Ampere or newer); "
            f"{torch.cuda.get_device_name(device)} has none: use '16-mixed' or '32-true'."
        )
    if key == "bf16-true":
        return TruePrecision(key, torch.bfloat16)
    dtype = torch.float16 if key == "16-mixed" else torch.bfloat16
    if not torch.amp.is_autocast_available(device.type):
        raise ConfigError(f"precision {key!r} needs autocast, which torch lacks on {device.type}.")
    return MixedPrecision(key, dtype, device.type, sharded)
