"""``lockstep run``: its options, and the checks that need the training side; the engine that plans and
runs the request is ``runtime/launch/engines.py``'s."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from lockstep.errors import PreflightError
from lockstep.runtime.launch.engines import engine_for
from lockstep.runtime.launch.request import RunRequest, with_orchestrator_defaults


def add_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = commands.add_parser(
        "run", allow_abbrev=False,
        help="start a training script on N processes per node (torch elastic underneath)",
        description="Start SCRIPT on --devices processes on this node (and --nodes nodes), with "
        "the environment that lockstep.Runtime, torch.distributed and torchrun scripts read. "
        "Option names follow torchrun's where the two overlap.",
    )
    _placement_options(parser.add_argument_group("processes and nodes"))
    _fault_tolerance_options(parser.add_argument_group("fault tolerance (--fault-tolerant)"))
    _ray_options(parser.add_argument_group("Ray (--engine ray)"))
    script = parser.add_argument_group("the script")
    script.add_argument("--strategy", help="passed to the script's Runtime (ddp, fsdp, dp, single)")
    script.add_argument("--precision", help="passed to the script's Runtime (32-true, 16-mixed, bf16-mixed, ...)")
    script.add_argument("--parallel", metavar="NAME=VALUE,...",
                        help="passed to the script's Runtime where it gives no parallel=: lockstep.Parallel's degrees, "
                        "pp_schedule and pp_microbatches, e.g. tp=2 or pp=2,pp_schedule=GPipe")
    script.add_argument("--rank-prefix", action="store_true",
                        help="begin each line the ranks print with [rank N] (every rank's lines are whole anyway)")
    script.add_argument("--show-ranks", metavar="RANKS", default=None,
                        help="show the standard output of these ranks only, e.g. 0 or 0,3 (standard error, with "
                        "warnings and tracebacks, comes from every rank)")
    script.add_argument("-m", dest="module", action="store_true",
                        help="SCRIPT is a module name, run as `python -m SCRIPT`")
    script.add_argument("script", metavar="SCRIPT", help="the training script (or module with -m)")
    script.add_argument("script_args", nargs=argparse.REMAINDER, metavar="ARGS", help="arguments for the script")
    parser.set_defaults(func=run_command)


def _placement_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--devices", default=None,
                       help="per node: a count (GPUs with cuda, processes with cpu), GPU indices "
                       "such as 0,2 (sets CUDA_VISIBLE_DEVICES), or auto (default): every GPU, or 1 CPU process")
    group.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "cuda"],
                       help="passed to the script's Runtime; auto = cuda when a GPU is visible")
    group.add_argument("--nodes", default=None,
                       help="number of nodes (default 1), or MIN:MAX for an elastic job that goes on "
                       "with MIN to MAX nodes as nodes leave and join (see docs/launching.md)")
    group.add_argument("--node-rank", type=int, default=None, help="this node's rank, 0..nodes-1 (fixed size)")
    group.add_argument("--master", metavar="HOST:PORT",
                       help="address of node 0 (several nodes; with MIN:MAX, the node hosting the "
                       "rendezvous); a free loopback port is chosen for a single node")
    group.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                       help="dynamic (c10d) rendezvous endpoint, in place of --master/--node-rank")
    group.add_argument("--rdzv-id", default="lockstep", help="job id shared by the nodes (c10d)")
    group.add_argument("--rdzv-conf", default=None, metavar="KEY=VALUE,...",
                       help="c10d rendezvous settings, as torchrun's (join_timeout, last_call_timeout, ...)")
    group.add_argument("--max-restarts", type=int, default=None,
                       help="restart the whole group up to K times after a worker fails "
                       "(default 0; 3 with --nodes MIN:MAX)")
    group.add_argument("--engine", choices=["torch", "ray"], default="torch",
                       help="what starts and supervises the workers: torch elastic on this node (default), or "
                       "Ray Train on the Ray cluster of RAY_ADDRESS (--devices workers per node, --nodes N or "
                       "MIN:MAX; see docs/launching.md)")


def _fault_tolerance_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--fault-tolerant", action="store_true",
                       help="run --replicas replica groups that train on when one dies, and start a "
                       "replacement for it, which takes its state from a live group (torchft; "
                       "docs/fault-tolerance.md); --max-restarts then counts per group (default 3)")
    group.add_argument("--replicas", type=int, default=None, help="how many replica groups share --devices "
                       "(default 2)")
    group.add_argument("--min-replicas", type=int, default=None, help="the fewest live groups a step may run "
                       "with (default 1)")
    group.add_argument("--step-timeout", type=float, default=None, help="seconds a step may wait for the other "
                       "groups; every other timeout derives from it (default 30)")


def _ray_options(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--storage", metavar="DIR", help="Ray Train's storage folder (a folder every node "
                       "mounts), where Ray keeps the run and a copy of each checkpoint")
    group.add_argument("--name", help="the run's name in Ray's storage (default: the script's name); a run of "
                       "the same name and storage resumes from its newest checkpoint")
    group.add_argument("--resize-interval", type=float, default=None, metavar="SECONDS",
                       help="with --nodes MIN:MAX: how often Ray looks for room to grow a running job "
                       "(Ray's default 60)")
    group.add_argument("--keep-checkpoints", type=int, default=None, metavar="N",
                       help="how many checkpoint copies Ray keeps in its storage (Ray's num_to_keep); default: "
                       "those the script keeps (Ray's copy of a checkpoint the script deleted is deleted too)")


def _resolve_devices(devices: str, accelerator: str) -> tuple[int, str | None]:
    """Processes per node, and the CUDA_VISIBLE_DEVICES value to set (None: leave it)."""
    import torch

    from lockstep.runtime.parallel.devices import parse_devices  # torch's import: not for --help

    gpus = torch.cuda.device_count() if accelerator in ("auto", "cuda") else 0
    if accelerator == "cuda" and gpus == 0:
        raise PreflightError("--accelerator cuda, but torch sees no CUDA GPU on this node.")
    try:
        wanted = parse_devices(devices)
    except ValueError as error:
        raise PreflightError(f"--devices {devices}: {error}") from None
    if isinstance(wanted, str):  # "auto"
        return (gpus or 1), None
    if isinstance(wanted, int):
        if gpus and wanted > gpus:
            raise PreflightError(f"--devices {wanted}, but only {gpus} GPU(s) are visible on this node.")
        return wanted, None
    ids = wanted
    if not gpus:
        raise PreflightError(f"--devices {devices}: GPU indices need CUDA GPUs; on the CPU give a count.")
    missing = [i for i in ids if i >= gpus]
    if missing:
        raise PreflightError(f"--devices {devices}: GPU(s) {missing} do not exist ({gpus} visible).")
    if len(set(ids)) != len(ids):
        raise PreflightError(f"--devices {devices}: lockstep run starts one process per GPU it lists. For several "
                             "processes on one GPU, pass devices=[0, 0] to the Runtime or Trainer in the script and "
                             "start it with torchrun --nproc-per-node 2 or lockstep.launch(fn, nprocs=2).")
    return len(ids), ",".join(str(i) for i in ids)


def _check_names(strategy: str | None, precision: str | None) -> None:
    """A misspelt --strategy or --precision is refused here, not by every worker after its start."""
    from lockstep.runtime.parallel.precision import PRECISION_NAMES  # torch's import: not for --help
    from lockstep.runtime.parallel.strategy import STRATEGIES

    if strategy is not None and strategy.lower() not in STRATEGIES:
        raise PreflightError(f"--strategy {strategy}: no such strategy; use one of {', '.join(STRATEGIES)}.")
    if precision is not None and precision not in PRECISION_NAMES:
        raise PreflightError(f"--precision {precision}: no such precision; use one of {', '.join(PRECISION_NAMES)}.")


def _check_parallel(parallel: str | None) -> None:
    """A malformed --parallel is refused here, not by every worker after its start."""
    if parallel is None:
        return
    from lockstep.errors import ConfigError
    from lockstep.runtime.parallel.mesh import parallel_from_text  # torch's import: not for --help

    try:
        parallel_from_text(parallel)
    except ConfigError as error:
        raise PreflightError(f"--{error}") from None


class _Checks:
    """The checks of ``lockstep run`` that need the training side (torch), for the engines."""

    names = staticmethod(lambda strategy, precision: _check_names(strategy, precision))
    devices = staticmethod(lambda devices, accelerator: _resolve_devices(devices, accelerator))

    @staticmethod
    def workers_per_node(devices: str | None) -> int:
        from lockstep.runtime.parallel.devices import parse_devices  # torch's import: not for --help

        try:
            wanted = parse_devices(devices or "auto")
        except ValueError as error:
            raise PreflightError(f"--devices {devices}: {error}") from None
        if isinstance(wanted, tuple):
            raise PreflightError(f"--devices {devices}: with --engine ray give a count of workers per node; "
                                 "Ray gives each worker its GPU.")
        return 1 if wanted == "auto" else int(wanted)

    @staticmethod
    def layout(parallel: str, world_size: int) -> None:
        """--parallel's tp × pp × cp (and replicate) divide the job's world size: else no worker starts. One
        process runs the model unsplit, whatever the degrees (a reference run)."""
        from lockstep.errors import ConfigError
        from lockstep.runtime.parallel.mesh import parallel_from_text

        if world_size == 1:
            return
        try:
            parallel_from_text(parallel).layout(world_size, shards=True)
        except ConfigError as error:
            raise PreflightError(f"--parallel {parallel}: {error}") from None

    @staticmethod
    def gpus(accelerator: str) -> bool:
        import torch

        return accelerator != "cpu" and torch.cuda.device_count() > 0


def _say(line: str) -> None:
    print(f"lockstep run: {line}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _straggler_summary() -> Iterator[None]:
    """Rank 0 writes the slowest rank (or replica group) its straggler report named to a file this run gives
    it (on this node): said again as the run's last line."""
    if os.environ.get("LOCKSTEP_STRAGGLER_SUMMARY"):  # set by whoever runs this: theirs to read
        yield
        return
    with tempfile.TemporaryDirectory(prefix="lockstep-run-") as folder:
        summary = Path(folder) / "slowest-rank.txt"
        os.environ["LOCKSTEP_STRAGGLER_SUMMARY"] = str(summary)
        try:
            yield
        finally:
            del os.environ["LOCKSTEP_STRAGGLER_SUMMARY"]
            with contextlib.suppress(OSError, UnicodeDecodeError):
                _say(f"straggler summary: {summary.read_text()[:2000].strip()}")


def run_command(args: argparse.Namespace) -> int:
    """Plan the request with its engine (every check before a process starts), then run it."""
    try:
        request, notes = with_orchestrator_defaults(RunRequest.from_options(args), os.environ)
        os.environ.update(request.output_variables())  # every engine's workers and groups inherit them
        _check_parallel(request.parallel)
        for note in notes:
            _say(note)
        engine = engine_for(request, _Checks(), _say)
        with _straggler_summary():
            return engine.run(engine.plan(request))
    except PreflightError as error:  # before any worker started (the lighthouse's port is found taken as it starts)
        print(f"lockstep run: {error}", file=sys.stderr)
        return 2
