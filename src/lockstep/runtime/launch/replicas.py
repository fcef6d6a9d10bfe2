"""``lockstep run --fault-tolerant``: the lighthouse (torchft's), hosted by the launcher, and the
supervisor that runs each replica group as its own ``lockstep run`` and starts a replacement when
one dies, while the others train on."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass

from lockstep.env.fault_tolerance import (
    ENV_GROUP,
    ENV_LIGHTHOUSE,
    ENV_MIN_REPLICAS,
    ENV_ON,
    ENV_START_WITH,
    ENV_STEP_TIMEOUT,
    FaultTolerance,
    import_torchft,
)
from lockstep.errors import PreflightError
from lockstep.runtime.faults.lifetime import on_parent_death


class Lighthouse:
    """torchft's lighthouse, which forms the quorum of live replica groups; ``lockstep run
    --fault-tolerant`` hosts one in its agent. ``address`` is what each group's
    ``LOCKSTEP_LIGHTHOUSE`` says."""

    def __init__(self, config: FaultTolerance, host: str = "127.0.0.1", port: int = 0) -> None:
        import_torchft()
        from torchft.coordination import LighthouseServer  # torchft's public name for it

        timeouts = config.timeouts()
        try:
            self._server = LighthouseServer(bind=f"{host}:{port}", min_replicas=config.min_replicas,
                                            join_timeout_ms=int(timeouts.join * 1000), quorum_tick_ms=20,
                                            heartbeat_timeout_ms=int(timeouts.heartbeat * 1000))
        except RuntimeError as error:  # torchft says what the socket said, without the address
            raise PreflightError(f"the lighthouse cannot listen on {host}:{port} ({error}): the port is in use by "
                                 "another program or the address is not this node's; pick a free --master port, "
                                 "or leave --master out on a single node.") from None
        bound_port = self._server.address().rsplit(":", 1)[1]
        self.address = f"http://{host if host not in ('0.0.0.0', '::', '[::]') else '127.0.0.1'}:{bound_port}"

    def shutdown(self) -> None:
        self._server.shutdown()


#: A group's exit status when SIGINT or SIGTERM stopped it (its agent exits with 128 + the signal).
_STOPPED = {-signal.SIGINT, -signal.SIGTERM, 128 + signal.SIGINT, 128 + signal.SIGTERM}


def _how(code: int) -> str:
    return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


@dataclass
class ReplicaGroupsRun:
    """``lockstep run --fault-tolerant``'s supervisor: ``replicas`` groups, each ``lockstep run`` of its
    own (``group_command(index)``, its own rendezvous and agent); a group that ends in failure is
    started again (a replacement, which heals from a live group) up to ``max_restarts`` times, while
    the others train on. Once a group ends well the training is done: no replacement is started any
    more, and a group still running a step timeout later is stopped. Returns 0 when a group ended
    well, else 1."""

    groups: range  # this node's groups' indices
    group_command: Callable[[int], list[str]]
    group_environment: Callable[[int], dict[str, str]]
    config: FaultTolerance
    max_restarts: int
    say: Callable[[str], None]
    lighthouse: tuple[str, int] = ("127.0.0.1", 0)  # where it listens (port 0: a free one)
    hosts_lighthouse: bool = True  # False: another node (node 0) hosts it at ``lighthouse``
    group_address: str = "127.0.0.1"  # where each group's store, torchft manager and rendezvous listen

    def run(self) -> int:
        house = Lighthouse(self.config, *self.lighthouse) if self.hosts_lighthouse else None
        address = house.address if house is not None else "http://{}:{}".format(*self.lighthouse)
        self.say(f"fault tolerance: replica groups {list(self.groups)} here, lighthouse at {address}, at least "
                 f"{self.config.min_replicas} live, step timeout {self.config.step_timeout:g} s; each group's "
                 f"store, torchft manager and rendezvous listen on {self.group_address} only (unauthenticated: "
                 "docs/reliability.md)")
        running: dict[int, subprocess.Popen[bytes]] = {}
        restarts = dict.fromkeys(self.groups, 0)
        failed: dict[int, int] = {}
        finished_at: float | None = None  # when the first group ended well: the training is done
        previous = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            for index in self.groups:
                running[index] = self._start(index, address)
            while running:
                time.sleep(0.1)
                if finished_at is not None and time.monotonic() - finished_at > self.config.step_timeout:
                    self.say(f"fault tolerance: the training is done; stopping replica group(s) {sorted(running)}, "
                             "which did not end with it")
                    break
                ended = {index: code for index, proc in running.items() if (code := proc.poll()) is not None}
                for index, code in ended.items():
                    del running[index]
                    if code == 0:
                        finished_at = finished_at or time.monotonic()
                    elif restarts[index] < self.max_restarts and finished_at is None and code not in _STOPPED:
                        restarts[index] += 1
                        self.say(f"fault tolerance: replica group {index} ended ({_how(code)}); starting a "
                                 f"replacement ({restarts[index]} of {self.max_restarts})")
                        running[index] = self._start(index, address, replacement=True)
                    elif finished_at is None:
                        failed[index] = code
                        self._say_ended(index, code)
        except KeyboardInterrupt:
            self.say("fault tolerance: stopped; stopping the replica groups")
            failed.update(dict.fromkeys(running, 1))
        finally:
            signal.signal(signal.SIGTERM, previous)
            _stop(list(running.values()))
            if house is not None:
                house.shutdown()
        return 0 if finished_at is not None or not failed else 1

    def _say_ended(self, index: int, code: int) -> None:
        """A group that ended for good: stopped from outside (SIGINT, SIGTERM: the job is stopped with it), or
        failed with no restart left."""
        if code in _STOPPED:
            self.say(f"fault tolerance: replica group {index} was stopped ({_how(code)}); stopping the job")
            raise KeyboardInterrupt
        self.say(f"fault tolerance: replica group {index} ended ({_how(code)}), no restart left "
                 f"(--max-restarts {self.max_restarts})")

    def _start(self, index: int, lighthouse: str, replacement: bool = False) -> subprocess.Popen[bytes]:
        """A group of the job: its first quorum waits for the job's every group (``config.start_with``);
        a replacement's, for one live group to heal from."""
        start_with = min(2, self.config.start_with) if replacement else self.config.start_with
        environment = {**os.environ, **self.group_environment(index), ENV_ON: "1", ENV_GROUP: str(index),
                       ENV_LIGHTHOUSE: lighthouse, ENV_MIN_REPLICAS: str(self.config.min_replicas),
                       ENV_STEP_TIMEOUT: str(self.config.step_timeout), ENV_START_WITH: str(start_with)}
        # the agent gets SIGTERM when the supervisor dies (it then stops its workers, which also die with it)
        dies_with_supervisor = functools.partial(on_parent_death, signal.SIGTERM, os.getpid())
        return subprocess.Popen(self.group_command(index), env=environment, preexec_fn=dies_with_supervisor)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _stop(procs: list[subprocess.Popen[bytes]], grace_s: float = 10.0) -> None:
    """SIGTERM (each agent stops its workers), then SIGKILL after ``grace_s``."""
    for proc in procs:
        proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
