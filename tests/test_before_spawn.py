"""Every value a worker would reject is refused before a worker starts (issue 20).

A value that fails only inside the ranks costs a traceback per rank, exit 1 and, for
`calibrate`, files left in the temp folder. Each row below is one that a worker (torch's init,
the NVMe store, the sampler, the pipeline split, the position table, the median of the
repeats...) would reject: `plait.cli.main` must answer it with one line and exit 2 while the
launch is replaced by a function that fails the test, so nothing is ever spawned.
"""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

import pytest

from hf_models import gpt2_config, llama_config, save
from plait.cli import main
from plait.data.tokenizer import train_bpe


@pytest.fixture(autouse=True)
def no_spawn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Wide messages on one line, and any start of workers fails the test."""
    monkeypatch.setenv("COLUMNS", "200")

    def spawned(*args: object, **kwargs: object) -> None:
        raise AssertionError("workers were started for a value that should be refused")

    monkeypatch.setattr("plait.cli.train.launch", spawned)
    monkeypatch.setattr("plait.calibrate.mp.start_processes", spawned)


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text("Pack my box with five dozen liquor jugs; the quick brown fox jumps.\n" * 60)
    return path


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """main(argv) gives exit 2 and one `plait: error:` line; returns that line."""
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("plait: error: "), lines
    return lines[0]


# (flags added to a tiny valid `plait train`, the words the one line must hold, and who
# would otherwise refuse it).
TRAIN = [
    (["--init-std", "-1"], "--init-std must be >= 0, got -1"),  # torch's normal_
    (["--init-std", "nan"], "--init-std must be a finite number"),  # torch's normal_
    (["--offload", "nvme", "--zero", "1", "--offload-dir", "/proc/plait-x"],
     "--offload-dir '/proc/plait-x' cannot be written"),  # the NVMe store's mkdir
    (["--offload", "nvme", "--zero", "1", "--offload-dir", "{file}/x"],
     "cannot be made: '{file}' is a file"),  # the NVMe store's mkdir
    (["--offload", "nvme", "--zero", "1"], "needs a directory"),  # the NVMe store
    (["--model", "tiny-gpt", "--seq-len", "65"],
     "seq_len 65 exceeds the model's max_seq_len 64"),  # the position table
    (["--packed-attention", "varlen"],
     "--packed-attention varlen cannot run: "),  # varlen_attn: CUDA, bf16/fp16
    (["--model", "tiny-gpt", "--pp", "4"], "more pipeline stages"),  # split_layers
    (["--model", "tiny-gpt", "--pp", "2", "--stage-layers", "2,1"],
     "must be 2 numbers >= 1 summing to 2 layers"),  # split_layers
    (["--stage-layers", "x"], "comma-separated integers"),
    (["--tp", "3"], "not divisible by tp=3"),  # shard_spec
    (["--max-bytes", "0"], "--max-bytes must be >= 1, got 0"),  # load_tokens
    (["--micro-batch", "3"], "not a multiple of micro-batch 3"),  # the sampler
    (["--global-batch", "4096"], "one global batch needs 4096"),  # the sampler
    (["--val-fraction", "0.9999"], "one global batch needs 16 training"),  # the sampler
    (["--vocab-size", "100"], "smaller than the byte tokenizer's 256"),  # the embedding
    (["--zero", "3", "--pp", "2", "--schedule", "2bw", "--model", "tiny-gpt"],
     "it does not run on the ZeRO engine (got zero=3"),  # 2BW's own weight versions
    (["--precision", "fp8"], "precision must be one of"),
    (["--resume", "{missing}"], "does not exist"),  # the checkpoint load
    (["--init-from", "{missing}"], "is not a folder"),  # the weight load
]  # fmt: skip


@pytest.mark.parametrize(("flags", "words"), TRAIN, ids=[" ".join(f) for f, _ in TRAIN])
def test_train_values_a_worker_would_reject(flags, words, corpus, tmp_path, capsys) -> None:
    file = tmp_path / "a-file"
    file.write_text("")
    names = {"file": str(file), "missing": str(tmp_path / "missing")}
    flags = [f.format(**names) for f in flags]
    out = tmp_path / "run"
    base = ["train", "--data", str(corpus), "--seq-len", "32", "--out", str(out)]
    assert words.format(**names) in refused(base + flags, capsys)
    assert not out.exists()  # refused before the run folder was made


def test_tensorboard_missing_is_refused(corpus, tmp_path, capsys, monkeypatch) -> None:
    """Rank 0 imports TensorBoard's writer only when asked: without the package it would fail
    there, after every rank started."""
    real = find_spec
    monkeypatch.setattr(
        "plait.config.checks.find_spec", lambda n: None if n == "tensorboard" else real(n)
    )
    argv = ["train", "--data", str(corpus), "--seq-len", "32", "--tensorboard"]
    line = refused([*argv, "--out", str(tmp_path / "run")], capsys)
    assert line.endswith(
        "--tensorboard needs the tensorboard package: pip install 'plait[tensorboard]'"
    )


def test_more_cuda_ranks_than_gpus_is_refused(corpus, tmp_path, capsys, monkeypatch) -> None:
    """Two ranks on one GPU would fail in NCCL's set-up, in every worker."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 1)
    argv = ["train", "--data", str(corpus), "--seq-len", "32", "--dp", "2", "--micro-batch", "4"]
    line = refused([*argv, "--out", str(tmp_path / "run")], capsys)
    assert "2 ranks on this machine need 2 CUDA devices, one each (NCCL), but torch sees 1" in line
    with pytest.MonkeyPatch.context() as m:  # under torchrun: the ranks of this node count
        m.setenv("RANK", "0")
        m.setenv("WORLD_SIZE", "2")
        m.setenv("LOCAL_WORLD_SIZE", "1")
        m.setenv("LOCAL_RANK", "0")
        launched = []
        m.setattr("plait.cli.train.launch", launched.append)
        assert main([*argv, "--out", str(tmp_path / "run2")]) == 0
        assert len(launched) == 1


CALIBRATE = [
    (["--repeats", "-1"], "--repeats must be >= 1"),  # the median of no repeats
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--seq-len", "0"], "must be >= 1, got 0"),  # an empty batch
    (["--seq-len", "300"], "seq_len 300 exceeds the model's max_seq_len 256"),  # positions
    (["--ranks", "1"], "--ranks must be >= 2"),  # a collective of one
    (["--model", "nope"], "unknown model preset 'nope'"),
]


@pytest.mark.parametrize(("flags", "words"), CALIBRATE, ids=[" ".join(f) for f, _ in CALIBRATE])
def test_calibrate_values_a_worker_would_reject(flags, words, tmp_path, capsys) -> None:
    out = tmp_path / "hw.toml"
    assert words in refused(["calibrate", "--out", str(out), *flags], capsys)
    assert list(tmp_path.iterdir()) == []


PLAN = [
    (["--gpus", "64", "--gpus-per-node", "7"],
     "--gpus 64 is not a multiple of --gpus-per-node 7"),
    (["--gpus", "64", "--gpus-per-node", "8", "--tp", "16"],
     "tp=16 is more than --gpus-per-node 8: tensor parallelism must stay within a node"),
]  # fmt: skip


@pytest.mark.parametrize(("flags", "words"), PLAN, ids=[" ".join(f) for f, _ in PLAN])
def test_plan_limits_name_their_rule(flags, words, capsys) -> None:
    argv = ["plan", "--model", "llama-7b", "--global-batch", "64", "--seq-len", "128", *flags]
    line = refused(argv, capsys)
    assert words in line
    if "--tp" in flags:
        assert line.endswith("the nearest tp that work: 4 or 8")  # both within a node


def test_positions_past_the_model_learned_refused_rope_warned(tmp_path, corpus, capsys) -> None:
    """One rule for presets and Hugging Face folders: learned positions end at max_seq_len
    (GPT-2's n_positions) and are refused past it; RoPE (Llama's max_position_embeddings)
    runs past it, as in transformers, with a warning line."""
    gpt2 = save(gpt2_config(), tmp_path / "gpt2")
    llama = save(llama_config(), tmp_path / "llama")
    capsys.readouterr()  # transformers' own lines while saving
    base = [
        "train",
        "--data",
        str(corpus),
        "--seq-len",
        "128",
        "--global-batch",
        "4",
        "--micro-batch",
        "4",
    ]
    for source in (["--model", "tiny-gpt"], ["--init-from", str(gpt2)]):
        line = refused([*base, *source, "--out", str(tmp_path / "g")], capsys)
        assert "seq_len 128 exceeds the model's max_seq_len 64" in line
    launched = []
    for n, source in enumerate((["--model", "tiny-llama"], ["--init-from", str(llama)])):
        with pytest.MonkeyPatch.context() as m:
            m.setattr("plait.cli.train.launch", launched.append)
            assert main([*base, *source, "--out", str(tmp_path / f"l{n}")]) == 0
        err = " ".join(capsys.readouterr().err.split())
        assert err.startswith("plait: warning: seq_len 128 is longer than the model's "), err
        assert "max_seq_len 64 (max_position_embeddings): RoPE runs past it" in err
    assert [cfg.train.seq_len for cfg in launched] == [128, 128]


def test_init_from_with_a_larger_tokenizer_is_refused(tmp_path, corpus, capsys) -> None:
    """A tokenizer with more tokens than an --init-from folder's embedding has rows would fail
    in the workers' weight loading; a smaller one is kept with the folder's (padded) rows."""
    folder = save(gpt2_config(vocab=280), tmp_path / "gpt2")
    tokenizer = tmp_path / "tok.json"
    spec = train_bpe(iter([corpus.read_text() * 5]), 300, tokenizer, None, False)
    assert spec.vocab_size > 280
    capsys.readouterr()  # transformers' own lines while saving
    argv = ["train", "--init-from", str(folder), "--tokenizer", str(tokenizer), "--data",
            str(corpus), "--seq-len", "16", "--global-batch", "4",
            "--micro-batch", "4"]  # fmt: skip
    line = refused([*argv, "--out", str(tmp_path / "a")], capsys)
    assert (
        f"has {spec.vocab_size} tokens, more than the --init-from folder's vocab_size 280" in line
    )
    launched = []
    with pytest.MonkeyPatch.context() as m:
        m.setattr("plait.cli.train.launch", launched.append)
        bigger = save(gpt2_config(vocab=400), tmp_path / "gpt2-400")
        argv[2] = str(bigger)
        assert main([*argv, "--out", str(tmp_path / "b")]) == 0
    assert launched[0].model.vocab_size == 400
