"""``lockstep doctor``: what a user needs to see when distributed training misbehaves."""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from typing import Any

from lockstep.env import DistEnv, EnvError, job_secret_from_environ
from lockstep.runtime.comm.network import interfaces


def add_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = commands.add_parser(
        "doctor", help="show torch, CUDA, NCCL, GPUs, launcher, network; --bench measures matmul and all-reduce",
        description="Print versions, devices, the launcher environment, network interfaces and "
        "problems lockstep can spot. With --bench, measure one device's matmul peak (recorded for the "
        "Trainer's MFU), then time an all-reduce over the local GPUs (or N CPU processes) and report "
        "algorithm and bus bandwidth per message size, as nccl-tests do.",
    )
    parser.add_argument("--bench", action="store_true", help="run the matmul and all-reduce benchmarks")
    parser.add_argument("--devices", type=int, default=None,
                        help="processes for --bench (default: every GPU, or 2 CPU processes)")
    parser.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--max-bytes", type=_byte_count, default="64M",
                        help="largest message for --bench (e.g. 1M, 64M; at least 1K)")
    parser.add_argument("--iters", type=_positive, default=20, help="timed all-reduces per size")
    parser.set_defaults(func=doctor_command)


def gloo_interface(found: dict[str, str | None]) -> str:
    """What Gloo uses: GLOO_SOCKET_IFNAME, else the interface holding this host name's address."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return f"{os.environ['GLOO_SOCKET_IFNAME']} (GLOO_SOCKET_IFNAME)"
    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        return "unknown: this host name does not resolve (set GLOO_SOCKET_IFNAME)"
    owner = next((name for name, ip in found.items() if ip == address), None)
    return f"{owner or '?'} ({socket.gethostname()} resolves to {address})"


def nccl_interface(found: dict[str, str | None]) -> str:
    """What NCCL picks by default: NCCL_SOCKET_IFNAME, else the first interface not lo or docker."""
    if os.environ.get("NCCL_SOCKET_IFNAME"):
        return f"{os.environ['NCCL_SOCKET_IFNAME']} (NCCL_SOCKET_IFNAME)"
    for name, ip in found.items():
        if ip and name != "lo" and not name.startswith("docker"):
            return f"{name} ({ip})"
    return "lo (no other interface with an address: multi-node NCCL cannot work)"


def problems(env: DistEnv | None, found: dict[str, str | None]) -> list[str]:
    seen = []
    master = os.environ.get("MASTER_ADDR")
    if master:
        try:
            socket.getaddrinfo(master, None)
        except OSError:
            seen.append(f"MASTER_ADDR={master} does not resolve: use an address or a name in /etc/hosts.")
    port = os.environ.get("MASTER_PORT")
    if port and port.isdigit() and (env is None or env.rank == 0):
        with socket.socket() as sock:
            try:
                sock.bind(("", int(port)))
            except OSError:
                seen.append(f"MASTER_PORT={port} is in use on this host (fine only if your job's rank 0 "
                            "already holds it).")
    try:
        if socket.gethostbyname(socket.gethostname()).startswith("127.") and not os.environ.get("GLOO_SOCKET_IFNAME"):
            seen.append(f"{socket.gethostname()} resolves to a loopback address: Gloo by itself would use lo. "
                        "On several nodes the Runtime and lockstep run set GLOO_SOCKET_IFNAME to the interface "
                        "that reaches the master; a process group made without them needs it set by hand.")
    except OSError:
        pass
    if not any(ip and name != "lo" for name, ip in found.items()):
        seen.append("no network interface besides loopback has an IPv4 address: single-node only.")
    return seen


def copy_bandwidth(index: int, size: int = 256 * 2**20, repeats: int = 5) -> tuple[float, float]:
    """GB/s of pinned host->device and device->host copies on GPU ``index`` (best of ``repeats``)."""
    import torch

    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(size, dtype=torch.uint8, device=f"cuda:{index}")
    rates = []
    for target, source in ((device, host), (host, device)):
        best = float("inf")
        for _ in range(repeats):
            torch.cuda.synchronize(index)
            start = time.perf_counter()
            target.copy_(source, non_blocking=True)
            torch.cuda.synchronize(index)
            best = min(best, time.perf_counter() - start)
        rates.append(size / best / 1e9)
    return rates[0], rates[1]


def exposure(env: DistEnv | None) -> list[str]:
    """Who can reach this job's ports, and whether the launchers' messages are signed."""
    master = f"{env.master_addr}:{env.master_port or 'PORT'}" if env is not None else "MASTER_ADDR:PORT"
    one_node = env is None or env.num_nodes == 1
    where = ("loopback only (one node)" if one_node
             else f"the address {env.master_addr if env else 'MASTER_ADDR'} names, on its interface only")
    if job_secret_from_environ() is None:
        signed = "NOT signed: set LOCKSTEP_JOB_SECRET to the same random value on every node"
    else:
        signed = f"signed with {'LOCKSTEP_JOB_SECRET' if os.environ.get('LOCKSTEP_JOB_SECRET') else 'the SLURM job id'}"
    return [
        f"rendezvous store {master}: listens on {where}",
        "the store and the Gloo/NCCL ports take commands from anyone who reaches them (torch has no "
        "authentication): let only the job's hosts reach them (a private network or firewall)",
        f"messages that stop nodes (lockstep run --nodes): {signed}",
    ]


def report() -> str:
    import torch
    import torch.distributed as dist

    lines = ["lockstep doctor", "", "software"]
    lines.append(f"  python {sys.version.split()[0]}, torch {torch.__version__}")
    cuda = torch.cuda.is_available()
    lines.append(f"  CUDA: {'available, version ' + str(torch.version.cuda) if cuda else 'not available'}")
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda and dist.is_nccl_available() else "not available"
    lines.append(f"  NCCL: {nccl}; Gloo: {'yes' if dist.is_gloo_available() else 'no'}; "
                 f"MPI: {'yes' if dist.is_mpi_available() else 'no'}")
    lines += ["", "devices"]
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines.append(f"  CPUs usable: {cpus}")
    lines.append(f"  CUDA_VISIBLE_DEVICES: {os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}")
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        to_gpu, to_host = copy_bandwidth(index)
        lines.append(f"  GPU {index}: {props.name}, {props.total_memory / 2**30:.1f} GiB; pinned copies "
                     f"host->device {to_gpu:.1f} GB/s, device->host {to_host:.1f} GB/s")
    if not cuda:
        lines.append("  GPUs: none visible")
    lines += ["", "launcher environment"]
    env: DistEnv | None
    try:
        env = DistEnv.from_environ(argv=[])
        lines.append(f"  {env.launcher}: rank {env.rank} of {env.world_size}, local rank {env.local_rank} of "
                     f"{env.local_world_size}, node {env.node_rank} of {env.num_nodes}, master "
                     f"{env.master_addr}:{env.master_port}")
    except EnvError as error:
        env = None
        lines.append(f"  inconsistent: {error}")
    found = interfaces()
    lines += ["", "network"]
    for name, ip in found.items():
        lines.append(f"  {name}: {ip or '(no IPv4 address)'}")
    lines.append(f"  Gloo would use: {gloo_interface(found)}")
    lines.append(f"  NCCL would use: {nccl_interface(found)}")
    lines += ["", "security"] + [f"  {line}" for line in exposure(env)]
    seen = problems(env, found)
    lines += ["", "problems"] + ([f"  - {p}" for p in seen] or ["  none found"])
    return "\n".join(lines)


def _parse_bytes(text: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    text = text.strip().upper().removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _byte_count(text: str) -> int:
    """``--max-bytes``, checked before any benchmark runs: a size of at least 1 KiB (the smallest message)."""
    try:
        count = _parse_bytes(text)
    except ValueError:
        count = 0
    if count < 2**10:
        raise argparse.ArgumentTypeError(f"{text!r}: give a size of at least 1K, e.g. 1M or 64M")
    return count


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number, at least 1")
    return int(text)


def bench_all_reduce(max_bytes: int, iters: int, accelerator: str) -> list[tuple[int, float, float, float]]:
    """On every rank: (bytes, median seconds, algbw GB/s, busbw GB/s) per size, 1 KiB to max_bytes, x4 steps."""
    import torch
    import torch.distributed as dist
    from rich.progress import Progress

    import lockstep

    rt = lockstep.Runtime(accelerator=accelerator)
    sizes = [2**k for k in range(10, 40, 2) if 2**k <= max_bytes]
    rows = []
    with Progress(disable=not rt.is_global_zero, transient=True) as progress:
        task = progress.add_task("all-reduce", total=len(sizes))
        for size in sizes:
            tensor = torch.ones(size // 4, dtype=torch.float32, device=rt.device)
            for _ in range(2):  # warm-up
                dist.all_reduce(tensor)
            times = []
            for _ in range(iters):
                if rt.device.type == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                dist.all_reduce(tensor)
                if rt.device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            seconds = rt.all_reduce(statistics.median(times), op="max")
            algbw = size / seconds / 1e9
            busbw = algbw * 2 * (rt.world_size - 1) / rt.world_size  # what each link carries (nccl-tests)
            rows.append((size, seconds, algbw, busbw))
            progress.advance(task)
    return rows


def bench_matmul(device: Any) -> None:
    """Measure and record this device's matmul peak per dtype, which the Trainer's MFU then uses."""
    from lockstep.train.flops import MEASURED_DTYPES, device_name, measure_matmul_peak, record_measured_peaks

    rates = {key: measure_matmul_peak(device, dtype) for key, dtype in MEASURED_DTYPES.items()}
    path = record_measured_peaks(device, rates)
    print(f"\nmatmul peak on {device_name(device)}, best of 5 square products:")
    for key, rate in rates.items():
        print(f"  {key}: {rate / 1e12:.3f} TFLOP/s")
    print(f"  recorded in {path}: the Trainer's MFU uses it for this device unless the peak table or "
          "LOCKSTEP_PEAK_FLOPS gives one")


def doctor_command(args: argparse.Namespace) -> int:
    print(report())
    if not args.bench:
        return 0
    import torch

    import lockstep

    gpus = torch.cuda.device_count() if args.accelerator in ("auto", "cuda") else 0
    accelerator = "cuda" if gpus else "cpu"
    bench_matmul(torch.device(accelerator))
    nproc = args.devices or (gpus if gpus else 2)
    if nproc < 2:
        print("\nall-reduce benchmark: skipped, it needs at least 2 processes (--devices).")
        return 0
    print(f"\nall-reduce benchmark: {nproc} processes on {accelerator}, float32 sum, median of {args.iters}")
    rows = lockstep.launch(bench_all_reduce, nprocs=nproc, args=(args.max_bytes, args.iters, accelerator))
    print(f"  {'bytes':>12} {'time (us)':>12} {'algbw GB/s':>12} {'busbw GB/s':>12}")
    for size, seconds, algbw, busbw in rows:
        print(f"  {size:>12} {seconds * 1e6:>12.1f} {algbw:>12.3f} {busbw:>12.3f}")
    return 0
