"""SLURM host-list and tasks-per-node expressions, expanded without calling SLURM."""

from __future__ import annotations

import re

from lockstep.errors import ConfigError


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets: ``a[1,2],b`` -> ``['a[1,2]', 'b']``."""
    parts: list[str] = []
    depth = 0
    current = ""
    for char in text:
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"unbalanced ']' in SLURM node list {text!r}")
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise ConfigError(f"unbalanced '[' in SLURM node list {text!r}")
    parts.append(current)
    return [p for p in parts if p]


def _expand_range(item: str, nodelist: str) -> list[str]:
    """``01-04`` -> ``['01', '02', '03', '04']`` keeping the zero padding of the lower bound."""
    if "-" not in item:
        return [item]
    low, high = item.split("-", 1)
    if not (low.isdigit() and high.isdigit()) or int(low) > int(high):
        raise ConfigError(f"bad range {item!r} in SLURM node list {nodelist!r}")
    width = len(low)
    return [str(n).zfill(width) for n in range(int(low), int(high) + 1)]


def expand_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM host list, as ``scontrol show hostnames`` does.

    ``gpu[01-03,07],cpu3`` -> ``['gpu01', 'gpu02', 'gpu03', 'gpu07', 'cpu3']``; brackets may appear
    more than once in a name (``r[1-2]n[1-2]`` gives the cartesian product, leftmost slowest).
    """
    hosts: list[str] = []
    for part in _split_top_level(nodelist.strip()):
        names = [""]
        for literal, bracket in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", part):
            if not literal and not bracket:
                continue
            choices = [literal]
            if bracket:
                choices = [
                    literal + value
                    for item in bracket.split(",")
                    for value in _expand_range(item, nodelist)
                ]
            names = [prefix + choice for prefix in names for choice in choices]
        hosts.extend(names)
    return hosts


def expand_tasks_per_node(spec: str) -> list[int]:
    """Expand ``SLURM_TASKS_PER_NODE`` style counts: ``2(x3),1`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for item in spec.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", item)
        if match is None:
            raise ConfigError(f"cannot read SLURM tasks-per-node value {spec!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts
