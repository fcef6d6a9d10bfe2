"""``RuntimeConfig``: what a Runtime is asked for, as one frozen value (logged and checkpointed)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields, replace
from datetime import timedelta
from typing import Any

from lockstep.env import debug_from_environ, runtime_choices_from_environ, timeout_from_environ, verify_from_environ
from lockstep.env.fault_tolerance import FaultTolerance
from lockstep.env.settings import DEFAULT_TIMEOUT_S
from lockstep.errors import ConfigError
from lockstep.runtime.parallel.devices import Devices
from lockstep.runtime.parallel.mesh import Parallel, parallel_from_text
from lockstep.runtime.parallel.precision import PRECISION_ALIASES
from lockstep.runtime.parallel.strategy import Strategy


@dataclass(frozen=True)
class RuntimeConfig:
    """The arguments of ``lockstep.Runtime`` (see there for each); None means "the default".

    ``resolved()`` fills in what ``lockstep run --accelerator/--strategy/--precision/--parallel`` and
    ``LOCKSTEP_TIMEOUT``/``LOCKSTEP_DEBUG`` chose, then lockstep's defaults.
    """

    accelerator: str | None = None
    devices: Devices = "auto"
    strategy: str | Strategy | None = None
    parallel: Parallel | None = None
    precision: str | int | None = None
    seed: int | None = None
    deterministic: bool = False
    benchmark: bool | None = None
    timeout: float | timedelta | None = None
    backend: str | None = None
    init_method: str | None = None
    debug: bool | None = None
    per_sample_rng: bool = False
    fault_tolerance: FaultTolerance | None = None

    def resolved(self) -> RuntimeConfig:
        chosen = runtime_choices_from_environ()
        _say_replaced(chosen, {"accelerator": self.accelerator, "precision": self.precision,
                               "strategy": getattr(self.strategy, "name", self.strategy), "parallel": self.parallel})
        given = self.timeout.total_seconds() if isinstance(self.timeout, timedelta) else self.timeout
        if given is not None and (type(given) not in (int, float) or not 0 < given < float("inf")):
            raise ConfigError(f"timeout={self.timeout!r}: give a positive, finite number of seconds (or a timedelta).")
        if self.debug is not None and type(self.debug) is not bool:
            raise ConfigError(f"debug={self.debug!r}: give True or False (None: LOCKSTEP_DEBUG decides).")
        timeout = given if given is not None else timeout_from_environ() or DEFAULT_TIMEOUT_S
        return replace(
            self,
            accelerator=self.accelerator or chosen.get("accelerator", "auto"),
            # `lockstep verify` runs the script on 1 process and on N: the launcher's count rules.
            devices="auto" if verify_from_environ() is not None else self.devices,
            strategy=self.strategy or chosen.get("strategy", "auto"),
            parallel=self.parallel or (parallel_from_text(chosen["parallel"]) if "parallel" in chosen else None),
            precision=self.precision or chosen.get("precision", "32-true"),
            timeout=timeout,
            debug=debug_from_environ() if self.debug is None else self.debug,
            fault_tolerance=_fault_tolerance(self.fault_tolerance),
        )

    def kwargs(self) -> dict[str, Any]:
        """The fields as keyword arguments, values as they are (a configured strategy stays an object)."""
        return {field.name: getattr(self, field.name) for field in fields(self)}


def _say_replaced(chosen: dict[str, str], given: dict[str, Any]) -> None:
    """What the code gives wins over ``lockstep run``'s choice; a choice it replaces is said, not dropped silently."""
    for name, value in given.items():
        if value is None or name not in chosen:
            continue
        if _spelled(name, value) != _spelled(name, parallel_from_text(chosen[name]) if name == "parallel"
                                             else chosen[name]):
            warnings.warn(f"lockstep: {name}={value!r} given in the code replaces the launcher's --{name} "
                          f"{chosen[name]} (what the code gives wins).", stacklevel=4)


def _spelled(name: str, value: Any) -> Any:
    """One spelling of a choice: ``gpu`` is ``cuda``, ``bf16`` is ``bf16-mixed``, case aside; of a Parallel, what
    ``--parallel`` can say (not the plan or the stages, which only the code gives)."""
    if name == "parallel":
        return tuple(getattr(value, field) for field in ("tp", "pp", "replicate", "cp", "pp_schedule",
                                                          "pp_microbatches"))
    text = str(value).lower()
    return {"gpu": "cuda"}.get(text, text) if name == "accelerator" else PRECISION_ALIASES.get(text, text)


def _fault_tolerance(asked: FaultTolerance | None) -> FaultTolerance | None:
    """``asked``, else what ``lockstep run --fault-tolerant`` set; with its group and lighthouse."""
    if asked is not None and not isinstance(asked, FaultTolerance):
        raise ConfigError(f"fault_tolerance={asked!r}: give lockstep.FaultTolerance(min_replicas=..., "
                          "step_timeout=...), or None.")
    chosen = asked or FaultTolerance.from_environ()
    return chosen.resolved() if chosen is not None else None
