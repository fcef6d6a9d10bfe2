"""Profilers: time spent per Trainer hook, written to files and summarised on rank 0."""

from __future__ import annotations

import contextlib
import io
import time
import types
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lockstep.errors import ConfigError

if TYPE_CHECKING:  # cProfile and pstats load with an AdvancedProfiler, not with every Trainer
    import cProfile


class SimpleProfiler:
    """A table of time per hook: count, mean, total and percent of the profiled time."""

    name = "simple"

    def __init__(self) -> None:
        self.durations: dict[str, list[float]] = defaultdict(list)
        self.started = time.perf_counter()

    @contextlib.contextmanager
    def profile(self, hook: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.durations[hook].append(time.perf_counter() - start)

    def run(self, hook: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, timed as ``hook``."""
        with self.profile(hook):
            return fn(*args)

    def start(self, folder: Path, rank: int) -> None:
        """Called when training starts; the wall time of the report counts from here."""
        self.started = time.perf_counter()

    def step(self) -> None:
        return None

    def report(self, folder: Path, rank: int) -> str:
        wall = time.perf_counter() - self.started
        lines = [f"{'hook':<40}{'count':>8}{'mean (ms)':>12}{'total (s)':>12}{'percent':>9}"]
        for hook, times in sorted(self.durations.items(), key=lambda kv: -sum(kv[1])):
            total = sum(times)
            lines.append(f"{hook:<40}{len(times):>8}{1000 * total / len(times):>12.4f}{total:>12.6f}"
                         f"{100 * total / wall:>8.1f}%")
        lines.append(f"{'wall time':<40}{'':>8}{'':>12}{wall:>12.6f}{100.0:>8.1f}%")
        text = "\n".join(lines)
        _write(folder / f"profile-{self.name}-rank{rank}.txt", text)
        return text


class AdvancedProfiler(SimpleProfiler):
    """cProfile per hook; the report lists each hook's top functions by cumulative time."""

    name = "advanced"

    def __init__(self, top: int = 15) -> None:
        super().__init__()
        import cProfile

        self.top = top
        self.profiles: dict[str, cProfile.Profile] = defaultdict(cProfile.Profile)

    @contextlib.contextmanager
    def profile(self, hook: str) -> Iterator[None]:
        profile = self.profiles[hook]
        with super().profile(hook):
            profile.enable()
            try:
                yield
            finally:
                profile.disable()

    def report(self, folder: Path, rank: int) -> str:
        import pstats

        parts = [super().report(folder, rank)]
        for hook, profile in self.profiles.items():
            out = io.StringIO()
            pstats.Stats(profile, stream=out).sort_stats("cumulative").print_stats(self.top)
            parts.append(f"\n=== {hook} ===\n{out.getvalue()}")
        text = "\n".join(parts)
        _write(folder / f"profile-advanced-rank{rank}.txt", text)
        return parts[0]


class PyTorchProfiler(SimpleProfiler):
    """torch.profiler over training steps (wait 1, warm-up 1, record 3); a Chrome/TensorBoard trace per rank."""

    name = "pytorch"

    def __init__(self, wait: int = 1, warmup: int = 1, active: int = 3) -> None:
        super().__init__()
        self.schedule = dict(wait=wait, warmup=warmup, active=active, repeat=1)
        self._profiler: Any = None
        self.folder: Path | None = None

    def start(self, folder: Path, rank: int) -> None:
        super().start(folder, rank)
        import torch.profiler as tp

        self.folder = folder / "pytorch-profiler"
        activities = [tp.ProfilerActivity.CPU]
        import torch

        if torch.cuda.is_available():
            activities.append(tp.ProfilerActivity.CUDA)
        self._profiler = tp.profile(
            activities=activities, schedule=tp.schedule(**self.schedule),
            on_trace_ready=tp.tensorboard_trace_handler(str(self.folder), worker_name=f"rank{rank}"),
            record_shapes=True,
        )
        self._profiler.start()

    @contextlib.contextmanager
    def profile(self, hook: str) -> Iterator[None]:
        import torch.profiler as tp

        with super().profile(hook), tp.record_function(hook):
            yield

    def step(self) -> None:
        if self._profiler is not None:
            self._profiler.step()

    def report(self, folder: Path, rank: int) -> str:
        if self._profiler is not None:
            self._profiler.stop()
            table = self._profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=20)
            _write(folder / f"profile-pytorch-ops-rank{rank}.txt", table)
            self._profiler = None
        return super().report(folder, rank) + f"\ntraces: {self.folder}"


class NoProfiler(SimpleProfiler):
    """Profiling off: hooks run without timing."""

    name = "none"
    _nothing = contextlib.nullcontext()  # reusable: no generator per call on the hot path

    def profile(self, hook: str) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        return self._nothing

    def run(self, hook: str, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)  # the hot path: no context to enter per hook

    def report(self, folder: Path, rank: int) -> str:
        return ""


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


PROFILERS = {"simple": SimpleProfiler, "advanced": AdvancedProfiler, "pytorch": PyTorchProfiler}


def hook_runner(profiler: Any) -> Callable[..., Any] | None:
    """How the Trainer runs a hook under ``profiler``: its own run() when it is lockstep's (a subclass may
    override it), else profile()'s; None when profiling is off (the hook is called directly)."""
    if type(profiler) is NoProfiler:
        return None
    return profiler.run if isinstance(profiler, SimpleProfiler) else types.MethodType(SimpleProfiler.run, profiler)


def make_profiler(spec: Any) -> Any:
    """A profiler by name, none (None), or the object given, which needs start, profile, step and report."""
    if spec is None:
        return NoProfiler()
    if isinstance(spec, str):
        if spec not in PROFILERS:
            raise ConfigError(f"unknown profiler {spec!r}: use one of {', '.join(PROFILERS)} or None.")
        return PROFILERS[spec]()
    missing = [name for name in ("start", "profile", "step", "report") if not callable(getattr(spec, name, None))]
    if missing:
        raise ConfigError(f"profiler={spec!r} has no {', '.join(missing)}: give one of {', '.join(PROFILERS)}, None, "
                          "or a profiler object (subclass lockstep.SimpleProfiler).")
    return spec
