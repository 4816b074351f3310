"""The cases of the bad-input sweep (bad_input_sweep.py runs them): wrong values, wrong paths,
wrong types, conflicting flags, damaged checkpoints and signals, over every command. `{S}` in
a case is the sweep's scratch folder (`bad_input_sweep.scratch` makes what the cases name).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

CLASSES = ("wrong value", "wrong path", "wrong type", "conflicting flags", "damaged checkpoint",
           "signals")  # fmt: skip

TINY = ["--model", "tiny-gpt", "--seq-len", "32", "--global-batch", "2", "--micro-batch", "1",
        "--max-bytes", "60000", "--eval-batches", "1", "--steps", "2", "--no-progress"]  # fmt: skip
"""A run small enough to be refused quickly (every case changes one thing of it)."""
FROM_HF = [a for a in TINY if a not in ("--model", "tiny-gpt")]  # --init-from names the model


@dataclass(frozen=True)
class Case:
    cls: str
    argv: tuple[str, ...]  # {S}: the scratch folder (see `scratch`)
    code: int = 2

    @property
    def command(self) -> str:
        words = [w for w in self.argv[:2] if not w.startswith("-")]
        two = ("checkpoint", "data", "tokenizer")
        return " ".join(words[:2]) if words and words[0] in two else words[0]


def _c(cls: str, *argv: str, code: int = 2) -> Case:
    return Case(cls, tuple(argv), code)


def _train(cls: str, *flags: str) -> Case:
    return _c(cls, "train", *TINY, "--out", "{S}/new-run", *flags)


def wrong_values() -> list[Case]:
    v = "wrong value"
    train = [("--lr", "nan"), ("--lr", "inf"), ("--lr", "-1"), ("--beta1", "2"),
             ("--beta2", "-0.5"), ("--weight-decay", "-1"), ("--init-std", "-1"),
             ("--dropout", "1.5"), ("--steps", "0"), ("--dp", "0"), ("--tp", "-2"),
             ("--seq-len", "0"), ("--grad-clip", "-1"), ("--val-fraction", "1.5"),
             ("--max-bytes", "0"), ("--warmup-steps", "-3"), ("--eval-batches", "0"),
             ("--keep-checkpoints", "0"), ("--comm-timeout", "0"), ("--bucket-mb", "nan"),
             ("--model", "no-such-model"), ("--pp", "2", "--schedule", "zigzag"),
             ("--precision", "fp8"),
             ("--nan-policy", "ignore"), ("--recompute", "some"), ("--device", "tpu"),
             ("--zero", "4"), ("--seq-len", "4096"), ("--global-batch", "0"),
             ("--n-heads", "5"), ("--offload", "disk"), ("--dp-mode", "magic"),
             ("--packed-attention", "varlen"), ("--packed-attention", "dense"),
             ("--cp", "0"), ("--cp-exchange", "zigzag")]  # fmt: skip
    cases = [_train(v, *flags) for flags in train]
    cases += [_c(v, "estimate", *args) for args in (
        ["--model", "nope"], ["--dp", "0"], ["--device-memory", "-1"], ["--lr", "nan"],
        ["--tp", "3", "--model", "tiny-gpt"], ["--pp", "99", "--model", "tiny-gpt"],
        ["--zero", "9"], ["--seq-len", "inf"])]  # fmt: skip
    plan = ["plan", "--gpus", "8", "--global-batch", "8", "--seq-len", "64"]
    cases += [_c(v, *plan, *args) for args in (
        ["--model", "nope"], ["--gpu-memory", "0"], ["--top", "0"], ["--hardware", "tpu9"],
        ["--gpus-per-node", "0"], ["--max-micro-batch", "-1"], ["--dp", "0"],
        ["--precision", "fp4"])]  # fmt: skip
    cases += [_c(v, "plan", "--gpus", g, "--global-batch", "8", "--seq-len", "64")
              for g in ("0", "-8", "nan")]  # fmt: skip
    cases += [_c(v, "calibrate", "--out", "{S}/hw.toml", *args) for args in (
        ["--ranks", "1"], ["--ranks", "0"], ["--repeats", "-1"], ["--repeats", "0"],
        ["--model", "nope"], ["--seq-len", "100000"], ["--seq-len", "0"])]  # fmt: skip
    cases += [_c(v, "schedule", *args, "--out", "{S}/sched") for args in (
        ["--pp", "0", "--microbatches", "4"], ["--pp", "2", "--microbatches", "0"],
        ["--pp", "2", "--microbatches", "4", "--schedule", "zigzag"],
        ["--pp", "2", "--microbatches", "3", "--schedule", "interleaved", "--virtual-stages", "2"],
        ["--pp", "2", "--microbatches", "4", "--virtual-stages", "0"])]  # fmt: skip
    cases += [_c(v, "generate", "--checkpoint", "{S}/run", "--prompt", "hi", *args) for args in (
        ["--max-new-tokens", "0"], ["--temperature", "-1"], ["--temperature", "nan"],
        ["--top-k", "-1"])]  # fmt: skip
    cases += [_c(v, "export", "--checkpoint", "{S}/run", "--out", "{S}/hf", *args)
              for args in (["--max-shard-mb", "0"], ["--format", "onnx"], ["--merge"],
                           ["--format", "peft"])]  # fmt: skip
    cases += [
        _c(v, "data", "prepare", "--data", "{S}/text.txt", "--out", "{S}/shards", *args)
        for args in (["--workers", "0"], ["--shard-tokens", "0"], ["--shard-tokens", "nan"])
    ]
    cases += [_c(v, "data", "instructions", "--out", "{S}/ins.jsonl", *args)
              for args in (["--max-examples", "0"], ["--max-chars", "-5"])]  # fmt: skip
    cases += [_c(v, "tokenizer", "train", "--data", "{S}/text.txt", "--out", "{S}/tok.json",
                 "--vocab-size", n) for n in ("10", "0", "-1", "nan")]  # fmt: skip
    ev = ["eval", "--checkpoint", "{S}/run", "--data", "{S}/text.txt", "--no-progress"]
    cases += [_c(v, *ev, *args) for args in (
        ["--format", "xml"], ["--dp", "0"], ["--seq-len", "nan"], ["--micro-batch", "0"],
        ["--eval-batches", "-1"])]  # fmt: skip
    cases += [_train(v, "--model", "tiny-llama", "--lora-rank", "4", "--lora-targets", t)
              for t in ("", ",")]  # names no target: not PEFT's default unsaid  # fmt: skip
    cases += [_c(v, *plan, "--model", "tiny-llama", "--lora-rank", "4", "--lora-targets", "")]
    cases += [
        _c(v, "lessons", "--only", "nope", "--out", "{S}/lessons"),
        _c(v, "lessons", "--only", "dp", "--only", "zzz", "--out", "{S}/lessons"),
    ]
    return cases


def wrong_paths() -> list[Case]:
    p = "wrong path"
    missing, folder, file, proc = "{S}/missing/x", "{S}/folder", "{S}/exists.txt", "/proc/x/y"
    under_file, full = "{S}/exists.txt/x", "{S}/bad-lessons"  # a folder's parent is a file
    cases = [_c(p, "train", *TINY, "--out", out) for out in (under_file, file, proc)]
    cases += [
        _train(p, flag, value)
        for flag, value in (
            ("--data", "{S}/nothing-here"),
            ("--data", "{S}/empty"),
            ("--config", "{S}/no.toml"),
            ("--config", folder),
            ("--tokenizer", "{S}/no-tokenizer.json"),
            ("--tokenizer", "{S}/text.txt"),
            ("--resume", "{S}/no-ckpt"),
            ("--resume", file),
        )
    ]
    cases += [_c(p, "train", *FROM_HF, "--out", "{S}/new-run", "--init-from", hf)
              for hf in ("{S}/no-hf", file)]  # fmt: skip
    cases += [_train(p, "--offload", "nvme", "--offload-dir", proc)]
    plan = ["plan", "--gpus", "8", "--global-batch", "8", "--seq-len", "64"]
    cases += [_c(p, *plan, "--out", out) for out in (missing, folder, proc)]
    cases += [_c(p, *plan, "--hardware", "{S}/no-hw.toml"), _c(p, *plan, "--hardware", folder)]
    cases += [_c(p, "estimate", "--config", c) for c in ("{S}/no.toml", folder)]
    cases += [_c(p, "calibrate", "--out", out) for out in (missing, folder, proc)]
    sched = ["schedule", "--pp", "2", "--microbatches", "4"]
    cases += [_c(p, *sched, "--out", out) for out in (under_file, file, proc)]
    cases += [_c(p, "checkpoint", "info", c) for c in ("{S}/no-ckpt", file, folder)]
    cases += [_c(p, "checkpoint", "consolidate", "{S}/run", "--out", out)
              for out in (missing + ".safetensors", folder, proc, file)]  # fmt: skip
    cases += [_c(p, "export", "--checkpoint", "{S}/run", "--out", out)
              for out in (under_file, full, file, proc)]  # fmt: skip
    cases += [_c(p, "export", "--checkpoint", c, "--out", "{S}/hf") for c in ("{S}/no", file)]
    cases += [_c(p, "generate", "--checkpoint", c, "--prompt", "x") for c in ("{S}/no", file)]
    cases += [_c(p, "generate", "--init-from", c, "--prompt", "x") for c in ("{S}/no", file)]
    adapter = ["--init-from", "{S}/hf-ok", "--adapter"]  # a missing PEFT folder, one without
    cases += [_c(p, "train", *FROM_HF, "--out", "{S}/new-run", *adapter, a)  # adapter_config
              for a in ("{S}/no-adapter", folder, file)]  # fmt: skip
    cases += [_c(p, "generate", *adapter, "{S}/no-adapter", "--prompt", "x"),
              _c(p, "eval", *adapter, folder, "--data", "{S}/text.txt")]  # fmt: skip
    prep = ["data", "prepare", "--data", "{S}/text.txt"]
    cases += [_c(p, *prep, "--out", out) for out in (under_file, file, proc)]
    cases += [_c(p, "data", "prepare", "--data", d, "--out", "{S}/shards")
              for d in ("{S}/nothing-here", "{S}/empty")]  # fmt: skip
    cases += [_c(p, *prep, "--out", "{S}/shards", "--tokenizer", "{S}/no-tokenizer.json")]
    cases += [_c(p, "data", "instructions", "--out", out) for out in (missing, folder, proc)]
    cases += [_c(p, "data", "instructions", "--out", "{S}/ins.jsonl", "--source", "{S}/none")]
    tok = ["tokenizer", "train", "--vocab-size", "300"]
    cases += [_c(p, *tok, "--data", "{S}/text.txt", "--out", out)
              for out in (missing, folder, proc)]  # fmt: skip
    cases += [_c(p, *tok, "--data", "{S}/nothing-here", "--out", "{S}/tok.json")]
    ev = ["eval", "--data", "{S}/text.txt", "--checkpoint"]
    cases += [_c(p, *ev, c) for c in ("{S}/no", file)]
    cases += [_c(p, "eval", "--checkpoint", "{S}/run", "--seq-len", "32", "--data", d)
              for d in ("{S}/nothing-here", "{S}/empty")]  # fmt: skip
    cases += [_c(p, "lessons", "--only", "dp", "--out", out) for out in (file, proc)]
    cases += [_c(p, "lessons", "--only", "dp", "--out", "{S}/bad-lessons")]  # unreadable json
    return cases


def wrong_types() -> list[Case]:
    t = "wrong type"
    cases = [_train(t, flag, value) for flag, value in (
        ("--steps", "three"), ("--lr", "fast"), ("--dp", "2.5"), ("--seq-len", "1e3x"),
        ("--config", "{S}/binary.toml"), ("--config", "{S}/bad.toml"),
        ("--config", "{S}/wrong-type.toml"), ("--config", "{S}/unknown-key.toml"),
        ("--stage-layers", "a,b"), ("--data", "{S}/bad.jsonl"),
        ("--tokenizer", "{S}/bad-tokenizer.json"))]  # fmt: skip
    cases += [
        _c(t, "estimate", "--config", "{S}/binary.toml"),
        _c(t, "estimate", "--d-model", "wide"),
        _c(t, "plan", "--gpus", "eight", "--global-batch", "8", "--seq-len", "64"),
        _c(
            t,
            "plan",
            "--gpus",
            "8",
            "--global-batch",
            "8",
            "--seq-len",
            "64",
            "--hardware",
            "{S}/binary.toml",
        ),
        _c(
            t,
            "plan",
            "--gpus",
            "8",
            "--global-batch",
            "8",
            "--seq-len",
            "64",
            "--hardware",
            "{S}/bad.toml",
        ),
        _c(t, "calibrate", "--ranks", "two", "--out", "{S}/hw.toml"),
        _c(t, "schedule", "--pp", "two", "--microbatches", "4"),
        _c(t, "generate", "--checkpoint", "{S}/run", "--prompt", "x", "--top-k", "k"),
        _c(t, "export", "--checkpoint", "{S}/run", "--out", "{S}/hf", "--max-shard-mb", "x"),
        _c(t, "data", "prepare", "--data", "{S}/bad.jsonl", "--out", "{S}/shards"),
        _c(
            t,
            "data",
            "prepare",
            "--data",
            "{S}/text.txt",
            "--out",
            "{S}/shards",
            "--workers",
            "many",
        ),
        _c(
            t,
            "data",
            "prepare",
            "--data",
            "{S}/text.txt",
            "--out",
            "{S}/shards",
            "--tokenizer",
            "{S}/bad-tokenizer.json",
        ),
        _c(t, "data", "instructions", "--out", "{S}/ins.jsonl", "--max-examples", "lots"),
        _c(
            t,
            "tokenizer",
            "train",
            "--data",
            "{S}/bad.jsonl",
            "--out",
            "{S}/tok.json",
            "--vocab-size",
            "300",
        ),
        _c(
            t,
            "tokenizer",
            "train",
            "--data",
            "{S}/text.txt",
            "--out",
            "{S}/tok.json",
            "--vocab-size",
            "many",
        ),
        _c(t, "generate", "--init-from", "{S}/bad-hf", "--prompt", "x"),
        _c(t, "train", *FROM_HF, "--out", "{S}/new-run", "--init-from", "{S}/bad-hf"),
        _c(t, "eval", "--checkpoint", "{S}/run", "--data", "{S}/bad.jsonl", "--format", "alpaca"),
        _c(t, "eval", "--init-from", "{S}/bad-hf", "--data", "{S}/text.txt"),
    ]
    alpaca = ["data", "prepare", "--format", "alpaca", "--tokenizer", "{S}/tok", "--out",
              "{S}/sft"]  # fmt: skip
    cases += [_c(t, *alpaca, "--data", f"{{S}}/{name}.json")  # what json.load refuses
              for name in ("trailing-comma", "extra-comma", "missing-comma", "junk-after",
                           "two-arrays", "one-object")]  # fmt: skip
    cases += [_c(t, "data", "prepare", "--format", "chat", "--tokenizer", "{S}/tok", "--data",
                 "{S}/bad-role.jsonl", "--out", "{S}/sft")]  # fmt: skip
    cases += [_c(t, "eval", "--init-from", "{S}/hf-ok", "--tokenizer", "{S}/tok", "--data",
                 "{S}/rows.json", "--format", "alpaca", "--seq-len", "2", "--long",
                 "drop")]  # every example dropped: said so  # fmt: skip
    cases += [_c(t, "train", *FROM_HF, "--out", "{S}/new-run", "--init-from", "{S}/hf-nf4"),
              _c(t, "generate", "--init-from", "{S}/hf-nf4", "--prompt", "x"),
              _c(t, "eval", "--init-from", "{S}/hf-nf4", "--data", "{S}/text.txt")]  # fmt: skip
    return cases


def conflicting_flags() -> list[Case]:
    f = "conflicting flags"
    cases = [_train(f, *flags) for flags in (
        ["--dp", "2", "--global-batch", "3"], ["--micro-batch", "4", "--global-batch", "2"],
        ["--pp", "2", "--schedule", "2bw", "--nan-policy", "skip"],
        ["--pp", "4", "--n-layers", "2"], ["--tp", "3"], ["--zero", "3", "--dp-mode", "naive"],
        ["--offload", "nvme"], ["--sequence-parallel"], ["--schedule", "interleaved"],
        ["--pp", "2", "--stage-layers", "1,1,1"], ["--min-lr", "1", "--lr", "0.1"],
        ["--precision", "fp16", "--reduce-dtype", "bf16"], ["--resume", "{S}/run"],
        ["--tp", "2", "--n-heads", "3"], ["--virtual-stages", "2"],
        ["--model", "tiny-llama", "--resume", "{S}/run"], ["--cp", "3"],
        ["--cp", "2", "--pp", "2", "--schedule", "2bw"],
        ["--cp", "2", "--tp", "4", "--sequence-parallel", "--seq-len", "36"])]  # fmt: skip
    cases += [
        _c(f, "train", *TINY, "--out", "{S}/run"),  # a run already there
        _c(
            f,
            "train",
            *TINY,
            "--out",
            "{S}/new-run",
            "--init-from",
            "{S}/hf-ok",
            "--model",
            "tiny-llama",
        ),
        _c(
            f,
            "plan",
            "--gpus",
            "64",
            "--gpus-per-node",
            "7",
            "--global-batch",
            "8",
            "--seq-len",
            "64",
        ),
        _c(f, "plan", "--gpus", "8", "--tp", "16", "--global-batch", "8", "--seq-len", "64"),
        _c(f, "plan", "--gpus", "8", "--dp", "3", "--global-batch", "8", "--seq-len", "64"),
        _c(f, "estimate", "--model", "tiny-gpt", "--global-batch", "3", "--dp", "2"),
        _c(f, "estimate", "--model", "tiny-gpt", "--tp", "2", "--n-heads", "3"),
        _c(f, "generate", "--prompt", "x"),  # neither --checkpoint nor --init-from
        _c(f, "generate", "--checkpoint", "{S}/run", "--adapter", "{S}/folder", "--prompt", "x"),
        _c(f, "train", *TINY, "--out", "{S}/new-run", "--adapter", "{S}/folder"),  # no base
        _c(f, "generate", "--checkpoint", "{S}/run", "--init-from", "{S}/hf-ok", "--prompt", "x"),
        _c(f, "checkpoint", "consolidate", "{S}/run", "--out", "{S}/exists.safetensors"),
        _c(f, "data", "prepare", "--data", "{S}/text.txt", "--out", "{S}/folder"),
        _c(f, "data", "instructions", "--out", "{S}/exists.txt"),
        _c(
            f,
            "eval",
            "--checkpoint",
            "{S}/run",
            "--init-from",
            "{S}/hf-ok",
            "--data",
            "{S}/text.txt",
        ),
        _c(f, "eval", "--checkpoint", "{S}/run", "--data", "{S}/text.txt", "--model", "tiny-llama"),
        _c(f, "export", "--checkpoint", "{S}/run", "--out", "{S}/bad-lessons"),
        _c(
            f,
            "schedule",
            "--pp",
            "2",
            "--microbatches",
            "4",
            "--schedule",
            "2bw",
            "--virtual-stages",
            "2",
        ),
    ]
    return cases


DAMAGES = ("no-commit", "no-manifest", "bad-manifest", "cut-file", "flipped-byte", "no-trainer",
           "bad-trainer", "empty", "run-without-checkpoint")  # fmt: skip
"""Copies of a real checkpoint, each damaged one way (`_damage`)."""


def one_source() -> list[Case]:
    """Conflicting flags about where the data comes from: `--data` given twice (a run reads
    one source), and a tokenizer or shards that are not the `--init-from` folder's."""
    f, twice = "conflicting flags", ["--data", "{S}/text.txt", "--data", "{S}/exists.txt"]
    return [_train(f, *twice), _c(f, "estimate", *twice),
            _c(f, "eval", "--checkpoint", "{S}/run", *twice),
            _c(f, "data", "prepare", *twice, "--out", "{S}/shards"),
            _c(f, "tokenizer", "train", *twice, "--out", "{S}/tok.json", "--vocab-size", "300"),
            _c(f, "train", *FROM_HF, "--out", "{S}/new-run", "--init-from", "{S}/hf-tok",
               "--tokenizer", "{S}/tok"),  # the folder has its own tokenizer
            _c(f, "train", *FROM_HF, "--out", "{S}/new-run", "--init-from", "{S}/hf-tok",
               "--data", "{S}/shards-bytes")]  # fmt: skip


def damaged_checkpoints() -> list[Case]:
    d = "damaged checkpoint"
    cases = []
    for damage in DAMAGES:
        path = "{S}/damaged/" + damage
        cases += [_c(d, "checkpoint", "info", path),
                  _c(d, "checkpoint", "consolidate", path, "--out", "{S}/c.safetensors"),
                  _c(d, "export", "--checkpoint", path, "--out", "{S}/hf"),
                  _c(d, "generate", "--checkpoint", path, "--prompt", "x"),
                  _c(d, "train", *TINY, "--out", "{S}/new-run", "--resume", path),
                  _c(d, "eval", "--checkpoint", path, "--data", "{S}/text.txt")]  # fmt: skip
    return cases


COMMANDS = (["train", "--out", "{S}/r"], ["estimate"], ["plan", "--gpus", "8"], ["calibrate"],
            ["schedule", "--pp", "2"], ["presets"], ["checkpoint", "info", "x"],
            ["checkpoint", "consolidate", "x", "--out", "y"], ["export"], ["generate"],
            ["data", "prepare", "--out", "y"], ["data", "instructions", "--out", "y"],
            ["tokenizer", "train", "--out", "y"], ["lessons"], ["eval"])  # fmt: skip


def signals() -> list[Case]:
    return [_c("signals", *argv, code=128 + s) for argv in COMMANDS
            for s in (signal.SIGINT, signal.SIGTERM)]  # fmt: skip


def core_cases() -> list[Case]:
    """Every case of this table; bad_input_sweep.all_cases adds the families' (which
    import `Case` from here, so the arrow points one way)."""
    return (wrong_values() + wrong_paths() + wrong_types() + conflicting_flags() + one_source()
            + damaged_checkpoints() + signals())  # fmt: skip
