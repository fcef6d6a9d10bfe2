"""Checks of fault-tolerant runs of tests/scripts/ft_replica.py against its one-process run."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch


def committed_steps(tmp: Path, pattern: str = "*.log") -> dict[int, list[int]]:
    """Each committed step's dataset indices over every group's log. A group that died after its part of
    the all-reduce reached the others, but before the vote, still counts: the others committed its
    gradient (its last share of the step, over as many members as the committed step had)."""
    committed: dict[int, list[int]] = defaultdict(list)
    sizes: dict[int, set[int]] = defaultdict(set)
    shares: list[dict[int, dict]] = []
    for log in tmp.glob(pattern):
        entries = [json.loads(line) for line in log.read_text().splitlines()]
        for entry in entries:
            if entry["committed"]:
                committed[entry["step"]] += entry["indices"]
                sizes[entry["step"]].add(entry["size"])
        done = {e["step"] for e in entries if e["committed"]}
        shares.append({e["step"]: e for e in entries if not e["committed"] and e["step"] not in done})
    for step, size in sizes.items():
        assert len(size) == 1, f"step {step} committed with different memberships: {size}"
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
