"""Start N local worker processes from Python (``lockstep.launch``), each with a ready process group.

Functions travel by value (cloudpickle), so functions defined in a notebook or a test work in a
fresh process. On Linux the workers are forked from a ``forkserver`` that imported torch and
lockstep once, so a launch costs milliseconds instead of one torch import per worker; the server
never touches CUDA, so this is as safe with CUDA as ``spawn`` (used elsewhere). Each worker takes
the launching process's current environment variables, working directory, stdout and stderr. Processes are
started and supervised by ``torch.multiprocessing``; on the first failure the others are stopped,
and nothing is left behind.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import multiprocessing
import multiprocessing.spawn
import os
import pickle
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.connection import wait
from pathlib import Path
from types import FunctionType
from typing import Any

import cloudpickle
import torch
import torch.multiprocessing as tmp

from lockstep.env import DistEnv
from lockstep.env.settings import DEFAULT_TIMEOUT_S, timeout_from_environ
from lockstep.errors import ConfigError, WorkerError
from lockstep.runtime.comm.network import free_port
from lockstep.runtime.comm.process_group import destroy_process_group, init_process_group
from lockstep.runtime.faults.lifetime import die_with, exit_now, run_exit_handlers
from lockstep.runtime.files import write_atomic
from lockstep.runtime.launch.elastic import threads_per_process
from lockstep.runtime.seed import draw_fresh_seeds

GRACE_S = 2.0
STORE_KEPT_S = 10.0  # rank 0's store kept up after a failed final barrier, for the peers' reports
#: A worker's exit status when it found ``lockstep.launch`` called while it imported the script.
UNGUARDED_EXIT = 86
UNGUARDED = ("lockstep.launch was called while a worker process imported the script: each worker imports "
             "it again, so the call must sit under `if __name__ == \"__main__\":` (with what trains in a "
             "function that launch runs).")




@dataclass
class RankOutcome:
    """What one rank ended with: ``value`` when ``ok``, else ``error`` (a traceback or a reason)."""

    rank: int
    ok: bool
    value: Any = None
    error: str | None = None
    exception: BaseException | None = None
    failed_at: float = float("inf")
    pid: int | None = None


@dataclass
class _Caller:
    """What a worker takes from the process that launches it; a forkserver's child would otherwise
    have the server's environment, directory and standard streams, as they were at the first launch."""

    pid: int
    environ: dict[str, str]
    cwd: str
    streams: list[Any]  # stdout and stderr: _Descriptor here, the worker's own descriptor there

    @classmethod
    def here(cls) -> _Caller:
        return cls(os.getpid(), dict(os.environ), os.getcwd(), [_Descriptor(1), _Descriptor(2)])

    def adopt(self) -> None:
        """In the worker: die with the caller, and take its variables, directory and streams."""
        die_with(self.pid, name="lockstep-launcher-watch")  # even a SIGKILLed launcher ends its workers
        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        for target, fd in zip((1, 2), self.streams, strict=True):
            if fd is not None:
                os.dup2(fd, target)
                os.close(fd)


class _Descriptor:
    """One of the caller's file descriptors, sent along when a worker starts; it arrives as an int."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any]]:
        try:
            os.fstat(self.fd)
        except OSError:  # closed in the caller: the worker keeps its own
            return _received, (None,)
        return _received, (reduction.DupFd(self.fd),)


def _received(handle: Any) -> int | None:
    return None if handle is None else int(handle.detach())


def _child(
    local_rank: int, payload: bytes, nprocs: int, port: int, workdir: str, backend: str,
    keep_all: bool, caller: _Caller,
) -> None:
    caller.adopt()
    draw_fresh_seeds()  # forked from the forkserver: its seeds, not a new interpreter's
    os.environ.update({
        "RANK": str(local_rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(nprocs),
        "LOCAL_WORLD_SIZE": str(nprocs), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "LOCKSTEP_LAUNCHER": "lockstep.launch",
    })
    # N processes would otherwise each take every core (OMP_NUM_THREADS is read when torch loads,
    # which was in the server: apply it here).
    omp = os.environ.get("OMP_NUM_THREADS", "")
    torch.set_num_threads(int(omp) if omp.isdigit() and int(omp) > 0 else threads_per_process(nprocs))
    result = Path(workdir) / f"rank{local_rank}.pt"
    code = 0
    try:
        fn, args = cloudpickle.loads(payload)
        env = DistEnv.from_environ(argv=[])
        if env.is_distributed:
            init_process_group(env, backend, timeout_from_environ() or DEFAULT_TIMEOUT_S)  # before any Runtime
        value = fn(*args)
        if keep_all or local_rank == 0:
            _save(result, {"ok": True, "value": value})
    except BaseException as error:  # noqa: BLE001 - reported to the parent, then exit non-zero
        _save(result, _failure_report(error))
        code = 1
    else:
        # This rank's work is done. A peer that failed meanwhile breaks the barrier below: that
        # is the peer's failure, which the parent reports from the peer's own outcome. The exit
        # handlers run first: a Runtime made in fn closes, so a peer still waiting in a collective
        # reads that this rank ended instead of "never reached" it.
        run_exit_handlers()
        _leave_group(env.is_distributed, local_rank == 0)
    exit_now(code)  # the result is on disk


def _leave_group(distributed: bool, hosts_store: bool) -> None:
    """After this rank's work: wait for the others, then leave. Rank 0 hosts the store: nobody tears down
    before everybody is done with it. A peer still waiting in a collective of its own breaks the barrier;
    rank 0 then keeps its store up a while, so that the peer's report can still read where this rank ended
    (the launch stops every worker once that peer has failed)."""
    with contextlib.suppress(Exception):
        if distributed:
            try:
                torch.distributed.barrier()
            except Exception:
                if hosts_store:
                    time.sleep(STORE_KEPT_S)
                raise
        destroy_process_group()


class _ScriptPickler(cloudpickle.Pickler):
    """cloudpickle, except that a class or function defined at the top level of the script being
    run goes by reference. Each worker imports that script as its ``__main__`` (as
    multiprocessing does), so the dataset classes a script defines stay the script's own there:
    the worker's DataLoader workers, started with the standard pickler, then find them by name.
    Whatever else (notebooks, ``python -c``, nested definitions) still goes by value."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, type | FunctionType) and _top_level_in_script(obj):
            return NotImplemented  # the standard pickler: by reference, as __main__.NAME
        return super().reducer_override(obj)


def _top_level_in_script(obj: type | FunctionType) -> bool:
    main = sys.modules.get("__main__")
    if getattr(obj, "__module__", None) != "__main__" or main is None or "." in obj.__qualname__:
        return False
    prepared = multiprocessing.spawn.get_preparation_data("lockstep")
    if "init_main_from_path" not in prepared and "init_main_from_name" not in prepared:
        return False  # nothing the workers import: an interactive session, a notebook
    if getattr(main, obj.__qualname__, None) is not obj:
        return False
    try:  # defined at column 0: not under `if __name__ == "__main__":`, which a worker does not run
        lines, _ = inspect.getsourcelines(obj)
    except (OSError, TypeError):
        return False
    first = next((line for line in lines if not line.lstrip().startswith("@")), "")
    return first.startswith(("def ", "class ", "async def "))


def _dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _ScriptPickler(buffer, protocol=pickle.DEFAULT_PROTOCOL).dump(obj)
    return buffer.getvalue()


def _payload(fn: Callable[..., Any], args: tuple[Any, ...]) -> bytes:
    """``fn`` and ``args`` pickled for the workers; what cannot be pickled is named (a lock, an open file, a
    generator: the workers are other processes, which get copies)."""
    try:
        return _dumps((fn, args))
    except Exception as error:  # noqa: BLE001 - pickle raises TypeError, PicklingError, AttributeError, ...
        parts = [("fn", fn), *((f"args[{i}]", arg) for i, arg in enumerate(args))]
        culprit = next((name for name, part in parts if not _picklable(part)), "fn or args")
        raise ConfigError(f"lockstep.launch sends fn and args to each worker process, pickled, and {culprit} "
                          f"cannot be ({type(error).__name__}: {error}): pass what the workers can rebuild it "
                          "from (a path, a config), and create it inside fn.") from error


def _picklable(obj: Any) -> bool:
    try:
        _dumps(obj)
    except Exception:  # noqa: BLE001
        return False
    return True


@contextlib.contextmanager
def _no_main_to_import() -> Iterator[None]:
    """While the workers start: a ``__main__`` whose ``__file__`` is no file (a script read from stdin,
    ``<stdin>``) shows none, so that the workers do not try to import it as multiprocessing would (they failed
    with FileNotFoundError); ``fn`` and ``args`` then travel by value, as from a notebook."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None or getattr(main, "__spec__", None) is not None or os.path.isfile(path):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def _start_method() -> str:
    """``forkserver`` where there is one (Linux), its server importing torch and lockstep once."""
    if sys.platform.startswith("linux"):
        multiprocessing.set_forkserver_preload([__name__])
        return "forkserver"
    return "spawn"


def _failure_report(error: BaseException) -> dict[str, Any]:
    report: dict[str, Any] = {"ok": False, "error": traceback.format_exc(), "time": time.time()}
    with contextlib.suppress(Exception):  # an unpicklable exception still has its traceback
        report["exception"] = cloudpickle.dumps(error)
    return report


def _save(path: Path, obj: Any) -> None:
    write_atomic(path, lambda handle: torch.save(obj, handle, pickle_module=cloudpickle))


def _load(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    return dict(torch.load(path, map_location="cpu", weights_only=False))


def spawn(
    fn: Callable[..., Any], nprocs: int, args: Sequence[Any] = (), *, backend: str = "auto",
    timeout: float | None = None, keep_all: bool = True,
) -> list[RankOutcome]:
    """Run ``fn(*args)`` on ``nprocs`` local ranks; return every rank's outcome.

    Blocks until all ranks finish, one fails (the others are then stopped within a few seconds),
    or ``timeout`` seconds pass (then all are stopped). Never leaves a process running.
    """
    if nprocs < 1:
        raise ConfigError(f"nprocs={nprocs}: start at least one process.")
    if backend == "auto":
        cuda = torch.cuda.is_available() and torch.cuda.device_count() >= nprocs
        backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    payload = _payload(fn, tuple(args))
    with tempfile.TemporaryDirectory(prefix="lockstep-launch-") as workdir, _no_main_to_import():
        context = tmp.start_processes(
            _child, args=(payload, nprocs, free_port(), workdir, backend, keep_all, _Caller.here()),
            nprocs=nprocs, join=False, start_method=_start_method(),
        )
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            timed_out = _wait(context.processes, deadline)
        finally:
            stopped = _stop_all(context.processes)
        return [
            _outcome(rank, process, _load(Path(workdir) / f"rank{rank}.pt"), rank in stopped,
                     timed_out, timeout)
            for rank, process in enumerate(context.processes)
        ]


def _wait(processes: Sequence[Any], deadline: float | None) -> bool:
    """Wait until all exit, one fails (then GRACE_S more for the rest), or the deadline passes.

    Returns True when the deadline passed.
    """
    running = {process.sentinel: process for process in processes}
    while running:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return True
        for sentinel in wait(list(running), timeout=0.2 if left is None else min(0.2, left)):
            process = running.pop(sentinel)
            process.join()
            if process.exitcode != 0:
                wait(list(running), timeout=GRACE_S)  # peers may notice and exit by themselves
                return False
    return False


def _stop_all(processes: Sequence[Any]) -> set[int]:
    """Stop the processes still running (SIGTERM, then SIGKILL); return their ranks."""
    stopped = {rank for rank, process in enumerate(processes) if process.is_alive()}
    for rank in stopped:
        processes[rank].terminate()
    end = time.monotonic() + GRACE_S
    for rank in stopped:
        process = processes[rank]
        process.join(max(0.0, end - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()
    return stopped


def _outcome(
    rank: int, process: Any, report: dict[str, Any] | None, stopped: bool, timed_out: bool,
    timeout: float | None,
) -> RankOutcome:
    pid = process.pid
    if report is not None and report["ok"]:
        return RankOutcome(rank, True, value=report["value"], pid=pid)
    if report is not None:
        exception = None
        if "exception" in report:
            try:
                exception = cloudpickle.loads(report["exception"])
            except Exception:  # noqa: BLE001 - the traceback text is enough
                exception = None
        return RankOutcome(rank, False, error=report["error"], exception=exception,
                           failed_at=report["time"], pid=pid)
    code = process.exitcode
    if code == 0:
        return RankOutcome(rank, True, pid=pid)
    if stopped:
        reason = f"did not finish within {timeout}s" if timed_out else "was stopped after another rank failed"
        return RankOutcome(rank, False, error=f"rank {rank} {reason}", pid=pid)
    # Died on its own without a Python traceback (a signal, os._exit, a crash): the likely cause.
    if code == UNGUARDED_EXIT:
        return RankOutcome(rank, False, error=UNGUARDED, failed_at=0.0, pid=pid)
    how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
    return RankOutcome(rank, False, error=f"rank {rank} {how}", failed_at=0.0, pid=pid)


def first_failure(outcomes: Sequence[RankOutcome]) -> RankOutcome | None:
    """The failure that came first: the likely cause, where the others only lost their peer."""
    failed = [o for o in outcomes if not o.ok]
    return min(failed, key=lambda o: (o.failed_at, o.rank)) if failed else None


def launch(
    fn: Callable[..., Any], nprocs: int, args: Sequence[Any] = (), *, timeout: float | None = None,
) -> Any:
    """Run ``fn(*args)`` on ``nprocs`` local processes and return rank 0's return value.

    Each process gets a ready process group (Gloo on CPU, NCCL and Gloo with enough GPUs) and the
    usual variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ...), so ``lockstep.Runtime()``
    inside ``fn`` just works. Rank 0's value comes back with its tensors on the CPU. When a worker
    raises, a ``WorkerError`` naming its rank (with the original exception as ``__cause__``) is
    raised here within seconds, and every worker is stopped.

    Under a launcher (torchrun, srun, ``lockstep run``, ...) this process already is one rank:
    ``fn(*args)`` then runs here, once, and each rank gets its own return value. ``timeout``: the
    seconds the whole call may take (None: no limit); past it every worker is stopped and a
    ``WorkerError`` names the rank that did not finish.
    """
    if getattr(multiprocessing.process.current_process(), "_inheriting", False):  # a worker importing the script
        print(f"lockstep: {UNGUARDED}", file=sys.stderr, flush=True)
        os._exit(UNGUARDED_EXIT)  # a traceback of the worker's start would only hide the line above
    if DistEnv.from_environ().is_distributed:  # already one rank of a launched job: run here
        return fn(*args)
    outcomes = spawn(fn, nprocs, args, timeout=timeout, keep_all=False)
    failed = first_failure(outcomes)
    if failed is not None:
        summary = failed.error.strip().splitlines()[-1] if failed.error else "failed"
        raise WorkerError(
            f"rank {failed.rank} of {nprocs} failed: {summary}\n\n{failed.error}", failed.rank
        ) from failed.exception
    return outcomes[0].value
