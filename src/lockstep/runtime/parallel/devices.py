"""Turn ``accelerator`` and ``devices`` into this rank's device, checked against the launcher."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lockstep.env import DistEnv
from lockstep.errors import ConfigError

Devices = int | str | Sequence[int]


@dataclass(frozen=True)
class Placement:
    """What this process computes on.

    ``device`` is this rank's device; ``device_ids`` are all GPU indices this process drives
    (one, or several under ``dp``), empty on CPU. ``shares_gpu``: another process on this node
    computes on the same GPU (``devices=[0, 0]``), which NCCL refuses and Gloo allows.
    """

    accelerator: str
    device: torch.device
    device_ids: tuple[int, ...]
    shares_gpu: bool = False


def resolve_accelerator(accelerator: str) -> str:
    name = accelerator.lower()
    if name == "gpu":
        name = "cuda"
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                "accelerator='cuda' but torch sees no CUDA GPU (torch.cuda.is_available() is "
                "False): use accelerator='cpu', or a machine and torch build with CUDA."
            )
        return name
    if name == "cpu":
        return name
    raise ConfigError(f"unknown accelerator {accelerator!r}: use 'auto', 'cpu' or 'cuda'.")


def _not_whole(value: Any) -> bool:
    return isinstance(value, bool) or not isinstance(value, numbers.Integral)


def parse_devices(devices: Devices) -> int | str | tuple[int, ...]:
    """``4``, ``"4"``, ``"auto"``, ``[0, 2]`` or ``"0,2"`` -> a count, ``"auto"`` or GPU indices; ``-1`` (Lightning's
    "every device") is ``"auto"``.

    An index listed more than once (``[0, 0]``) puts that many processes on one GPU."""
    if isinstance(devices, str):
        text = devices.strip().lower()
        if text in ("auto", "-1"):
            return "auto"
        if text.isdigit():
            devices = int(text)
        else:
            try:
                devices = [int(part) for part in text.split(",") if part.strip()]
            except ValueError:
                raise ConfigError(
                    f"devices={devices!r}: give a count (4), 'auto', or GPU indices ('0,2' or [0, 2])."
                ) from None
    if any(_not_whole(n) for n in (list(devices) if isinstance(devices, (list, tuple)) else [devices])):
        raise ConfigError(f"devices={devices!r}: give a count, 'auto' or a list of GPU indices.")
    if isinstance(devices, int):
        if devices == -1:
            return "auto"
        if devices < 1:
            raise ConfigError(f"devices={devices}: ask for at least one device.")
        return devices
    ids = tuple(int(i) for i in devices)
    if not ids:
        raise ConfigError("devices=[]: list at least one GPU index, or give a count.")
    if min(ids) < 0:
        raise ConfigError(f"devices={list(ids)}: GPU indices must be non-negative.")
    return ids


def _refuse_gpu_indices_on_cpu(wanted: int | str | tuple[int, ...]) -> None:
    if isinstance(wanted, tuple):
        raise ConfigError(
            f"devices={list(wanted)} lists GPU indices but the accelerator is the CPU: give a "
            "process count instead (devices=2), or use accelerator='cuda'."
        )


def processes_asked_for(accelerator: str, devices: Devices) -> int:
    """Processes per node that ``devices`` asks for when no launcher started any (one per device).

    ``"auto"`` means every visible GPU with CUDA, and one process on the CPU.
    """
    kind = resolve_accelerator(accelerator)
    wanted = parse_devices(devices)
    if kind == "cpu":
        _refuse_gpu_indices_on_cpu(wanted)
    if isinstance(wanted, tuple):
        return len(wanted)
    if isinstance(wanted, int):
        return wanted
    return max(1, torch.cuda.device_count()) if kind == "cuda" else 1


def _gpu_ids(wanted: int | str | tuple[int, ...], env: DistEnv, one_process_many_devices: bool) -> tuple[int, ...]:
    """The GPU indices asked for, checked against the visible ones."""
    available = torch.cuda.device_count()
    if isinstance(wanted, tuple):
        ids = wanted
    elif isinstance(wanted, int):
        ids = tuple(range(wanted))
    elif one_process_many_devices or env.capabilities.started_alone:  # "auto": every visible GPU
        ids = tuple(range(available))
    else:  # "auto" under a launcher: one GPU per process it started
        ids = tuple(range(env.local_world_size))
    missing = [i for i in ids if i >= available]
    if missing:
        raise ConfigError(
            f"devices asks for GPU(s) {missing} but only {available} are visible "
            f"(indices 0-{available - 1}; CUDA_VISIBLE_DEVICES renumbers them from 0). To run several "
            "processes on one GPU, list it once per process (devices=[0, 0]; Gloo, not NCCL)."
        )
    return ids


def resolve_placement(
    accelerator: str, devices: Devices, env: DistEnv, one_process_many_devices: bool = False
) -> Placement:
    """Check ``devices`` against the hardware and the launcher, and pick this rank's device.

    With one process per device (DDP, the default), the devices asked for on a node must equal
    the processes the launcher started there. ``one_process_many_devices`` is DataParallel's
    mode: one process drives every device.
    """
    kind = resolve_accelerator(accelerator)
    wanted = parse_devices(devices)
    if kind == "cpu":
        _refuse_gpu_indices_on_cpu(wanted)
        count = wanted if isinstance(wanted, int) else env.local_world_size  # "auto"
        ids: tuple[int, ...] = ()
    else:
        ids = _gpu_ids(wanted, env, one_process_many_devices)
        count = len(ids)
    if one_process_many_devices:
        if env.world_size > 1:
            raise ConfigError(
                f"strategy 'dp' runs in one process but the launcher started {env.world_size}: "
                "start the script with plain `python`, or use strategy='ddp'."
            )
        if len(set(ids)) != len(ids):
            raise ConfigError(f"devices={list(ids)}: strategy 'dp' drives each listed GPU once: list distinct "
                              "indices.")
        return Placement(kind, torch.device(kind, ids[0]) if ids else torch.device(kind), ids)
    if count != env.local_world_size:
        raise ConfigError(_process_count_message(count, env))
    if kind == "cuda":
        index = ids[env.local_rank]
        return Placement(kind, torch.device("cuda", index), (index,), shares_gpu=ids.count(index) > 1)
    return Placement(kind, torch.device("cpu"), ())


def _process_count_message(count: int, env: DistEnv) -> str:
    setting, scheduler = env.capabilities.processes_per_node_setting, env.capabilities.scheduler
    if scheduler:
        return (
            f"devices={count} asks for {count} processes per node, but this {scheduler} job runs "
            f"{env.local_world_size} task(s) on this node: change `{setting}="
            f"{env.local_world_size}` to `{setting}={count}` (one task per device; "
            "`lockstep slurm --devices N` writes it), or set devices to match."
        )
    if env.capabilities.started_alone:
        return (
            f"devices={count} asks for {count} processes, but this process was started alone. "
            f"Start it with `lockstep run --devices {count} SCRIPT`, `torchrun --nproc-per-node "
            f"{count} SCRIPT`, or from Python with lockstep.launch(fn, nprocs={count}); or set "
            "devices=1."
        )
    return (
        f"devices={count} asks for {count} processes per node, but the launcher "
        f"({env.launcher}) started {env.local_world_size} on this node: make the two agree "
        f"(launch {count} per node{f' with {setting}' if setting else ''}, or set devices={env.local_world_size} "
        "or devices='auto')."
    )
