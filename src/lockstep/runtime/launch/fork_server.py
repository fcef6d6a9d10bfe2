"""The agent's workers, forked from one process that imported torch once.

torch's import costs 2-3 s of CPU per process (more from a shared file system): an agent that starts
8 workers pays it 8 times, after its own. ``lockstep run`` starts a server as it starts, whose import
runs beside the agent's; the agent then starts each worker as torch's launcher does, but the
interpreter it starts (``PYTHON_EXEC``, torch's own hook for it) is this module's client. The client
passes its arguments, environment, working folder and standard streams to the server over a Unix
socket in a folder only this user can enter; the server forks a worker that runs the script as
``python -u SCRIPT`` (or ``-m MODULE``) would, in a session of its own; the client passes the signals
it gets on to the worker's process group and ends as the worker ended (its exit code, or its signal).

A client killed (the agent's SIGKILL) makes the server kill its worker's group; the server ends, and
kills what is left, when the agent's end of its standard input closes (the agent ended, however);
the workers end with the server (``PR_SET_PDEATHSIG``). Anything the client does not expect (another
interpreter option, no server) makes it run the real interpreter in its place.
"""

from __future__ import annotations

import array
import contextlib
import io
import json
import os
import select
import shlex
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: the signals a client passes on to its worker (the agent's stop, a scheduler's warning, a user's)
PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_HEADER = struct.Struct("!I")
#: imported once by the server: torch's modules that lockstep's runtime and most training scripts use (none of
#: them starts CUDA, after which a forked worker could not use it), and lockstep's own
PRELOADED = ("torch.distributed", "torch.distributed.fsdp", "torch.distributed.tensor.parallel",
             "torch.distributed.checkpoint", "lockstep.runtime.runtime", "lockstep.train")
#: the servers this process runs (``stop_local_workers`` ends the workers, not their server)
SERVERS: set[int] = set()


class _Unanswered(Exception):
    """Between a client and the server: a message cut short or not as expected (never leaves this module: the
    server lets the client go, the client runs the interpreter itself)."""


class ForkServer:
    """The server of one agent: ``with forked_workers(ForkServer.start()): run_elastic(...)``."""

    def __init__(self, folder: str, process: subprocess.Popen[bytes]) -> None:
        self.folder, self.process = folder, process

    @classmethod
    def start(cls) -> ForkServer | None:
        """A server, or None where the workers are started as torchrun starts them: where the user chose their
        interpreter (``PYTHON_EXEC``), off Linux, or where the temporary folder cannot hold the client (mounted
        ``noexec``, or too deep for a Unix socket's path)."""
        if "PYTHON_EXEC" in os.environ or not sys.platform.startswith("linux"):
            return None
        folder = tempfile.mkdtemp(prefix="lockstep-workers-")  # 0700: only this user reaches the socket
        if len(os.path.join(folder, "socket")) > 100 or os.statvfs(folder).f_flag & os.ST_NOEXEC:
            os.rmdir(folder)
            return None
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # listening before any client can start
        listener.bind(os.path.join(folder, "socket"))
        listener.listen(128)
        root = str(Path(__file__).resolve().parents[3])  # where lockstep is imported from
        serve = f"import sys; sys.path[0] = {root!r}; from {__name__} import serve; serve({listener.fileno()})"
        process = subprocess.Popen([sys.executable, "-c", serve], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                   start_new_session=True, pass_fds=[listener.fileno()])
        listener.close()
        client = f"import sys; sys.path.insert(0, {root!r}); from {__name__} import client; client({folder!r})"
        shim = Path(folder, "python")
        shim.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -c {shlex.quote(client)} \"$@\"\n")
        shim.chmod(0o700)
        SERVERS.add(process.pid)
        return cls(folder, process)

    @contextlib.contextmanager
    def serving(self) -> Iterator[None]:
        """The agent's workers are this server's while inside (the interpreter the agent starts is the client);
        the server stops on leaving."""
        os.environ["PYTHON_EXEC"] = str(Path(self.folder, "python"))
        try:
            yield
        finally:
            del os.environ["PYTHON_EXEC"]
            self.stop()

    def stop(self, at_once: bool = False) -> None:
        """End the server: it kills the workers still running; ``at_once`` (no worker ever started) kills it."""
        SERVERS.discard(self.process.pid)
        if at_once:
            self.process.kill()
        if self.process.stdin is not None and not self.process.stdin.closed:
            self.process.stdin.close()  # the server kills what is left and ends
        try:  # at once where it serves; a server still importing torch has no worker to end
            self.process.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        _remove(self.folder)


def _remove(folder: str) -> None:
    for name in ("socket", "python"):
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(folder, name))
    with contextlib.suppress(OSError):
        os.rmdir(folder)


def forked_workers(server: ForkServer | None) -> contextlib.AbstractContextManager[None]:
    """The agent's workers forked from ``server`` while inside (as torchrun starts them where it is None)."""
    return server.serving() if server is not None else contextlib.nullcontext()


def serve(listening: int) -> None:
    """The server, on the listening socket its launcher made (clients wait in the backlog while it imports
    torch and lockstep's runtime): fork a worker per client until standard input closes, then kill what is
    left and remove the folder. A forked worker leaves this function by its script's ``SystemExit``, as the
    interpreter of ``python SCRIPT`` would."""
    listener = socket.socket(fileno=listening)
    folder = os.path.dirname(listener.getsockname())
    for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2"):  # a terminal's or a scheduler's signal is the
        # agent's to handle (SLURM's USR1 warning, sent to every process of the step, would end the server)
        signal.signal(getattr(signal, name), signal.SIG_IGN)
    import importlib

    import torch

    for name in PRELOADED:
        importlib.import_module(name)
    if torch.cuda.is_initialized():  # a forked worker could not use CUDA: the clients run the interpreter instead
        return
    woken, wake = os.pipe()  # a worker's end wakes the loop at once: its client ends as soon as it did
    for end in (woken, wake):
        os.set_blocking(end, False)
    signal.set_wakeup_fd(wake)
    signal.signal(signal.SIGCHLD, lambda number, frame: None)
    workers: dict[int, socket.socket] = {}  # pid -> its client's connection
    dying: set[int] = set()  # killed with their client: no worker starts until they are gone (their GPU, ports)
    while True:
        waiting = [listener] if not dying else []
        readable, _, _ = select.select([*waiting, sys.stdin, woken, *workers.values()], [], [], 1.0)
        if woken in readable:
            os.read(woken, 4096)
        dying -= _reap(workers)
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
            break
        for gone in [c for c in readable if isinstance(c, socket.socket) and c is not listener]:
            dying |= _client_gone(gone, workers)
        if listener in readable:
            _accept(listener, (listener, woken, wake), workers)
    for pid in workers:
        _kill_group(pid, signal.SIGKILL)
    _remove(folder)


def _accept(listener: socket.socket, own: tuple[socket.socket, int, int], workers: dict[int, socket.socket]) -> None:
    """A client's worker forked; a client whose request cannot be met (no fd or process left) is let go: it runs
    the interpreter itself."""
    try:
        connection, _ = listener.accept()
    except OSError:
        return
    pid = _fork_worker(connection, own, workers)
    if pid:
        workers[pid] = connection
    else:
        connection.close()


def _reap(workers: dict[int, socket.socket]) -> set[int]:
    """Tell each client whose worker ended how it ended; the pids of the workers that ended."""
    ended: set[int] = set()
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return ended
        if pid == 0:
            return ended
        ended.add(pid)
        connection = workers.pop(pid, None)
        if connection is not None:
            _send(connection, {"exit": os.waitstatus_to_exitcode(status)})
            connection.close()


def _client_gone(connection: socket.socket, workers: dict[int, socket.socket]) -> set[int]:
    """A client's connection is readable only when it closed: the client was killed; so is its worker (the
    pids killed, reaped by a later waitpid)."""
    killed = {pid for pid, held in workers.items() if held is connection}
    for pid in killed:
        _kill_group(pid, signal.SIGKILL)
        del workers[pid]
    connection.close()
    return killed


def _kill_group(pid: int, number: int) -> None:
    try:
        os.killpg(pid, number)
    except (ProcessLookupError, PermissionError):
        pass


def _fork_worker(connection: socket.socket, own: tuple[socket.socket, int, int],
                 workers: dict[int, socket.socket]) -> int:
    """Fork the worker a client asks for; its pid (0 where the request was not readable or no process could be
    made). ``own``: the server's listener and its wake-up pipe, closed in the worker."""
    try:
        request, streams = _receive(connection)
    except (OSError, ValueError, _Unanswered):
        return 0
    server = os.getpid()
    try:
        pid = os.fork()
    except OSError:  # no process left to make: the client runs the interpreter itself
        pid = -1
    if pid:
        for stream in streams:
            os.close(stream)
        return max(pid, 0)
    listener, woken, wake = own
    folder = os.path.dirname(listener.getsockname())
    signal.set_wakeup_fd(-1)
    for held in (listener, *workers.values()):
        held.close()
    os.close(woken)
    os.close(wake)
    _become_worker(request, streams, folder, connection, server)  # never returns
    return 0


def _become_worker(request: dict[str, Any], streams: list[int], folder: str, connection: socket.socket,
                   server: int) -> None:
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD):  # the server's, undone first
        signal.signal(number, signal.default_int_handler if number == signal.SIGINT else signal.SIG_DFL)
    os.setsid()  # its own process group, as the agent's Popen(start_new_session=True) gives
    from lockstep.runtime.faults.lifetime import on_parent_death

    on_parent_death(signal.SIGKILL, server)
    _send(connection, {"pid": os.getpid()})  # from here a signal the client passes on reaches the script
    connection.close()
    for standard, stream in enumerate(streams):
        os.dup2(stream, standard)
        os.close(stream)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if os.path.dirname(os.environ.get("PYTHON_EXEC", "")) == folder:  # the agent's, not the script's
        del os.environ["PYTHON_EXEC"]
    sys.stdin = sys.__stdin__ = _text(0, "r", sys.__stdin__)  # type: ignore[misc]
    sys.stdout = sys.__stdout__ = _text(1, "w", sys.__stdout__)  # type: ignore[misc]
    sys.stderr = sys.__stderr__ = _text(2, "w", sys.__stderr__)  # type: ignore[misc]
    _match_threads()
    from lockstep.runtime.seed import draw_fresh_seeds

    draw_fresh_seeds()
    from lockstep.env.lines import whole_lines

    whole_lines()  # what `import lockstep` does in a rank: its lines whole, with the prefix and ranks asked for
    module, target, args = request["module"], request["target"], request["args"]
    sys.argv = [target, *args]
    sys.orig_argv = [sys.executable, "-u", *(["-m"] if module else []), target, *args]  # not the server's
    sys.path[0] = os.getcwd() if module else os.path.dirname(os.path.realpath(target))  # was the server's root
    try:
        _run(module, target)
    except SystemExit:
        raise
    except BaseException as error:  # noqa: BLE001  # what `python SCRIPT` prints: the traceback from the script's frame on
        trace = error.__traceback__
        while trace is not None and trace.tb_frame.f_code.co_filename in (__file__, "<frozen runpy>"):
            trace = trace.tb_next
        error = error.with_traceback(trace or error.__traceback__)
        if isinstance(error, KeyboardInterrupt):
            raise error from None  # the interpreter ends by SIGINT, as it would have
        sys.last_type, sys.last_value, sys.last_traceback = type(error), error, error.__traceback__  # as python
        sys.excepthook(type(error), error, error.__traceback__)
        raise SystemExit(1) from None
    raise SystemExit(0)


def _run(module: bool, target: str) -> None:
    """Run the script (or ``-m`` module) as ``__main__``, as the interpreter does: the module as ``python -m`` runs
    it; a file's ``__file__`` absolute and ``sys.argv[0]`` as given."""
    import runpy

    path = os.path.abspath(target)
    if module:
        import types

        sys.modules["__main__"] = types.ModuleType("__main__")  # not the server's: the module runs in its own
        runpy._run_module_as_main(target, alter_argv=True)  # type: ignore[attr-defined]  # what `-m` calls
    elif not os.path.isfile(path) or zipfile.is_zipfile(path):  # a folder or an archive with a __main__.py
        runpy.run_path(target, run_name="__main__")
    else:
        import builtins
        import importlib.machinery
        import types

        main = types.ModuleType("__main__")
        main.__dict__.update(__file__=path, __builtins__=builtins, __spec__=None, __cached__=None,
                             __loader__=importlib.machinery.SourceFileLoader("__main__", path))
        sys.modules["__main__"] = main
        with open(path, "rb") as source:
            code = compile(source.read(), path, "exec", dont_inherit=True)
        exec(code, main.__dict__)


def _match_threads() -> None:
    """The thread count torch read from ``OMP_NUM_THREADS`` at its import, set again from the worker's."""
    import torch

    value = os.environ.get("OMP_NUM_THREADS", "")
    if not (value.isdigit() and int(value) > 0):
        return
    torch.set_num_threads(int(value))
    import ctypes

    with open("/proc/self/maps") as maps:  # numpy's OpenBLAS (torch imports numpy) read it at its load too
        libraries = {line.split()[-1] for line in maps if "openblas" in line.lower() and "/" in line}
    for library in libraries:
        with contextlib.suppress(OSError):
            loaded = ctypes.CDLL(library)
            for name in ("openblas_set_num_threads", "scipy_openblas_set_num_threads64_",
                         "openblas_set_num_threads64_", "scipy_openblas_set_num_threads"):
                if hasattr(loaded, name):
                    getattr(loaded, name)(ctypes.c_int(int(value)))
                    break


def _text(fd: int, mode: str, like: Any) -> io.TextIOWrapper:
    """A standard stream as ``python -u`` makes it: unbuffered bytes under the text, written through, with the
    encoding and error handler the interpreter chose for the server's own stream ``like`` (from the locale and
    ``PYTHONIOENCODING``, which the agent leaves as they were)."""
    raw = io.FileIO(fd, mode, closefd=False)
    encoding = getattr(like, "encoding", None)
    errors = getattr(like, "errors", None) or ("backslashreplace" if fd == 2 else None)
    if mode == "r":
        return io.TextIOWrapper(io.BufferedReader(raw), encoding=encoding, errors=errors)
    return io.TextIOWrapper(raw, write_through=True, encoding=encoding, errors=errors)


def _send(connection: socket.socket, message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    try:
        connection.sendall(_HEADER.pack(len(data)) + data)
    except OSError:
        pass


def _read_exactly(connection: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise _Unanswered("the connection closed")
        data += chunk
    return data


def _receive(connection: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """A client's request and the three standard streams it passed."""
    connection.settimeout(10)
    message, ancillary, _, _ = connection.recvmsg(_HEADER.size, socket.CMSG_SPACE(3 * 4))
    streams: list[int] = []
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            streams += array.array("i", data[: len(data) - len(data) % 4]).tolist()
    if len(message) != _HEADER.size or len(streams) != 3:
        for stream in streams:
            os.close(stream)
        raise _Unanswered("not a client's request")
    (size,) = _HEADER.unpack(message)
    request = json.loads(_read_exactly(connection, size))
    connection.settimeout(None)
    return request, streams


def _parse(argv: list[str]) -> tuple[bool, str, list[str]] | None:
    """``-u [-m] TARGET ARGS`` (what torch's agent passes its interpreter); None for anything else."""
    if len(argv) < 2 or argv[0] != "-u":
        return None
    if argv[1] == "-m":
        return (True, argv[2], argv[3:]) if len(argv) > 2 else None
    return (False, argv[1], argv[2:]) if not argv[1].startswith("-") else None


def client(folder: str) -> None:
    """The interpreter the agent starts: the server's worker in its place, or the real one."""
    parsed = _parse(sys.argv[1:])
    pending: list[int] = []
    worker: list[int] = []

    def pass_on(number: int, frame: object) -> None:
        if worker:
            _kill_group(worker[0], number)
        else:
            pending.append(number)

    for number in PASSED_ON:
        signal.signal(number, pass_on)
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        if parsed is None:
            raise _Unanswered("not a script's command line")
        connection.connect(os.path.join(folder, "socket"))
        module, target, args = parsed
        data = json.dumps({"module": module, "target": target, "args": args, "cwd": os.getcwd(),
                           "env": dict(os.environ)}).encode()
        connection.sendmsg([_HEADER.pack(len(data))], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                                        array.array("i", [0, 1, 2]))])
        connection.sendall(data)
        worker.append(_answer(connection)["pid"])
    except (OSError, ValueError, KeyError, _Unanswered):
        if pending:  # stopped before any worker started: nothing to run
            _end_as(-pending[0])
        os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
    for waiting in pending:
        _kill_group(worker[0], waiting)
    try:
        code = int(_answer(connection)["exit"])
    except (OSError, ValueError, KeyError, _Unanswered):
        code = 1  # the server ended before its worker did
    _end_as(code)


def _end_as(code: int) -> None:
    """Exit with ``code``; a negative one, by that signal (without a core file of the client's own), as the
    worker ended, for the agent's report."""
    if code < 0:
        import resource

        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        with contextlib.suppress(OSError, ValueError):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code  # a signal that does not end a process (SIGPIPE ignored ...): as a shell says it
    os._exit(code)


def _answer(connection: socket.socket) -> dict[str, Any]:
    while True:
        try:
            (size,) = _HEADER.unpack(_read_exactly(connection, _HEADER.size))
            return dict(json.loads(_read_exactly(connection, size)))
        except InterruptedError:
            continue
