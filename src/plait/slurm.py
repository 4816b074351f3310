"""Slurm's compact notations, read without Slurm: host lists, tasks per node, a job's port.

Slurm writes a job's nodes and its tasks' placement compactly: `gpu[01-03,07],n5` is five
hosts, `2(x3),1` is three nodes of two tasks and one of one. `scontrol show hostnames`
expands the first, but a task cannot count on `scontrol` being on its PATH (containers), so
plait reads both itself. Every malformed value is a ConfigError naming the variable and its
text: a task that guessed would rendezvous with the wrong peers.
"""

from __future__ import annotations

import itertools
import re

from plait.errors import ConfigError

PORT_BASE = 20000
PORT_SPAN = 10000
"""A job's port: PORT_BASE + job id mod PORT_SPAN. The range stays below Linux's ephemeral
ports (32768 and up), so no outgoing connection holds it by chance; two jobs share a node's
port only if their ids are a multiple of PORT_SPAN apart (Lightning's SLURMEnvironment
derives its port from the job id the same way)."""

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")
_TASKS = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def expand_hostlist(text: str, name: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Every host of a Slurm host list, in Slurm's order: `gpu[01-03,07],n5` -> gpu01,
    gpu02, gpu03, gpu07, n5; `node-[1-2]-ib` -> node-1-ib, node-2-ib; several bracket groups
    in one name expand leftmost slowest. A range keeps its low bound's zero padding."""
    hosts: list[str] = []
    for item in _top_level_items(text, name):
        pieces = re.split(r"(\[[^\]]*\])", item)
        choices = [_bracket(p[1:-1], text, name) if p.startswith("[") else [p] for p in pieces if p]
        hosts.extend("".join(parts) for parts in itertools.product(*choices))
    return hosts


def _top_level_items(text: str, name: str) -> list[str]:
    """The comma-separated names outside brackets (a bracket's commas are its own)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if depth not in (0, 1):
            raise ConfigError(f"{name}={text!r} is not a Slurm host list (unbalanced brackets)")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    if depth or not all(item.strip() and item == item.strip() for item in items):
        raise ConfigError(f"{name}={text!r} is not a Slurm host list (e.g. gpu[01-03,07],n5)")
    return items


def _bracket(inner: str, text: str, name: str) -> list[str]:
    """`01-03,07` -> 01, 02, 03, 07: each range padded to its low bound's width."""
    out = []
    for part in inner.split(","):
        match = _RANGE.fullmatch(part)
        if match is None or (match[2] is not None and int(match[2]) < int(match[1])):
            raise ConfigError(f"{name}={text!r}: {part!r} is not a range like 01-03 or 7")
        low, high = match[1], match[2] or match[1]
        out.extend(str(n).zfill(len(low)) for n in range(int(low), int(high) + 1))
    return out


def expand_tasks_per_node(text: str, name: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Tasks on each node of the step, in node order: `2(x3),1` -> [2, 2, 2, 1]; `8(x4)` ->
    four nodes of 8; `4` -> one node of 4."""
    counts: list[int] = []
    for part in text.split(","):
        match = _TASKS.fullmatch(part.strip())
        if match is None or int(match[1]) < 1 or (match[2] is not None and int(match[2]) < 1):
            raise ConfigError(f"{name}={text!r} is not a Slurm task count (e.g. 8(x4) or 2(x3),1)")
        counts.extend([int(match[1])] * int(match[2] or 1))
    return counts


def job_port(job_id: str) -> int:
    """The rendezvous port every task of job `job_id` derives alike, with no message passed
    (see PORT_BASE)."""
    if not job_id.isdigit():
        raise ConfigError(f"SLURM_JOB_ID={job_id!r} is not a job number; give MASTER_PORT")
    return PORT_BASE + int(job_id) % PORT_SPAN
