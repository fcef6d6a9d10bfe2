"""Checks of fault-tolerant runs of tests/scripts/ft_replica.py against its one-process run."""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from pathlib import Path

import torch


def mark_start(marks: str, group: int, rank: str) -> None:
    """A group's process about to ask for its first quorum leaves a file in ``marks``."""
    os.makedirs(marks, exist_ok=True)
    open(os.path.join(marks, f"g{group}-{os.getpid()}-r{rank}"), "w").close()


def hold_until_started(marks: str, count: int, timeout: float = 150) -> None:
    """Until ``count`` processes of rank 0 in their groups (the groups' first processes, a replacement's too)
    have asked for their first quorum, at most ``timeout`` seconds: a test's groups wait for a late one (a
    replacement, a group started later) at a step it chooses, so that they are still training when it comes,
    however long it takes to start on a busy machine."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and sum(name.endswith("-r0") for name in os.listdir(marks)) < count:
        time.sleep(0.05)


def committed_steps(tmp: Path, pattern: str = "*.log") -> dict[int, list[int]]:
    """Each committed step's dataset indices over every group's log. A group that died after its part of
    the all-reduce reached the others, but before the vote, still counts: the others committed its
    gradient (its last share of the step, over as many members as the committed step had)."""
    committed: dict[int, list[int]] = defaultdict(list)
    sizes: dict[int, set[int]] = defaultdict(set)
    seen: dict[int, list[str]] = defaultdict(list)  # each group's entries of a step, for the failure's message
    shares: list[dict[int, dict]] = []
    for log in tmp.glob(pattern):
        entries = [json.loads(line) for line in log.read_text().splitlines()]
        for entry in entries:
            seen[entry["step"]].append(f"{log.name}: size {entry['size']}, committed {entry['committed']}")
            if entry["committed"]:
                committed[entry["step"]] += entry["indices"]
                sizes[entry["step"]].add(entry["size"])
        done = {e["step"] for e in entries if e["committed"]}
        shares.append({e["step"]: e for e in entries if not e["committed"] and e["step"] not in done})
    for step, size in sizes.items():
        assert len(size) == 1, f"step {step} committed with different memberships: {size} ({seen[step]})"
        for pending in shares:
            if step in pending and pending[step]["size"] in size:
                committed[step] += pending[step]["indices"]
    return committed


def check_exact(tmp: Path, reference: dict, finished: list[str], pattern: str = "*.log",
                 first: int = 0) -> list[dict]:
    steps = committed_steps(tmp, pattern)
    assert sorted(steps) == list(range(first, 20))
    for step, indices in steps.items():  # no sample lost or seen twice; the global batch never shrank
        assert sorted(indices) == sorted(reference["record"][step]), f"step {step}"
    results = [torch.load(tmp / f"{name}.pt") for name in finished]
    for result in results:
        assert result["step"] == 20
        assert float((result["weights"] - reference["weights"]).abs().max()) < 1e-6
        assert torch.equal(result["weights"], results[0]["weights"])
    return results


def process_tree(root: int) -> list[int]:
    """``root`` and every process under it (from /proc)."""
    import os

    children: dict[int, list[int]] = defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children[int(fields[1])].append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def _address(hex_address: str) -> str:
    """/proc/net/tcp{,6}'s little-endian hex address as text."""
    import ipaddress

    raw = bytes.fromhex(hex_address)
    if len(raw) == 4:
        return str(ipaddress.IPv4Address(raw[::-1]))
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
    address = ipaddress.IPv6Address(words)
    return str(address.ipv4_mapped or address)


def listening(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket that ``pids`` listen on (each read in its own network
    namespace: /proc/PID/net)."""
    import os

    found = []
    for pid in pids:
        sockets: dict[str, tuple[str, int]] = {}
        try:
            for table in (f"/proc/{pid}/net/tcp", f"/proc/{pid}/net/tcp6"):
                for line in Path(table).read_text().splitlines()[1:]:
                    fields = line.split()
                    if fields[3] == "0A":  # LISTEN
                        host, port = fields[1].split(":")
                        sockets[fields[9]] = (_address(host), int(port, 16))
            links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
        except OSError:  # the process ended meanwhile
            continue
        for link in links:
            inode = link[len("socket:["):-1] if link.startswith("socket:[") else None
            if inode in sockets:
                found.append((pid, *sockets[inode]))
    return found
