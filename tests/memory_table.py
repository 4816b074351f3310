"""The layouts of docs/memory.md's "Estimate vs measurement" table, in one place.

benchmarks/bench_memory.py prints the table from this list; the tests hold the estimate to
the memory tracker on every row of it (2% in both directions, every model-state category,
activations and the total): tests/test_estimate_measured.py runs the 2-rank rows without
LoRA, tests/test_lora_estimate.py the LoRA rows (where it also counts the base's gathers),
tests/test_zero_pipelines.py the 4-rank rows (in its 4-rank world). A row added here is
measured by the bench and asserted by a test without another edit.
"""

from __future__ import annotations

from memory_runs import Case

LORA = {"lora_rank": 4, "lora_targets": "all"}
TABLE = [
    Case("dp2", parallel={"dp": 2}),
    Case("dp2 ZeRO-1 bf16", parallel={"dp": 2, "zero": 1, "precision": "bf16"}),
    Case("dp2 ZeRO-2 bf16", "small-llama", parallel={"dp": 2, "zero": 2, "precision": "bf16"}),
    Case("dp2 ZeRO-3 bf16", parallel={"dp": 2, "zero": 3, "precision": "bf16"}),
    Case("dp2 ZeRO-2 cpu offload", "small-llama", parallel={"dp": 2, "zero": 2, "offload": "cpu"}),
    Case("dp2 ZeRO-1 nvme offload", parallel={"dp": 2, "zero": 1, "offload": "nvme"}),
    Case("dp2 recompute full", parallel={"dp": 2, "recompute": "full"}),
    Case(
        "dp2 recompute selective, dropout",
        "small-llama",
        parallel={"dp": 2, "recompute": "selective"},
        model={"dropout": 0.1},
    ),
    Case("tp2", parallel={"tp": 2}),
    Case("tp2 SP", parallel={"tp": 2, "sequence_parallel": True}),
    Case(
        "tp2 SP bf16 selective",
        "small-llama",
        parallel={
            "tp": 2,
            "sequence_parallel": True,
            "precision": "bf16",
            "recompute": "selective",
        },
    ),
    Case("pp2 gpipe", parallel={"pp": 2, "schedule": "gpipe"}, accum=4),
    Case("pp2 1f1b", parallel={"pp": 2, "schedule": "1f1b"}, accum=4),
    Case(
        "pp2 interleaved v2",
        "small-llama",
        parallel={"pp": 2, "schedule": "interleaved", "virtual_stages": 2},
        accum=4,
    ),
    Case(
        "dp2 tp2 SP ZeRO-1 bf16",
        parallel={"dp": 2, "tp": 2, "sequence_parallel": True, "zero": 1, "precision": "bf16"},
    ),
    Case("dp2 pp2 1f1b ZeRO-1", "small-llama", parallel={"dp": 2, "pp": 2, "zero": 1}, accum=4),
    Case("pp4 1f1b", parallel={"pp": 4}, accum=8),
    # issue 23: the moment of the peak, and the new features
    Case("dp2 ZeRO-3 cpu offload", "small-llama", parallel={"dp": 2, "zero": 3, "offload": "cpu"}),
    Case("dp2 ZeRO-3 recompute full", parallel={"dp": 2, "zero": 3, "recompute": "full"}),
    Case("LoRA dp2 ZeRO-3", "small-llama", parallel={"dp": 2, "zero": 3}, model=LORA),
    Case(
        "LoRA dp2 ZeRO-3 bf16",
        "small-llama",
        parallel={"dp": 2, "zero": 3, "precision": "bf16", "base_dtype": "bf16"},
        model=LORA,
    ),
    Case(
        "LoRA dp2 ZeRO-3 recompute full",
        "small-llama",
        parallel={"dp": 2, "zero": 3, "recompute": "full"},
        model=LORA,
    ),
    Case("dp2 offload activations", parallel={"dp": 2, "offload_activations": "cpu"}),
    Case(
        "pp2 offload activations, recompute full",
        "small-llama",
        parallel={"pp": 2, "offload_activations": "cpu", "recompute": "full"},
        accum=4,
    ),
    Case("pp2 zb-h1", parallel={"pp": 2, "schedule": "zb-h1"}, accum=4),
    Case("pp2 2bw", parallel={"pp": 2, "schedule": "2bw"}, accum=4, steps=4),
    Case(
        "pp2 2bw offload activations",
        parallel={"pp": 2, "schedule": "2bw", "offload_activations": "cpu"},
        accum=4,
        steps=4,
    ),
    Case(
        "dp2 pp2 1f1b ZeRO-3",
        "small-llama",
        parallel={"dp": 2, "pp": 2, "zero": 3},
        accum=4,
    ),
    Case(
        "tp2 partitioned activations, recompute full",
        parallel={"tp": 2, "partition_activations": True, "recompute": "full"},
    ),
    Case(
        "dp2 tp2 ZeRO-3 partitioned, recompute full",
        parallel={"dp": 2, "tp": 2, "zero": 3, "partition_activations": True, "recompute": "full"},
    ),
    Case(
        "tp2 SP bf16 (lighter loss)",
        "small-llama",
        parallel={"tp": 2, "sequence_parallel": True, "precision": "bf16"},
    ),
]


def is_lora(case: Case) -> bool:
    """A LoRA row (tests/test_lora_estimate.py runs those)."""
    return bool(case.model.get("lora_rank"))
