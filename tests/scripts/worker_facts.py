"""Writes what a worker sees of its start to FOLDER/RANK.json: its arguments, ``__main__``, import path, threads,
environment, standard input; its parent's command line apart (a fork server's worker, or not); and its first
unseeded draws of torch, Python and numpy, apart."""

import json
import os
import random
import sys

import numpy
import torch

rank = os.environ["RANK"]


def blas_threads() -> int | None:
    """The threads of numpy's OpenBLAS (None where it is not found)."""
    import ctypes

    with open("/proc/self/maps") as maps:
        libraries = {line.split()[-1] for line in maps if "openblas" in line.lower() and "/" in line}
    for library in libraries:
        for name in ("scipy_openblas_get_num_threads64_", "openblas_get_num_threads"):
            if hasattr(ctypes.CDLL(library), name):
                return int(getattr(ctypes.CDLL(library), name)())
    return None


facts = {"argv": sys.argv, "orig_argv": sys.orig_argv, "name": __name__, "file": __file__, "path0": sys.path[0],
         "cwd": os.getcwd(), "streams": [(stream.encoding.lower(), stream.errors)
                                         for stream in (sys.stdin, sys.stdout, sys.stderr)],
         "threads": torch.get_num_threads(), "blas_threads": blas_threads(), "omp": os.environ.get("OMP_NUM_THREADS"),
         "python_exec": os.environ.get("PYTHON_EXEC"), "world": os.environ["WORLD_SIZE"],
         "stdin": sys.stdin.readline() if rank == "0" else "", "session": os.getsid(0) == os.getpid(),
         "stdout_tty": sys.stdout.isatty(), "main_spec": getattr(sys.modules["__main__"], "__spec__", None) is None}
with open(f"/proc/{os.getppid()}/cmdline", "rb") as parent:
    forked = b"fork_server" in parent.read()
with open(os.path.join(sys.argv[1], f"{rank}.json"), "w") as out:
    json.dump({"facts": facts, "forked": forked, "draws": [torch.initial_seed(), torch.rand(()).item(),
                                                          random.random(), numpy.random.rand()]}, out)
print(f"rank {rank} wrote its facts", end="")
print(" and ends", flush=False)
if len(sys.argv) > 2:
    sys.exit(int(sys.argv[2]))
