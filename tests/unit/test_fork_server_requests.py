"""The fork server's own edges (runtime/launch/fork_server.py), without a launch: what it does with a request it
cannot meet, and which command lines its client takes over."""

from __future__ import annotations

import array
import errno
import json
import os
import socket
import sys

import pytest

from lockstep.runtime.launch import fork_server

pytestmark = [pytest.mark.timeout(30), pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux")]


def _request(streams: list[int]) -> tuple[socket.socket, socket.socket]:
    """A client's request, as ``client`` sends it, waiting on the server's end of a socket pair."""
    server_end, client_end = socket.socketpair()
    data = json.dumps({"module": False, "target": "train.py", "args": [], "cwd": "/", "env": {}}).encode()
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", streams))] if streams else []
    client_end.sendmsg([fork_server._HEADER.pack(len(data))], ancillary)
    client_end.sendall(data)
    return server_end, client_end


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_a_fork_that_fails_lets_the_client_go_and_keeps_none_of_its_streams(monkeypatch):
    streams = [os.open(os.devnull, os.O_RDONLY) for _ in range(3)]
    server_end, client_end = _request(streams)
    for stream in streams:
        os.close(stream)
    before = _open_fds()

    def no_fork() -> int:
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    monkeypatch.setattr(os, "fork", no_fork)
    assert fork_server._fork_worker(server_end, None, {}) == 0  # type: ignore[arg-type]  # this process goes on
    assert _open_fds() <= before  # the three streams it received were closed again
    server_end.close()
    client_end.close()


def test_a_request_without_the_three_streams_is_not_forked(monkeypatch):
    server_end, client_end = _request([])
    monkeypatch.setattr(os, "fork", lambda: pytest.fail("forked for a request that is not a client's"))
    assert fork_server._fork_worker(server_end, None, {}) == 0  # type: ignore[arg-type]
    server_end.close()
    client_end.close()


def test_the_client_takes_over_only_the_command_lines_torchs_agent_gives_its_interpreter():
    assert fork_server._parse(["-u", "train.py", "--lr", "1"]) == (False, "train.py", ["--lr", "1"])
    assert fork_server._parse(["-u", "-m", "package.train", "-x"]) == (True, "package.train", ["-x"])
    for other in (["train.py"], ["-u"], ["-u", "-m"], ["-u", "-X", "dev", "train.py"], ["-c", "print(1)"]):
        assert fork_server._parse(other) is None, other  # the real interpreter runs these
