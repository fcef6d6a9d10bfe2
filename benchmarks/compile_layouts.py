"""torch.compile on a model whose repeated blocks come in many layouts: a ResNet-50 of torchvision's structure
(no torchvision needed: 16 ``Bottleneck`` blocks in 4 ``nn.Sequential`` stages, 8 layouts: four widths and a
downsampling first block in each stage), one CPU process, inductor's caches off, each setup in a fresh process:

- ``eager``: no compile;
- ``by region``: each block compiled in place by hand (``block.compile()``), what ``compile=True`` did before it
  counted layouts: the block's code compiled once per layout, the stem and the pooling eager;
- ``compile=True``: ``rt.setup(model, optimizer, compile=True)``, which compiles such a model whole.

Reported per setup: dynamo's graph count, the seconds to the end of the third step (compilation), the median
ms of the steps after it.

    python benchmarks/compile_layouts.py [--divide 8] [--size 64] [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import lockstep

SETUPS = ("eager", "by region", "compile=True")


class Bottleneck(nn.Module):
    def __init__(self, width_in: int, width: int, stride: int, downsample: nn.Module | None) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(width_in, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, width * 4, 1, bias=False), nn.BatchNorm2d(width * 4)
        self.relu, self.downsample = nn.ReLU(inplace=True), downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn3(self.conv3(self.relu(self.bn2(self.conv2(out)))))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet50(nn.Module):
    def __init__(self, divide: int, classes: int = 10) -> None:
        super().__init__()
        stem = 64 // divide
        self.conv1, self.bn1 = nn.Conv2d(3, stem, 7, 2, 3, bias=False), nn.BatchNorm2d(stem)
        self.relu, self.maxpool = nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)
        stages, width_in = [], stem
        for index, (width, blocks) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3), strict=True)):
            width, stride = width // divide, 1 if index == 0 else 2
            downsample = nn.Sequential(nn.Conv2d(width_in, width * 4, 1, stride, bias=False), nn.BatchNorm2d(width * 4))
            stages.append(nn.Sequential(Bottleneck(width_in, width, stride, downsample),
                                        *(Bottleneck(width * 4, width, 1, None) for _ in range(blocks - 1))))
            width_in = width * 4
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(width_in, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def measure(setup: str, args: argparse.Namespace) -> dict[str, float]:
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = ResNet50(args.divide)
    rt = lockstep.Runtime(accelerator="cpu", seed=0)
    if setup == "by region":
        for module in model.modules():
            if isinstance(module, Bottleneck):
                module.compile()
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                compile=True if setup == "compile=True" else None)
    x, y = torch.randn(2, 3, args.size, args.size), torch.randint(0, 10, (2,))
    start, steps = time.perf_counter(), []
    for step in range(3 + args.steps):
        began = time.perf_counter()
        rt.backward(F.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        if step == 2:
            compiled_s = time.perf_counter() - start
        elif step > 2:
            steps.append(time.perf_counter() - began)
    return {"graphs": counters["stats"]["unique_graphs"], "to_third_step_s": compiled_s,
            "step_ms": statistics.median(steps) * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--divide", type=int, default=8, help="widths divided by this (1: ResNet-50's own)")
    parser.add_argument("--size", type=int, default=64, help="image side")
    parser.add_argument("--steps", type=int, default=10, help="steps timed after the third")
    parser.add_argument("--setup", choices=SETUPS, help=argparse.SUPPRESS)  # one setup, in a child process
    args = parser.parse_args()
    if args.setup:
        print("RESULT " + json.dumps(measure(args.setup, args)))
        return
    print(f"ResNet-50 structure, widths / {args.divide}, {args.size} x {args.size} images, batch 2, 1 CPU thread")
    print(f"{'setup':<14}{'graphs':>8}{'s to step 3':>13}{'ms a step':>11}")
    for setup in SETUPS:
        env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
        done = subprocess.run([sys.executable, __file__, "--setup", setup, "--divide", str(args.divide), "--size",
                               str(args.size), "--steps", str(args.steps)], capture_output=True, text=True, env=env)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            print(f"{setup:<14} failed: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
            continue
        r = json.loads(lines[-1][len("RESULT "):])
        print(f"{setup:<14}{r['graphs']:>8}{r['to_third_step_s']:>13.1f}{r['step_ms']:>11.1f}")


if __name__ == "__main__":
    main()
