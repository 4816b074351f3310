"""The launcher's environment read by table, without processes: Slurm's host lists and task
counts, which launcher a set of variables names and where its rank sits, `--dp auto`'s
arithmetic, and every refusal's line. The runs that use them: test_launch.py (two srun tasks
fabricated as processes, the elastic resume)."""

from __future__ import annotations

import pytest

from plait.errors import ConfigError
from plait.launcher_env import Launched, auto_dp, launched
from plait.slurm import PORT_BASE, expand_hostlist, expand_tasks_per_node, job_port

HOSTLISTS = [
    ("n5", ["n5"]),
    ("gpu[01-03,07],n5", ["gpu01", "gpu02", "gpu03", "gpu07", "n5"]),
    ("node-[1-2]-ib", ["node-1-ib", "node-2-ib"]),
    ("gpu[8-10]", ["gpu8", "gpu9", "gpu10"]),  # no padding asked: none added
    ("gpu[008-010]", ["gpu008", "gpu009", "gpu010"]),  # the low bound's width kept
    ("r[1-2]-n[1,3]", ["r1-n1", "r1-n3", "r2-n1", "r2-n3"]),  # leftmost slowest
    ("a,b[5],c", ["a", "b5", "c"]),
    ("127.0.0.1", ["127.0.0.1"]),
]


@pytest.mark.parametrize("text, hosts", HOSTLISTS)
def test_hostlists_expand_as_slurm_writes_them(text, hosts):
    assert expand_hostlist(text) == hosts


BAD_HOSTLISTS = [
    ("gpu[01-03", "not a Slurm host list (e.g. gpu[01-03,07],n5)"),
    ("gpu]1", "not a Slurm host list (unbalanced brackets)"),
    ("a[[1]]", "not a Slurm host list (unbalanced brackets)"),
    ("a,,b", "not a Slurm host list (e.g. gpu[01-03,07],n5)"),
    ("", "not a Slurm host list (e.g. gpu[01-03,07],n5)"),
    ("gpu[3-1]", "'3-1' is not a range like 01-03 or 7"),
    ("gpu[a-b]", "'a-b' is not a range like 01-03 or 7"),
]


@pytest.mark.parametrize("text, message", BAD_HOSTLISTS)
def test_a_malformed_hostlist_is_named(text, message):
    with pytest.raises(ConfigError) as e:
        expand_hostlist(text)
    assert str(e.value) == f"SLURM_JOB_NODELIST={text!r}" + (
        " is " + message if message.startswith("not") else ": " + message
    )


@pytest.mark.parametrize(
    "text, counts",
    [("4", [4]), ("8(x4)", [8] * 4), ("2(x3),1", [2, 2, 2, 1]), ("1,3(x2)", [1, 3, 3])],
)
def test_tasks_per_node_expand(text, counts):
    assert expand_tasks_per_node(text) == counts


@pytest.mark.parametrize("text", ["", "x", "2(x)", "2(3)", "0", "2(x0)", "2,,1"])
def test_a_malformed_task_count_is_named(text):
    with pytest.raises(ConfigError, match=r"is not a Slurm task count \(e.g. 8\(x4\)"):
        expand_tasks_per_node(text)


def test_the_port_follows_the_job_id():
    """Every task derives the same port from the job id alone; neighbouring jobs differ."""
    assert job_port("4242") == PORT_BASE + 4242
    assert job_port("1234567") == PORT_BASE + 4567
    assert job_port("1234567") != job_port("1234568")
    with pytest.raises(ConfigError, match="SLURM_JOB_ID='12a' is not a job number"):
        job_port("12a")


SLURM = {
    "SLURM_NTASKS": "8", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1",
    "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "77",
    "SLURM_JOB_NAME": "train",
}  # fmt: skip
"""Rank 5 of 2 nodes x 4 tasks, the second on its node."""


def _without(name: str) -> dict:
    return {k: v for k, v in SLURM.items() if k != name}


ADOPTED = [
    ({}, None),
    ({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}, None),  # one task: plait spawns its own
    ({**SLURM, "SLURM_JOB_NAME": "interactive"}, None),  # a shell in an allocation
    ({**SLURM, "SLURM_JOB_NAME": "bash"}, None),
    (_without("SLURM_PROCID"), None),  # not a task srun started: an allocation's shell
    (SLURM, Launched("slurm", 5, 8, 1, 4, "gpu07", PORT_BASE + 77)),
    (  # torchrun's variables win: `srun torchrun`, one task per node
        {**SLURM, "RANK": "3", "WORLD_SIZE": "16", "LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8"},
        Launched("torchrun", 3, 16, 3, 8),
    ),
    ({"RANK": "0", "WORLD_SIZE": "1"}, Launched("torchrun", 0, 1, 0, 1)),
    (  # uneven nodes: this node's entry by SLURM_NODEID
        {
            **SLURM,
            "SLURM_NTASKS": "7",
            "SLURM_TASKS_PER_NODE": "2(x3),1",
            "SLURM_NODEID": "3",
            "SLURM_PROCID": "6",
            "SLURM_LOCALID": "0",
        },
        Launched("slurm", 6, 7, 0, 1, "gpu07", PORT_BASE + 77),
    ),
    (  # the per-node request where the placement is not given
        {
            **{k: v for k, v in SLURM.items() if k != "SLURM_TASKS_PER_NODE"},
            "SLURM_NTASKS_PER_NODE": "4",
        },
        Launched("slurm", 5, 8, 1, 4, "gpu07", PORT_BASE + 77),
    ),
    (  # the step's nodes before the job's; a given address and port before derived ones
        {**SLURM, "SLURM_STEP_NODELIST": "n[3-4]", "MASTER_PORT": "29400"},
        Launched("slurm", 5, 8, 1, 4, "n3", 29400),
    ),
    ({**SLURM, "MASTER_ADDR": "10.0.0.9"}, Launched("slurm", 5, 8, 1, 4, "10.0.0.9", 20077)),
]


@pytest.mark.parametrize("env, want", ADOPTED)
def test_which_launcher_and_where_this_rank_sits(env, want):
    assert launched(env) == want


def test_the_rendezvous_and_the_node_follow_the_record():
    slurm = launched(SLURM)
    assert slurm.rendezvous_env() == {"MASTER_ADDR": "gpu07", "MASTER_PORT": str(PORT_BASE + 77)}
    assert slurm.node_ranks() == range(4, 8)
    assert slurm.world_source == "srun's SLURM_NTASKS=8"
    torchrun = launched({"RANK": "6", "LOCAL_RANK": "2", "WORLD_SIZE": "8"})
    assert torchrun.rendezvous_env() == {}  # torchrun exported its own
    assert torchrun.world_source == "torchrun's WORLD_SIZE=8"


REFUSED = [
    (_without("SLURM_LOCALID"), "SLURM_NTASKS=8 says Slurm started 8 tasks, but SLURM_LOCALID "
     "is not set: start each rank with srun (or give torchrun's RANK and WORLD_SIZE)"),
    (_without("SLURM_JOB_NODELIST"), "but SLURM_JOB_NODELIST is not set"),
    (_without("SLURM_JOB_ID"), "but SLURM_JOB_ID is not set"),
    ({**_without("SLURM_TASKS_PER_NODE")}, "but SLURM_TASKS_PER_NODE is not set"),
    ({**SLURM, "SLURM_TASKS_PER_NODE": "2(x3),1"}, "SLURM_TASKS_PER_NODE='2(x3),1' places 7 "
     "tasks, but SLURM_NTASKS=8"),
    ({**SLURM, "SLURM_NTASKS": "7", "SLURM_TASKS_PER_NODE": "2(x3),1", "SLURM_NODEID": "4"},
     "SLURM_NODEID=4 is not a node of SLURM_TASKS_PER_NODE='2(x3),1' (4 nodes)"),
    ({**SLURM, "SLURM_PROCID": "8"}, "SLURM_PROCID=8 is not a rank of SLURM_NTASKS=8"),
    ({**SLURM, "SLURM_LOCALID": "4"}, "SLURM_LOCALID=4 is not a rank of this node's 4 tasks"),
    ({**SLURM, "SLURM_NTASKS": "eight"}, "SLURM_NTASKS='eight' is not a whole number >= 0"),
    ({**SLURM, "SLURM_JOB_NODELIST": "gpu[07-08"}, "SLURM_JOB_NODELIST='gpu[07-08' is not"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "RANK='x' is not a whole number >= 0"),
]  # fmt: skip


@pytest.mark.parametrize("env, message", REFUSED)
def test_a_slurm_environment_that_contradicts_itself_is_refused(env, message):
    with pytest.raises(ConfigError) as e:
        launched(env)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "world, tp, pp, dp", [(8, 1, 1, 8), (8, 2, 1, 4), (8, 2, 2, 2), (4, 1, 4, 1), (6, 3, 1, 2)]
)
def test_dp_auto_fills_the_world(world, tp, pp, dp):
    assert auto_dp(Launched("slurm", 0, world, 0, world), tp, pp) == dp


def test_dp_auto_refusals():
    with pytest.raises(ConfigError) as e:
        auto_dp(Launched("slurm", 0, 6, 0, 6), 4, 1)
    assert str(e.value) == (
        "--dp auto: srun's SLURM_NTASKS=6 is not a multiple of tp 4 x pp 1 = 4, so no dp fills it"
    )
    with pytest.raises(ConfigError, match="--dp auto takes dp from a launcher's world"):
        auto_dp(None, 1, 1)


def test_dp_auto_counts_context_parallel_ranks_in_a_replica():
    """--cp multiplies a replica's ranks: a world of 8 at tp 2 x cp 2 leaves dp 2."""
    assert auto_dp(Launched("slurm", 0, 8, 0, 8), 2, 1, cp=2) == 2
    with pytest.raises(ConfigError) as e:
        auto_dp(Launched("slurm", 0, 6, 0, 6), 1, 1, cp=4)
    assert str(e.value) == ("--dp auto: srun's SLURM_NTASKS=6 is not a multiple of tp 1 x pp 1"
                            " x cp 4 = 4, so no dp fills it")  # fmt: skip
