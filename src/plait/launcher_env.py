"""Which launcher started this process, and where this rank sits in its world.

plait starts its own workers unless a launcher already did. Two are adopted:

- torchrun (and anything exporting its variables): RANK and WORLD_SIZE, with LOCAL_RANK,
  LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT. It wins whenever RANK is set, so `srun
  torchrun ...` (one task per node, torchrun's ranks inside) is torchrun's world.
- Slurm's srun starting one task per rank: SLURM_NTASKS > 1, SLURM_PROCID set (srun sets
  it for every task; a shell inside an allocation has none) and no RANK. The rank, world
  and local rank are SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID; the ranks on this node
  come from SLURM_TASKS_PER_NODE (the step's placement, e.g. `2(x3),1`, this node's entry by
  SLURM_NODEID) or else SLURM_NTASKS_PER_NODE; the rendezvous is the first host of the
  step's node list on a port derived from the job id (`plait.slurm`), unless MASTER_ADDR or
  MASTER_PORT are given. A job named `bash` or `interactive` (`srun --pty bash`: a shell
  inside an allocation, as Lightning's SLURMEnvironment treats it) is not adopted, so
  `plait train` there spawns its own workers.

This module is the one home of that rule: a pure function of the environment (tested by
table, no process), read by the command's checks before any worker starts and by the
launcher. A Slurm environment that contradicts itself is a ConfigError naming the
variables, never a guess.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NoReturn

from plait.errors import ConfigError
from plait.slurm import expand_hostlist, expand_tasks_per_node, job_port

INTERACTIVE_JOBS = ("bash", "interactive")
NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
"""Where the rendezvous host is read, first found first: the step's own nodes (rank 0 runs
on the step's first node, and a step may use part of the job), then the job's."""


@dataclass(frozen=True)
class Launched:
    """This process's place in a world a launcher started."""

    launcher: str  # "torchrun" or "slurm"
    rank: int
    world: int
    local_rank: int
    local_world: int
    master_addr: str | None = None  # None: the environment holds it already (torchrun)
    master_port: int | None = None

    @property
    def world_source(self) -> str:
        """The variable that set the world, for messages: `srun's SLURM_NTASKS=4`."""
        if self.launcher == "slurm":
            return f"srun's SLURM_NTASKS={self.world}"
        return f"torchrun's WORLD_SIZE={self.world}"

    def node_ranks(self) -> range:
        """The global ranks on this node: torchrun numbers ranks node by node, and so does
        srun with its default block distribution (a cyclic one would interleave nodes and
        put a tensor-parallel group's ranks, which vary fastest, on different nodes)."""
        first = self.rank - self.local_rank
        return range(first, first + self.local_world)

    def rendezvous_env(self) -> dict[str, str]:
        """What torch's env:// rendezvous reads and the launcher did not export."""
        if self.master_addr is None or self.master_port is None:
            return {}
        return {"MASTER_ADDR": self.master_addr, "MASTER_PORT": str(self.master_port)}


def launched(env: Mapping[str, str]) -> Launched | None:
    """The launcher `env` shows (torchrun's variables first, then Slurm's), or None: plait
    starts the workers itself."""
    if "RANK" in env and "WORLD_SIZE" in env:
        world = _int(env, "WORLD_SIZE")
        rank = _int(env, "RANK")
        local_rank = _int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else rank
        local_world = _int(env, "LOCAL_WORLD_SIZE") if "LOCAL_WORLD_SIZE" in env else world
        return Launched("torchrun", rank, world, local_rank, local_world)
    if "SLURM_PROCID" not in env or env.get("SLURM_JOB_NAME") in INTERACTIVE_JOBS:
        return None  # not a task srun started (a shell in an allocation has no SLURM_PROCID)
    if "SLURM_NTASKS" not in env:
        return None
    world = _int(env, "SLURM_NTASKS")
    return _slurm(env, world) if world > 1 else None


def from_environment() -> Launched | None:
    """`launched` of this process's environment."""
    return launched(os.environ)


def auto_dp(launch: Launched | None, tp: int, pp: int, cp: int = 1) -> int:
    """`--dp auto`: the data-parallel size that fills the launcher's world with tp x pp
    (x cp) model replicas' ranks, so a restart on fewer (or more) nodes keeps its layout's
    shape."""
    if launch is None:
        raise ConfigError(
            "--dp auto takes dp from a launcher's world (torchrun, or srun with SLURM_NTASKS "
            "> 1), and none started this process; give --dp N to start N local workers"
        )
    if launch.world % (tp * pp * cp):
        with_cp = f" x cp {cp}" if cp > 1 else ""
        raise ConfigError(
            f"--dp auto: {launch.world_source} is not a multiple of tp {tp} x pp {pp}"
            f"{with_cp} = {tp * pp * cp}, so no dp fills it"
        )
    return launch.world // (tp * pp * cp)


def _slurm(env: Mapping[str, str], world: int) -> Launched:
    """srun's task `SLURM_PROCID` of `world` (see the module's docstring)."""
    rank = _needed(env, "SLURM_PROCID", world)
    local_rank = _needed(env, "SLURM_LOCALID", world)
    local_world = _local_world(env, world)
    if rank >= world:
        raise ConfigError(f"SLURM_PROCID={rank} is not a rank of SLURM_NTASKS={world}")
    if local_rank >= local_world:
        raise ConfigError(
            f"SLURM_LOCALID={local_rank} is not a rank of this node's {local_world} tasks"
        )
    addr = env.get("MASTER_ADDR")
    if not addr:
        name = next((n for n in NODELISTS if env.get(n)), None)
        if name is None:
            _missing(world, "SLURM_JOB_NODELIST")
        addr = expand_hostlist(env[name], name)[0]
    port = _int(env, "MASTER_PORT") if env.get("MASTER_PORT") else None
    if port is None:
        port = job_port(env["SLURM_JOB_ID"]) if "SLURM_JOB_ID" in env else None
    if port is None:
        _missing(world, "SLURM_JOB_ID")
    return Launched("slurm", rank, world, local_rank, local_world, addr, port)


def _local_world(env: Mapping[str, str], world: int) -> int:
    """This node's task count: the step's placement, or the per-node request."""
    text = env.get("SLURM_TASKS_PER_NODE")
    if text is None:
        if "SLURM_NTASKS_PER_NODE" not in env:
            _missing(world, "SLURM_TASKS_PER_NODE")
        return expand_tasks_per_node(env["SLURM_NTASKS_PER_NODE"], "SLURM_NTASKS_PER_NODE")[0]
    counts = expand_tasks_per_node(text)
    if sum(counts) != world:
        raise ConfigError(
            f"SLURM_TASKS_PER_NODE={text!r} places {sum(counts)} tasks, but SLURM_NTASKS={world}"
        )
    if len(set(counts)) == 1:
        return counts[0]
    node = _needed(env, "SLURM_NODEID", world)
    if node >= len(counts):
        raise ConfigError(
            f"SLURM_NODEID={node} is not a node of SLURM_TASKS_PER_NODE={text!r} "
            f"({len(counts)} nodes)"
        )
    return counts[node]


def _needed(env: Mapping[str, str], name: str, world: int) -> int:
    if name not in env:
        _missing(world, name)
    return _int(env, name)


def _missing(world: int, name: str) -> NoReturn:
    raise ConfigError(
        f"SLURM_NTASKS={world} says Slurm started {world} tasks, but {name} is not set: start "
        "each rank with srun (or give torchrun's RANK and WORLD_SIZE)"
    )


def _int(env: Mapping[str, str], name: str) -> int:
    text = env[name]
    if not text.strip().isdigit():
        raise ConfigError(f"{name}={text!r} is not a whole number >= 0")
    return int(text)
