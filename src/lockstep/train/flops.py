"""Model FLOPs utilisation: the FLOPs a step needs, counted once, against the devices' peak.

The FLOPs of one sample are three times those of its forward (the backward's products are twice
the forward's), which ``torch.utils.flop_counter`` counts over the first training batch (matrix
products, convolutions and attention; element-wise work is not counted, as in every MFU figure),
or given by the module (``flops_per_sample``). Work the backward recomputes (activation
checkpointing, flash attention) is not model work and is not counted. The peak is the
device's dense peak for the precision's matmul dtype: ``LOCKSTEP_PEAK_FLOPS`` (per device), else
the table below, else the matmul rate ``lockstep doctor --bench`` measured on a device of the same
name and recorded in the cache (``$LOCKSTEP_CACHE_DIR``, else ``$XDG_CACHE_HOME/lockstep``, else
``~/.cache/lockstep``). Where none is known no MFU is reported; a figure above 100 % means the
count or the peak is wrong, and it is refused, not shown.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
import warnings
from pathlib import Path

import torch

from lockstep.env import cache_dir_from_environ
from lockstep.errors import ConfigError
from lockstep.runtime import write_atomic

# Dense peak FLOP/s per device by matmul dtype (vendor data sheets, no sparsity).
_PEAKS: dict[str, dict[str, float]] = {
    "H200": {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "H100 SXM": {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "H100 80GB HBM3": {"bf16": 989.4e12, "fp16": 989.4e12, "tf32": 494.7e12, "fp32": 66.9e12},
    "H100 PCIe": {"bf16": 756.5e12, "fp16": 756.5e12, "tf32": 378e12, "fp32": 51.2e12},
    "H100 NVL": {"bf16": 835.5e12, "fp16": 835.5e12, "tf32": 417.5e12, "fp32": 60e12},
    "A100": {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12},
    "V100": {"fp16": 125e12, "fp32": 15.7e12},
}

# float8 is measured against the bf16 peak, as torchtitan reports it: the share of the work in float8 varies.
_DTYPES = {"bf16-mixed": "bf16", "bf16-true": "bf16", "float8": "bf16", "16-mixed": "fp16", "32-true": "fp32"}


def peak_flops(device: torch.device, precision: str) -> float | None:
    """One device's dense peak FLOP/s for ``precision``'s matmuls; None when unknown: the
    environment's, the table's or the one ``lockstep doctor --bench`` measured, in that order."""
    given = os.environ.get("LOCKSTEP_PEAK_FLOPS")
    if given:
        try:
            value = float(given)
        except ValueError:
            raise ConfigError(
                f"LOCKSTEP_PEAK_FLOPS={given!r}: give one device's peak in FLOP/s, e.g. 989e12.") from None
        return value if value > 0 else None
    dtype = _DTYPES.get(precision)
    if dtype is None:
        return None
    if device.type == "cuda":
        if dtype == "fp32" and torch.backends.cuda.matmul.allow_tf32:
            dtype = "tf32"
        name = torch.cuda.get_device_name(device)
        for model, peaks in _PEAKS.items():  # the first entry whose name the device's contains (H100 SXM before H100)
            if model in name:
                return peaks.get(dtype)
    return measured_peaks().get(device_name(device), {}).get(dtype)


# What ``lockstep doctor --bench`` measures, and the dtypes it measures them in.
MEASURED_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_CACHE_LIMIT = 1 << 20  # a cache of peaks is a few hundred bytes; anything much larger is not one


def device_name(device: torch.device) -> str:
    """The name measured peaks are recorded under: the GPU's model, or the CPU's and its threads
    (a process with fewer threads has a lower peak)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            model = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), model)
    except OSError:
        pass
    return f"{device.type}: {model}, {torch.get_num_threads()} threads"


def cache_file() -> Path:
    return cache_dir_from_environ() / "peak_flops.json"


def measured_peaks() -> dict[str, dict[str, float]]:
    """The recorded peaks ``{device name: {dtype: FLOP/s}}``. A cache that is not such a file (too
    large, not JSON, wrong shapes, non-finite or non-positive rates) is ignored with a warning."""
    path = cache_file()
    try:
        with open(path, "rb") as source:
            raw = source.read(_CACHE_LIMIT + 1)
    except FileNotFoundError:
        return {}
    except OSError as error:
        warnings.warn(f"lockstep: cannot read the measured peaks in {path} ({error}); no measured peak is used.",
                      stacklevel=2)
        return {}
    try:
        if len(raw) > _CACHE_LIMIT:
            raise ConfigError("larger than 1 MiB")
        data = json.loads(raw)
        if not isinstance(data, dict):
            raise ConfigError("not an object")
        peaks: dict[str, dict[str, float]] = {}
        for name, rates in data.items():
            if not isinstance(rates, dict):
                raise ConfigError(f"{name!r} holds no rates")
            for dtype, rate in rates.items():
                if isinstance(rate, bool) or not isinstance(rate, int | float) or not math.isfinite(rate) or rate <= 0:
                    raise ConfigError(f"{name!r} {dtype!r}: {rate!r} is not a rate")
            peaks[name] = {dtype: float(rate) for dtype, rate in rates.items()}
        return peaks
    except ValueError as error:  # json's errors are ValueErrors too
        warnings.warn(f"lockstep: {path} is not a file of measured peaks ({error}); it is ignored: run "
                      "`lockstep doctor --bench` again to rewrite it.", stacklevel=2)
        return {}


def measure_matmul_peak(device: torch.device, dtype: torch.dtype, size: int | None = None,
                        repeats: int = 5) -> float:
    """The best rate of ``repeats`` square matmuls of ``size``, in FLOP/s. By default 8192 on a GPU; on a
    CPU the largest size up to 2048 whose product takes under 0.05 s, so that a dtype the CPU lacks
    instructions for (bf16 without AVX-512: 18 s per 2048 product) is timed in seconds, not minutes."""
    size = size or (8192 if device.type == "cuda" else _cpu_size(device, dtype))
    a, b = (torch.randn(size, size, device=device).to(dtype) for _ in range(2))
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    a @ b  # warm-up: kernels chosen, memory allocated
    sync()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def _cpu_size(device: torch.device, dtype: torch.dtype, largest: int = 2048) -> int:
    size = 256
    while size < largest:
        x = torch.randn(size, size, device=device).to(dtype)
        start = time.perf_counter()
        x @ x
        if time.perf_counter() - start > 0.05:
            break
        size *= 2
    return size


def record_measured_peaks(device: torch.device, rates: dict[str, float]) -> Path:
    """Add ``rates`` ({dtype: FLOP/s}) for this device to the cache, atomically; the file's path."""
    path = cache_file()
    peaks = measured_peaks()
    peaks.setdefault(device_name(device), {}).update(rates)
    write_atomic(path, lambda handle: handle.write(json.dumps(peaks, indent=1, sort_keys=True).encode()))
    return path


def mfu(flops_per_sample: float, samples_per_s: float, peak: float, devices: int) -> float | None:
    """The fraction of the devices' peak the model's FLOPs use; None when it would exceed 1 (a wrong
    count or peak: never shown)."""
    value = flops_per_sample * samples_per_s / (peak * devices)
    return value if 0 < value <= 1 else None
