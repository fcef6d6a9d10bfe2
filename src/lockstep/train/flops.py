"""Model FLOPs utilisation: the FLOPs a step needs, counted once, against the devices' peak.

The FLOPs of one sample (forward and backward) are counted with ``torch.utils.flop_counter`` over
the first training batch (matrix products, convolutions and attention; element-wise work is not
counted, as in every MFU figure), or given by the module (``flops_per_sample``). The peak is the
device's dense peak for the precision's matmul dtype, from the table below, or
``LOCKSTEP_PEAK_FLOPS`` (per device, e.g. a matmul rate you measured). Where
neither is known no MFU is reported; a figure above 100 % means the count or the peak is wrong,
and it is refused, not shown.
"""

from __future__ import annotations

import os
from typing import Any

import torch

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
    """One device's dense peak FLOP/s for ``precision``'s matmuls; None when unknown."""
    given = os.environ.get("LOCKSTEP_PEAK_FLOPS")
    if given:
        try:
            value = float(given)
        except ValueError:
            raise ValueError(f"LOCKSTEP_PEAK_FLOPS={given!r}: give one device's peak in FLOP/s, e.g. 989e12.") from None
        return value if value > 0 else None
    if device.type != "cuda":
        return None
    dtype = _DTYPES.get(precision)
    if dtype == "fp32" and torch.backends.cuda.matmul.allow_tf32:
        dtype = "tf32"
    name = torch.cuda.get_device_name(device)
    for model, peaks in _PEAKS.items():  # the first entry whose name the device's contains (H100 SXM before H100)
        if model in name:
            return peaks.get(dtype or "")
    return None


class FlopCount:
    """Counts the FLOPs of what runs between ``start`` and ``stop`` (on this rank)."""

    def __init__(self) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        self._mode: Any = FlopCounterMode(display=False)

    def start(self) -> None:
        self._mode.__enter__()

    def stop(self) -> int:
        self._mode.__exit__(None, None, None)
        return int(self._mode.get_total_flops())


def mfu(flops_per_sample: float, samples_per_s: float, peak: float, devices: int) -> float | None:
    """The fraction of the devices' peak the model's FLOPs use; None when it would exceed 1 (a wrong
    count or peak: never shown)."""
    value = flops_per_sample * samples_per_s / (peak * devices)
    return value if 0 < value <= 1 else None
