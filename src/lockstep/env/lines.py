"""Every rank's printed lines whole: the ranks of a job share one terminal (or one pipe, or one log file), and
Python writes a redirected stdout in blocks of 8 KB, cut anywhere, so two ranks' lines merge into one.

In a process of a job of several ranks (``WORLD_SIZE`` > 1, as every launcher sets it), ``import lockstep``
makes stdout write at each line's end, a line in one write (a write of up to 4 KB to a pipe is never
interleaved with another process's). Two choices, set by ``lockstep run --rank-prefix --show-ranks 0,3`` or
by the variables themselves under any launcher:

- ``LOCKSTEP_RANK_PREFIX=1``: each line of stdout and stderr begins with ``[rank N] ``;
- ``LOCKSTEP_SHOW_RANKS=0,3``: only these ranks' stdout is shown (stderr, with warnings and tracebacks, comes
  from every rank).
"""

from __future__ import annotations

import io
import os
import re
import sys
from collections.abc import Mapping

from lockstep.errors import ConfigError

PREFIX_VARIABLE = "LOCKSTEP_RANK_PREFIX"
SHOW_VARIABLE = "LOCKSTEP_SHOW_RANKS"
_PIECES = re.compile(rb"[^\r\n]*(?:\r\n|\n|\r)|[^\r\n]+")


def printable(text: object, limit: int, lines: bool = False) -> str:
    """Text another process, the store or a file gave, as lockstep quotes it: its first ``limit`` characters,
    less those that are not printable (a terminal's escapes, line breaks unless ``lines``)."""
    return "".join(c for c in str(text)[:limit] if c.isprintable() or (lines and c == "\n"))


def shown_ranks(value: str, given_as: str = SHOW_VARIABLE) -> frozenset[int]:
    """The ranks of ``--show-ranks`` / ``LOCKSTEP_SHOW_RANKS``: whole numbers, separated by commas."""
    try:
        ranks = frozenset(int(part) for part in value.split(",") if part.strip())
    except ValueError:
        ranks = frozenset({-1})
    if not ranks or min(ranks) < 0:
        raise ConfigError(f"{given_as} {value!r}: give the ranks whose output to show as whole numbers separated "
                          "by commas, e.g. 0 or 0,3.")
    return ranks


class _Lines(io.RawIOBase):
    """A file descriptor written to with each line begun with ``prefix`` (the buffer above hands it whole
    lines: one ``os.write`` each time)."""

    def __init__(self, fd: int, prefix: bytes) -> None:
        super().__init__()
        self._fd, self._prefix, self._at_start = fd, prefix, True

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return os.isatty(self._fd)

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        raw = bytes(data)
        out = bytearray()
        for piece in _PIECES.findall(raw):  # a line, or what a carriage return starts again (a progress bar)
            if self._at_start:
                out += self._prefix
            out += piece
            self._at_start = piece.endswith((b"\n", b"\r"))
        view = memoryview(bytes(out))
        while view:
            view = view[os.write(self._fd, view):]
        return len(raw)


def _lined(stream: io.TextIOWrapper, prefix: str) -> io.TextIOWrapper:
    """A stream in place of ``stream`` that writes each line in one go (also under ``python -u`` or
    ``PYTHONUNBUFFERED``, where every piece of a ``print`` is a write of its own), begun with ``prefix``."""
    try:
        fd = stream.fileno()
    except (OSError, ValueError):  # not a real file (a notebook's, a test runner's capture): left as it is
        return stream
    stream.flush()
    raw = _Lines(fd, prefix.encode())
    return io.TextIOWrapper(io.BufferedWriter(raw),  # type: ignore[type-var]
                            encoding=stream.encoding, errors=stream.errors,
                            line_buffering=True)


def whole_lines(environ: Mapping[str, str] | None = None) -> None:
    """In a rank of a job of several: stdout written a line at a time, with the prefix and the ranks shown
    that the variables ask for. Does nothing in a lone process, or where stdout is not a real file."""
    env = os.environ if environ is None else environ
    try:
        world, rank = int(env.get("WORLD_SIZE", "1")), int(env.get("RANK", "0"))
    except ValueError:
        return
    if world < 2:
        return
    show = env.get(SHOW_VARIABLE, "").strip()
    prefix = f"[rank {rank}] " if env.get(PREFIX_VARIABLE, "") == "1" else ""
    if show and rank not in shown_ranks(show):
        sys.stdout.flush()
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - this process's stdout from now on
    elif isinstance(sys.stdout, io.TextIOWrapper) and sys.stdout is sys.__stdout__:
        sys.stdout = _lined(sys.stdout, prefix)
    if isinstance(sys.stderr, io.TextIOWrapper) and sys.stderr is sys.__stderr__:
        sys.stderr = _lined(sys.stderr, prefix)
