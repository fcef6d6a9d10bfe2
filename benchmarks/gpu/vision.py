"""Images/s of a torchvision ResNet-50 fed from JPEG files decoded in DataLoader workers: lockstep's Trainer,
its runtime API, a hand-written loop and Lightning, in alternating rounds, one GPU.

The images are made once (``--images`` random JPEGs of 320 x 256 in a temporary folder, no download) and
read as an image folder is: each sample opened with PIL in a DataLoader worker, randomly cropped and resized
to 224 x 224, flipped, turned into a normalised tensor (torchvision's transforms); batches in pinned memory,
copied to the GPU without blocking, in ``channels_last``. The model is torchvision's ``resnet50`` (random
weights, 1000 classes), ``channels_last``, bf16 autocast, compiled, SGD with momentum. The four loops:

- ``hand-written``: a plain loop over a ``DataLoader`` (``--workers`` workers, ``pin_memory``, persistent);
- ``runtime``: ``rt.setup(model, optimizer, compile=True)``, ``rt.loader(...)``, ``rt.backward``;
- ``trainer``: ``lockstep.Trainer(precision="bf16-mixed", compile=True, num_workers=...)``;
- ``lightning``: ``lightning.Trainer(precision="bf16-mixed")`` on the compiled model.

Each loop runs in a fresh process; a round runs the four in turn, the order rotating from round to round.
Reported per loop: the median images/s over the rounds (with their range), its ratio to the hand-written
loop paired by round, and the fraction of the step spent waiting for data (from the end of one step, the
device synchronised, to the moment the next batch is in hand).

    python benchmarks/gpu/vision.py [--loops trainer,hand-written] [--rounds 3] [--steps 60] [--batch 256]
    python benchmarks/gpu/vision.py --tiny   # 64 x 64 images, ResNet-18, a few steps: checks the script runs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from rounds import measured, median, record, report, spread  # noqa: E402

LOOPS = ("hand-written", "runtime", "trainer", "lightning")


class Times:
    """When each step ended (the device synchronised) and when the next batch was in hand, after ``warmup``
    steps: per step its seconds and the seconds it waited for data."""

    def __init__(self, device: str, warmup: int) -> None:
        self.device, self.warmup = device, warmup
        self.ends: list[float] = []
        self.arrivals: list[float] = []

    def batch_in_hand(self) -> None:
        self.arrivals.append(time.perf_counter())

    def step_end(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
        self.ends.append(time.perf_counter())

    def result(self, batch: int) -> dict[str, float]:
        start = self.warmup  # step i runs from ends[i] to ends[i + 1]; its batch arrived at arrivals[i]
        steps = [b - a for a, b in zip(self.ends[start:-1], self.ends[start + 1:], strict=True)]
        waits = [arrival - end for end, arrival in zip(self.ends[start:-1], self.arrivals[start:], strict=True)]
        return {"images_per_s": batch / statistics.median(steps), "data_wait": sum(waits) / sum(steps),
                "steps": len(steps)}


def make_images(folder: str, count: int, size: tuple[int, int]) -> list[tuple[str, int]]:
    """``count`` random JPEGs (smooth noise, so that they compress as photographs do) and their labels."""
    from PIL import Image

    generator = torch.Generator().manual_seed(0)
    samples = []
    for index in range(count):
        small = torch.randint(0, 256, (3, size[1] // 8, size[0] // 8), generator=generator, dtype=torch.uint8)
        pixels = F.interpolate(small[None].float(), size=(size[1], size[0]), mode="bilinear")[0].byte()
        path = os.path.join(folder, f"{index:05d}.jpg")
        Image.fromarray(pixels.permute(1, 2, 0).numpy()).save(path, quality=90)
        samples.append((path, int(torch.randint(0, 1000, (1,), generator=generator))))
    return samples


class JpegFolder(torch.utils.data.Dataset):
    """An image folder: each sample opened with PIL and augmented, in the DataLoader's worker."""

    def __init__(self, samples: list[tuple[str, int]], crop: int) -> None:
        from torchvision import transforms

        self.samples = samples
        self.transform = transforms.Compose([
            transforms.RandomResizedCrop(crop), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
            transforms.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from PIL import Image

        path, label = self.samples[index]
        with Image.open(path) as image:
            return self.transform(image.convert("RGB")), label


def make_model(tiny: bool) -> torch.nn.Module:
    from torchvision import models

    torch.manual_seed(0)
    return (models.resnet18 if tiny else models.resnet50)(num_classes=1000).to(memory_format=torch.channels_last)


def optimizer_for(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def hand_written(args: argparse.Namespace, dataset: JpegFolder, device: str, times: Times) -> None:
    model = make_model(args.tiny).to(device)
    model.compile()
    optimizer = optimizer_for(model)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch, shuffle=True, drop_last=True,
                                         num_workers=args.workers, pin_memory=device == "cuda",
                                         persistent_workers=True)
    times.step_end()
    for images, labels in loader:
        times.batch_in_hand()
        images = images.to(device, non_blocking=True, memory_format=torch.channels_last)
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = F.cross_entropy(model(images), labels.to(device, non_blocking=True))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.step_end()


def runtime_api(args: argparse.Namespace, dataset: JpegFolder, device: str, times: Times) -> None:
    import lockstep

    rt = lockstep.Runtime(accelerator=device, precision="bf16-mixed", seed=0)
    model = make_model(args.tiny)
    model, optimizer = rt.setup(model, optimizer_for(model), compile=True)
    loader = rt.loader(dataset, batch_size=args.batch, shuffle=True, drop_last=True, num_workers=args.workers)
    times.step_end()
    for images, labels in loader:
        times.batch_in_hand()
        loss = F.cross_entropy(model(images.contiguous(memory_format=torch.channels_last)), labels)
        rt.backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.step_end()


def with_trainer(args: argparse.Namespace, dataset: JpegFolder, device: str, times: Times) -> None:
    import lockstep

    class Classifier(lockstep.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model(args.tiny)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            images, labels = batch
            return F.cross_entropy(self.net(images.contiguous(memory_format=torch.channels_last)), labels)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return optimizer_for(self)

    class Watch(lockstep.Callback):
        def on_train_start(self, trainer: Any, module: Any) -> None:
            times.step_end()

        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
            times.batch_in_hand()

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            times.step_end()

    trainer = lockstep.Trainer(accelerator=device, precision="bf16-mixed", compile=True, max_epochs=1, seed=0,
                               num_workers=args.workers, loggers=(), enable_progress_bar=False, callbacks=[Watch()],
                               log_dir=args.log_dir)
    trainer.fit(Classifier(), dataset, batch_size=args.batch, loader_options={"drop_last": True})


def with_lightning(args: argparse.Namespace, dataset: JpegFolder, device: str, times: Times) -> None:
    import lightning

    class Classifier(lightning.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = make_model(args.tiny)
            self.net.compile()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            images, labels = batch
            return F.cross_entropy(self.net(images.contiguous(memory_format=torch.channels_last)), labels)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return optimizer_for(self)

        def on_train_start(self) -> None:
            times.step_end()

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            times.batch_in_hand()

        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            times.step_end()

    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch, shuffle=True, drop_last=True,
                                         num_workers=args.workers, pin_memory=device == "cuda",
                                         persistent_workers=True)
    trainer = lightning.Trainer(accelerator="gpu" if device == "cuda" else "cpu", devices=1, precision="bf16-mixed",
                                max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, default_root_dir=args.log_dir)
    trainer.fit(Classifier(), loader)


RUNNERS = {"hand-written": hand_written, "runtime": runtime_api, "trainer": with_trainer, "lightning": with_lightning}


def run_loop(args: argparse.Namespace, samples: list[tuple[str, int]]) -> dict[str, Any]:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    times = Times(device, args.warmup)
    RUNNERS[args.loop](args, JpegFolder(samples, args.crop), device, times)
    return {"loop": args.loop, **times.result(args.batch)}


def child(args: argparse.Namespace, loop: str, folder: str) -> dict[str, Any] | None:
    command = [sys.executable, __file__, "--loop", loop, "--folder", folder, "--steps", str(args.steps), "--warmup",
               str(args.warmup), "--batch", str(args.batch), "--workers", str(args.workers), "--images",
               str(args.images), "--log-dir", args.log_dir, *(["--tiny"] if args.tiny else [])]
    return measured(command, loop)


def summary(args: argparse.Namespace, rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """Each loop's median images/s and data wait over the rounds, its ratio to the hand-written loop paired by
    round, and every round."""
    out: dict[str, Any] = {"setup": f"{'ResNet-18' if args.tiny else 'ResNet-50'}, batch {args.batch}, "
                                    f"{args.workers} workers, {args.steps} timed steps after {args.warmup}"}
    for loop in LOOPS:
        key = loop.replace("-", "_")
        out[f"{key}_images_s"] = median([r[loop]["images_per_s"] for r in rounds if loop in r])
        out[f"{key}_data_wait"] = median([r[loop]["data_wait"] for r in rounds if loop in r])
        out[f"{key}_over_hand_written"] = median([r[loop]["images_per_s"] / r["hand-written"]["images_per_s"]
                                                  for r in rounds if loop in r and "hand-written" in r])
    out["rounds"] = [{loop: r[loop]["images_per_s"] for loop in r} for r in rounds]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--loops", default=",".join(LOOPS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=15)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--workers", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 2)))
    parser.add_argument("--images", type=int, default=0, help="JPEGs to make (default: enough for the steps)")
    parser.add_argument("--tiny", action="store_true", help="64 x 64 images, ResNet-18, a few steps, on any device")
    parser.add_argument("--loop", help=argparse.SUPPRESS)  # one loop, in a child process
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    parser.add_argument("--log-dir", default=os.environ.get("TMPDIR", "/tmp") + "/lockstep-vision-bench")
    parser.add_argument("--results", help="a JSON file to put the table into (benchmarks/gpu/results.json)")
    args = parser.parse_args()
    if args.tiny:
        args.batch, args.steps, args.warmup, args.workers = 8, min(args.steps, 6), min(args.warmup, 2), 2
    args.crop, size = (56, (64, 64)) if args.tiny else (224, (320, 256))
    args.images = args.images or args.batch * (args.steps + args.warmup)  # one epoch is the whole run
    if args.loop:
        with open(os.path.join(args.folder, "samples.json")) as listed:
            samples = [(path, label) for path, label in json.load(listed)]
        report(lambda: run_loop(args, samples))
        return
    loops = args.loops.split(",")
    with tempfile.TemporaryDirectory(prefix="lockstep-vision-") as folder:
        with open(os.path.join(folder, "samples.json"), "w") as out:
            json.dump(make_images(folder, args.images, size), out)
        rounds = []
        for index in range(args.rounds):
            order = loops[index % len(loops):] + loops[:index % len(loops)]
            rounds.append({})
            for loop in order:
                if (result := child(args, loop, folder)) is not None:
                    rounds[-1][loop] = result
                    record(args.results, lambda results: results.update(vision=summary(args, rounds)))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    print(f"\n{device}, torch {torch.__version__}; {'ResNet-18' if args.tiny else 'ResNet-50'}, batch {args.batch}, "
          f"{args.workers} workers, {args.steps} timed steps after {args.warmup}, {len(rounds)} round(s) "
          "(median [range])")
    print(f"{'loop':<14}{'images/s':>24}{'vs hand-written':>24}{'data wait':>24}")
    for loop in loops:
        got = [r[loop] for r in rounds if loop in r]
        paired = [r[loop]["images_per_s"] / r["hand-written"]["images_per_s"] for r in rounds
                  if loop in r and "hand-written" in r]
        print(f"{loop:<14}{spread([g['images_per_s'] for g in got], '.0f'):>24}{spread(paired, '.3f'):>24}"
              f"{spread([g['data_wait'] for g in got], '.3f'):>24}")


if __name__ == "__main__":
    main()
