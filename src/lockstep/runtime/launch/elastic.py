"""Start workers through the torch elastic agent (the engine behind torchrun) and report failures.

Used by ``lockstep run`` and by scripts that ask for several devices but were started with plain
``python`` (self-launch): the agent supervises the workers and stops them all when one fails.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import signal
import socket
import sys
import tempfile
import threading
import time
from typing import Any, NoReturn

from lockstep.env.fault_tolerance import ENV_GROUP, ENV_ON
from lockstep.env.settings import PREEMPTED_EXIT
from lockstep.errors import StateError
from lockstep.runtime.comm.network import host_store, listening
from lockstep.runtime.faults.root_cause import lost_a_peer
from lockstep.runtime.launch.fork_server import SERVERS, ForkServer, forked_workers
from lockstep.runtime.launch.node_watch import NodeWatch
from lockstep.runtime.launch.plan import rdzv_settings


def threads_per_process(nproc: int) -> int:
    """CPU threads each of ``nproc`` local processes may use without oversubscribing the cores."""
    return max(1, (os.cpu_count() or 1) // nproc)


def run_elastic(torchrun_args: list[str], watch: NodeWatch | None = None) -> int:
    """Run torchrun's launch with ``torchrun_args``; 0 on success, 1 after reporting the failure.

    The root cause is printed once: the failing rank, its host, how it ended, its traceback. With
    a ``watch`` (several nodes), this node's failure is published to the others, and a failure or
    a lost node elsewhere stops this node (see NodeWatch).
    """
    from torch.distributed.run import parse_args

    if watch is not None:
        # What torch's agent installs once its workers start; here from the start, so that a stop
        # during the rendezvous is reported too.
        signal.signal(signal.SIGTERM, _raise_signal)
        watch.start()
    if "SLURM_JOB_ID" in os.environ:  # SLURM's warnings (USR1 before the time limit): the workers' to act on
        for number in (signal.SIGUSR1, signal.SIGUSR2):
            signal.signal(number, _pass_on_to_workers)
    # The agent's log folder holds the workers' error files (read by _report); left to torch, it
    # would be a /tmp/torchelastic_* folder that nobody removes.
    # The agent's own lines on a failure ("Sending process ... closing signal", "failed (exitcode ...)")
    # repeat what _report says once, with the cause: they are left out.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    args = parse_args(torchrun_args)
    with tempfile.TemporaryDirectory(prefix="lockstep-elastic-") as logs:
        args.log_dir = args.log_dir or logs
        return _run_watched(args, watch)


def _run_watched(args: Any, watch: NodeWatch | None) -> int:
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        _run_once_store_listens(args, watch)
    except DistError as error:  # the rendezvous of a fixed number of nodes: one never joined (torch names its store)
        return _not_all_joined(error, args, watch)
    except ChildFailedError as failed:
        # the workers are gone: a stop from the node watch now (another node failed too) has nothing left to stop,
        # and would break this report with a traceback of its own
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if _preempted(failed.failures):
            # every worker stopped itself after a preemption's checkpoint (another node got the TERM): this
            # node ends as the signalled one does, for a restart policy keyed on the exit status
            print(f"lockstep run: the workers stopped for a preemption after its checkpoint; exiting with "
                  f"{PREEMPTED_EXIT}, as the node that got the TERM does.", file=sys.stderr, flush=True)
            if watch is not None:
                watch.stop(done=False)
            return PREEMPTED_EXIT
        cause = _report(failed.failures, _count(args.nproc_per_node), _count(str(args.nnodes).split(":")[-1]))
        if watch is not None:
            elsewhere = watch.failure_elsewhere(3 * watch.interval_s) if cause.startswith("lost a peer") else ""
            if elsewhere:
                print(f"lockstep: the failure began on node {elsewhere}", file=sys.stderr, flush=True)
            else:
                watch.publish_failure(cause)
            watch.stop(done=False)
        return 1
    except SignalException as signalled:
        verdict = watch.verdict if watch is not None else ""
        if verdict:
            print(f"lockstep: this node stopped its workers: {verdict}.", file=sys.stderr, flush=True)
            return 1
        # A signal from outside (a scheduler's TERM, Ctrl-C): the agent passed it on to the workers and
        # gave them time to end (a preemption checkpoint); exit as the signal would.
        number = int(signalled.sigval)
        print(f"lockstep run: stopped by {signal.Signals(number).name}; this node's workers were stopped.",
              file=sys.stderr, flush=True)
        if watch is not None:
            watch.stop(done=False)
        return 128 + number
    if watch is not None:
        watch.stop(done=True)
    return 0


STOP_GRACE_S = 10.0


def stop_this_node(verdict: str, since_s: float = 0.0) -> None:
    """This node cannot go on: stop its agent, which stops the workers (run_elastic reports why).

    The agent's shutdown talks to the rendezvous store, which may be out of reach; after
    ``STOP_GRACE_S`` the workers are killed and the process exits regardless.
    """
    os.kill(os.getpid(), signal.SIGTERM)

    def hard_stop() -> None:
        print(f"lockstep: {verdict}; the agent did not stop within {STOP_GRACE_S:g}s, killing its workers.",
              file=sys.stderr, flush=True)
        for pid in _children(os.getpid()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        os._exit(1)

    timer = threading.Timer(STOP_GRACE_S, hard_stop)
    timer.daemon = True
    timer.start()


def stop_local_workers(verdict: str, since_s: float) -> None:
    """An elastic job goes on without a lost node: end this node's workers that were started while
    it was still there, so that the agent restarts them and the rendezvous re-forms the group from
    the nodes still there. Workers the agent started since (it may have restarted them already,
    when a collective failed first) are left alone."""
    stale = [pid for pid, age in _children(os.getpid()).items() if age > since_s and pid not in SERVERS]
    if stale:
        print(f"lockstep: {verdict}; restarting this node's workers to re-form the job without it.",
              file=sys.stderr, flush=True)
    for pid in stale:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _children(pid: int) -> dict[int, float]:
    """This process's children (Linux /proc) and their ages in seconds."""
    ticks = os.sysconf("SC_CLK_TCK")
    with open("/proc/uptime") as handle:
        uptime = float(handle.read().split()[0])
    found = {}
    for path in glob.glob(f"/proc/{pid}/task/*/children"):
        with contextlib.suppress(OSError), open(path) as handle:
            for child in handle.read().split():
                with contextlib.suppress(OSError, ValueError), open(f"/proc/{child}/stat") as stat:
                    started = int(stat.read().rsplit(")", 1)[1].split()[19]) / ticks
                    found[int(child)] = uptime - started
    return found


def _run_once_store_listens(args: Any, watch: NodeWatch | None) -> None:
    """torch's launch; first, a node whose node 0 hosts a static rendezvous's store waits for it to listen,
    quietly and answering signals (torch's client logs a C++ stack trace at each of its tries, and does not
    answer TERM while it waits): DistError when nothing listened there within the rendezvous timeout."""
    from torch.distributed import DistError
    from torch.distributed.run import run as elastic_run

    if watch is not None and not watch.hosts_store and args.rdzv_backend == "static":
        timeout_s = int(rdzv_settings(args.rdzv_conf).get("timeout", 600))  # lockstep run sets it; 600: torch's
        if not _store_listens_within(args, timeout_s):
            raise DistError(f"nothing listened at {args.master_addr}:{args.master_port} within {timeout_s} s")
    elastic_run(args)


def _store_listens_within(args: Any, timeout_s: int) -> bool:
    """Whether node 0's store listens within ``timeout_s``, waited for quietly; a line says so after 5 s."""
    start = time.monotonic()
    said = False
    while not listening(args.master_addr, int(args.master_port), 2.0):
        waited = time.monotonic() - start
        if waited >= timeout_s:
            return False
        if not said and waited >= 5:
            print(f"lockstep run: waiting for node 0's rendezvous store at {args.master_addr}:{args.master_port} "
                  f"(up to {timeout_s} s; --rdzv-conf timeout=SECONDS)", file=sys.stderr, flush=True)
            said = True
        time.sleep(min(1.0, max(0.0, timeout_s - waited)))
    return True


def _not_all_joined(error: Exception, args: Any, watch: NodeWatch | None) -> int:
    """A node of a fixed number of them did not join the rendezvous within its timeout: said in one line."""
    if watch is not None:
        watch.stop(done=False)
    print(f"lockstep run: the {_count(str(args.nnodes).split(':')[-1])} nodes did not all join the rendezvous at "
          f"{args.master_addr}:{args.master_port} ({str(error).strip().splitlines()[0]}). Every node runs lockstep "
          "run with the same --nodes and --master and a --node-rank of its own; one that does not join within the "
          "rendezvous timeout (--rdzv-conf timeout=SECONDS, else LOCKSTEP_TIMEOUT) ends the job.",
          file=sys.stderr, flush=True)
    return 1


def _pass_on_to_workers(signum: int, frame: object) -> None:
    """A scheduler's warning to the agent goes on to its workers (directly, or through the fork server's
    clients, which pass signals on), where ``Preemption`` turns it into a checkpoint and a stop; left to
    its default, it would end the agent, and the workers with it."""
    for pid in _children(os.getpid()):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signum)


def _raise_signal(signum: int, frame: object) -> None:
    from torch.distributed.elastic.multiprocessing import SignalException

    raise SignalException(f"process {os.getpid()} got signal {signum}", sigval=signal.Signals(signum))


def _count(value: Any) -> int:
    """A launch argument's count (``--nproc-per-node 2``, ``--nnodes 1:2``'s maximum); 0 when not a number."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def _report(failures: dict[int, Any], nproc: int, nnodes: int) -> str:
    """Print the root cause of a failed group (``nproc`` workers on each of up to ``nnodes`` nodes);
    returns it in one line."""
    # A rank that ended its script (its peer's report says so) was stopped by the agent when that peer's failure
    # came first, while it was still leaving the interpreter (a signal, not an exit code of its own): it ended.
    ended = {r for r in _ended_by_report(failures) if r in failures and failures[r].exitcode < 0} if nnodes == 1 \
        else set()
    failures = {r: f for r, f in failures.items() if r not in ended} or failures
    rank, failure = _root_cause(failures)
    how = f"exit code {failure.exitcode}"
    if failure.exitcode < 0:
        try:
            how = f"signal {signal.Signals(-failure.exitcode).name}"
        except ValueError:
            how = f"signal {-failure.exitcode}"
    cause = f"rank {rank} (local rank {failure.local_rank}) on {socket.gethostname()} failed with {how}"
    group = os.environ.get(ENV_GROUP) if os.environ.get(ENV_ON) == "1" else None  # a fault-tolerant job's group
    stopped = (f"every worker of replica group {group} was stopped; the other groups train on" if group is not None
               else "every worker of the job was stopped")
    print(f"lockstep: {cause}; {stopped}.", file=sys.stderr)
    if all(_lost_a_peer(f) for f in failures.values()):
        finished = sorted(set(range(nproc)) - {f.local_rank for f in failures.values()}) if nproc else sorted(ended)
        ranks = ", ".join(map(str, finished))
        if finished:  # they ended their script (exit 0) while the others still waited in a collective
            print(f"lockstep: {'rank' if nnodes == 1 else 'local rank'}{'s' if len(finished) > 1 else ''} {ranks} "
                  "ended the script while the others still waited in a collective: every rank must "
                  "run the same collectives. Code under `if rank == 0:` that validates, saves or syncs a metric "
                  "is the usual cause; so is a collective inside a loop over rt.eval_loader, whose shards differ "
                  "in length by rank (gather once, after the loop).", file=sys.stderr)
        elif nnodes == 1:
            print("lockstep: every worker only lost a peer, and none says why: a worker was killed from outside "
                  "(the kernel's OOM killer, kill -9) or its node lost its network.", file=sys.stderr)
        else:
            print("lockstep: every worker here only lost a peer: a worker on another node failed first; "
                  "that node's output names it.", file=sys.stderr)
        cause = "lost a peer: " + cause
    trace = _traceback_of(failure.error_file_data)
    if trace:
        print(trace, file=sys.stderr)
        cause += f": {trace.splitlines()[-1][:200]}"
    sys.stderr.flush()
    return cause


def _root_cause(failures: dict[int, Any]) -> tuple[int, Any]:
    """The failure that caused the others: not a lost-peer error, then the earliest.

    Timestamps are whole seconds, so ties are common; the agent records failures in the order it
    saw them (the real ones first, then the workers it stopped), and that order breaks the tie.
    """
    order = {rank: position for position, rank in enumerate(failures)}

    def key(item: tuple[int, Any]) -> tuple[bool, int, int]:
        rank, failure = item
        return _lost_a_peer(failure), failure.timestamp, order[rank]

    return min(failures.items(), key=key)


_ENDED_RANKS = re.compile(r"Ranks? ([0-9, ]+) ended the script while this rank still waits")


def _ended_by_report(failures: dict[int, Any]) -> set[int]:
    """The ranks that a failed rank's own report says ended the script (closed their Runtime) while it
    waited in a collective (``Watchdog``'s report, read from the rank's traceback)."""
    ended: set[int] = set()
    for failure in failures.values():
        found = _ENDED_RANKS.search(_traceback_of(failure.error_file_data) or str(failure.message))
        if found is not None:
            ended.update(int(r) for r in found.group(1).split(",") if r.strip())
    return ended


def _preempted(failures: dict[int, Any]) -> bool:
    """Whether the workers ended for a preemption: one stopped itself with ``PREEMPTED_EXIT`` after the
    checkpoint, and the others did too, lost a peer that did, or were stopped by the agent meanwhile."""
    codes = [failure.exitcode for failure in failures.values()]
    stopped = (PREEMPTED_EXIT, -signal.SIGTERM, -signal.SIGKILL)
    return PREEMPTED_EXIT in codes and all(f.exitcode in stopped or _lost_a_peer(f) for f in failures.values())


def _lost_a_peer(failure: Any) -> bool:
    return lost_a_peer(_traceback_of(failure.error_file_data) or str(failure.message))


def _traceback_of(data: object) -> str:
    try:
        extra = data["message"]["extraInfo"]  # type: ignore[index]
        return str(extra.get("py_callstack", "")).rstrip()
    except (KeyError, TypeError):
        return ""


def self_launch(nproc: int) -> NoReturn:
    """Re-run this script as ``nproc`` workers on this node, then exit with their status.

    The calling process becomes the agent: it never returns to the script.
    """
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":
        target = ["-m", spec.name.removesuffix(".__main__")]
    elif isinstance(script := getattr(main, "__file__", None), str) and os.path.isfile(script):
        target = [os.path.abspath(script)]
    elif isinstance(script, str):  # `python - < train.py`: <stdin>
        raise StateError(f"asked for {nproc} processes from a script read from {script}, which its workers "
                         "cannot read again: save it to a file and run that, or use "
                         f"lockstep.launch(fn, nprocs={nproc}).")
    else:
        raise StateError(
            f"asked for {nproc} processes from an interactive session: use "
            f"lockstep.launch(fn, nprocs={nproc}), which works in notebooks."
        )
    os.environ.setdefault("OMP_NUM_THREADS", str(threads_per_process(nproc)))
    store, port = host_store("127.0.0.1")
    args = ["--nnodes", "1", "--nproc-per-node", str(nproc), "--max-restarts", "0",
            "--monitor-interval", "0.1", "--rdzv-backend", "static", "--master-addr", "127.0.0.1",
            "--master-port", str(port), "--node-rank", "0", *target, *sys.argv[1:]]
    sys.stdout.flush()
    with forked_workers(ForkServer.start()):  # one import of torch for the workers, not one each
        code = run_elastic(args)
    del store
    sys.exit(code)
