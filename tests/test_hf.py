"""Hugging Face in and out, checked against `transformers` itself (fp32).

Tiny LlamaForCausalLM (grouped-query attention, RoPE with a non-default base, untied and
tied heads, a sharded folder) and GPT2LMHeadModel (fused Conv1D q/k/v, tied head) are built
from configs with random weights and saved locally; nothing is downloaded. plait loads them
and must compute `transformers`' logits; a plait run started from them and exported must
load in `transformers` and compute plait's logits. Multi-rank loading: test_hf_world2.py.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from hf_models import gpt2_config, hf_model, llama_config, save  # noqa: E402
from plait.checkpoint.inspect import load_model  # noqa: E402
from plait.cli import main  # noqa: E402
from plait.cli.models import stop_folder  # noqa: E402
from plait.errors import ConfigError  # noqa: E402
from plait.models.generate import stop_ids  # noqa: E402
from plait.models.hf.config_json import from_hf_config  # noqa: E402
from plait.models.hf.export import shard  # noqa: E402
from plait.models.hf.load import hf_source, load_config  # noqa: E402
from plait.models.init import fill_parameters, seeded, source_values  # noqa: E402
from plait.models.transformer import Transformer  # noqa: E402
from plait.parallel.tp.sharding import split_spec  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6
VOCAB = 300  # above the byte tokenizer's 256, so plait can train on bytes


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    return {
        "llama": save(llama_config(), root / "llama"),
        "llama-tied": save(llama_config(tie_word_embeddings=True), root / "llama-tied"),
        "llama-sharded": save(llama_config(), root / "sharded", seed=1, max_shard_size="60KB"),
        "gpt2": save(gpt2_config(), root / "gpt2"),
    }


def hf_logits(folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(folder)(tokens).logits


def plait_from(folder: Path) -> Transformer:
    cfg = load_config(folder)
    model = Transformer(cfg)
    fill_parameters(model, hf_source(folder, cfg))
    return model.eval()


TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("kind", ["llama", "llama-tied", "llama-sharded", "gpt2"])
def test_plait_computes_the_logits_of_transformers(folders, kind: str) -> None:
    if kind == "llama-sharded":
        assert (folders[kind] / "model.safetensors.index.json").is_file()
    with torch.no_grad():
        ours = plait_from(folders[kind])(TOKENS)
    torch.testing.assert_close(ours, hf_logits(folders[kind], TOKENS), rtol=RTOL, atol=ATOL)


def test_the_config_fields_map(folders) -> None:
    cfg = load_config(folders["llama"])
    assert (cfg.n_heads, cfg.kv_heads, cfg.ffn_dim, cfg.rope_theta, cfg.norm_eps) == (
        4, 2, 96, 5000.0, 1e-5,
    )  # fmt: skip
    assert not cfg.tie_embeddings and load_config(folders["llama-tied"]).tie_embeddings
    gpt = load_config(folders["gpt2"])
    assert (gpt.pos, gpt.mlp, gpt.ffn_dim, gpt.max_seq_len, gpt.bias) == (
        "learned", "gelu", 256, 64, True,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "over", "message"),
    [
        ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu' cannot be expressed"),
        ("llama", {"attention_bias": True}, "attention_bias=True cannot be expressed"),
        ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type='linear'"),
        ("llama", {"mlp_bias": True}, "mlp_bias=True cannot be expressed"),
        ("llama", {"model_type": "falcon"}, "model_type='falcon' is not one plait reads"),
        ("gpt2", {"activation_function": "relu"}, "activation_function='relu'"),
        ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
        ("llama", {"hidden_size": None}, "the field 'hidden_size' is missing"),
    ],
)
def test_what_plait_cannot_express_is_named(kind: str, over: dict, message: str) -> None:
    hf = (llama_config() if kind == "llama" else gpt2_config()).to_dict()
    hf.update(over)
    hf = {k: v for k, v in hf.items() if v is not None}
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        from_hf_config(hf)


def _train(folder: Path, out: Path, corpus: Path, *extra: str) -> int:
    run = ["--steps", "2", "--seq-len", "16", "--global-batch", "2", "--micro-batch", "2",
           "--eval-batches", "1", "--no-progress", "--device", "cpu"]  # fmt: skip
    return main(["train", "--init-from", str(folder), "--data", str(corpus), "--out", str(out),
                 *run, *extra])  # fmt: skip


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text("Hugging Face folders in and out of plait. " * 400)
    return path


@pytest.fixture(scope="module")
def runs(folders, corpus, tmp_path_factory) -> dict[str, Path]:
    """Two steps of fine-tuning from each family's folder (the summary writes a sample)."""
    out = {kind: tmp_path_factory.mktemp(f"run-{kind}") for kind in ("llama", "gpt2")}
    for kind, folder in out.items():
        assert _train(folders[kind], folder, corpus, "--overwrite") == 0
    return out


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_fine_tune_then_export_loads_in_transformers(folders, runs, kind, tmp_path) -> None:
    summary = json.loads((runs[kind] / "summary.json").read_text())
    assert summary["sample"]["prompt"] and summary["sample"]["text"]  # the model wrote
    assert main(["export", "--checkpoint", str(runs[kind]), "--format", "hf", "--out",
                 str(tmp_path / "hf"), "--max-shard-mb", "0.1"]) == 0  # fmt: skip
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()  # sharded
    trained = load_model(runs[kind] / "checkpoints" / "step-2").eval()
    with torch.no_grad():
        ours = trained(TOKENS)
    assert not torch.allclose(ours, plait_from(folders[kind])(TOKENS))  # training moved it
    torch.testing.assert_close(hf_logits(tmp_path / "hf", TOKENS), ours, rtol=RTOL, atol=ATOL)


def test_generate_from_a_folder_and_a_run(folders, runs, tmp_path, capsys) -> None:
    argv = ["generate", "--prompt", "plait ", "--max-new-tokens", "6"]
    assert main([*argv, "--init-from", str(folders["gpt2"])]) == 0
    assert capsys.readouterr().out.startswith("plait ")
    assert main([*argv, "--checkpoint", str(runs["llama"]), "--temperature", "0.8"]) == 0
    assert capsys.readouterr().out.startswith("plait ")
    (tmp_path / "summary.json").write_text("{}")  # a run folder that saved nothing
    assert main([*argv, "--checkpoint", str(tmp_path)]) == 2
    assert "has no checkpoint (trained with --no-save" in capsys.readouterr().err
    # a run's stop ids are the generation_config.json's of the folder it started from
    args = argparse.Namespace(init_from=None, checkpoint=str(runs["llama"]))
    assert stop_folder(args) == str(folders["llama"])
    assert stop_ids(-1, stop_folder(args)) == [llama_config().eos_token_id]


def _bad_folder(folders: dict[str, Path], tmp_path: Path, what: str) -> Path:
    bad = tmp_path / what
    bad.mkdir()
    config = (folders["llama"] / "config.json").read_text()
    weights = (folders["llama"] / "model.safetensors").read_bytes()
    if what != "no-config":
        (bad / "config.json").write_text("{not json" if what == "bad-json" else config)
    if what == "bad-weights":
        (bad / "model.safetensors").write_bytes(b"\x00" * 16)
    elif what == "wrong-shape":
        (bad / "config.json").write_text(
            config.replace('"intermediate_size": 96', '"intermediate_size": 64')
        )
        (bad / "model.safetensors").write_bytes(weights)
    return bad


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("missing", "is not a folder"),
        ("no-config", "config.json' does not exist"),
        ("bad-json", "is not readable JSON"),
        ("no-weights", "has neither model.safetensors nor model.safetensors.index.json"),
        ("bad-weights", "is not a readable safetensors file"),
        ("wrong-shape", "gate_proj.weight' has shape [96, 64], config.json implies [64, 64]"),
    ],
)
def test_bad_folders_stop_before_workers(folders, corpus, tmp_path, capsys, what, message):
    folder = tmp_path / "nowhere" if what == "missing" else _bad_folder(folders, tmp_path, what)
    assert _train(folder, tmp_path / "run", corpus) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_explicit_model_values_must_agree(folders, corpus, tmp_path, capsys) -> None:
    llama = folders["llama"]
    assert _train(llama, tmp_path / "a", corpus, "--d-model", "128") == 2
    assert f"model.d_model=128 conflicts with model.d_model=64 from --init-from {llama}" in (
        capsys.readouterr().err
    )
    assert _train(llama, tmp_path / "b", corpus, "--model", "tiny-gpt") == 2
    assert (
        f"--model tiny-gpt and --init-from {llama} both name the model" in capsys.readouterr().err
    )


def test_export_never_leaves_a_half_written_folder(runs, tmp_path, capsys, monkeypatch) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("")
    argv = ["export", "--checkpoint", str(runs["gpt2"]), "--format", "hf", "--out"]
    assert main([*argv, str(tmp_path / "taken")]) == 2
    assert "already exists and is not an empty folder" in capsys.readouterr().err

    def full_disk(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr("plait.models.hf.export.save_file", full_disk)
    with pytest.raises(OSError):
        main([*argv, str(tmp_path / "hf")])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


def test_shards_keep_under_the_limit() -> None:
    tensors = {f"t{i}": torch.zeros(100) for i in range(5)}  # 400 bytes each
    assert [list(s) for s in shard(tensors, 900)] == [["t0", "t1"], ["t2", "t3"], ["t4"]]
    assert [list(s) for s in shard(tensors, 10)] == [[n] for n in sorted(tensors)]


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_row_band_reads_the_rows_of_the_local_tensor(folders, kind: str) -> None:
    """What ZeRO-3 asks for: rows [r0, r1) of a tp shard, vocabulary padding included."""
    cfg = load_config(folders[kind])
    with torch.device("meta"):
        model = Transformer(cfg)
    # The last of 7 ranks, padded: 300 vocabulary rows -> 42 real + 1 padding, wk's 32 rows
    # -> 2 + 3, wo's 64 columns -> 4 + 6; GPT-2's wk a column range of c_attn.
    parts = {"embed.tok": 0, "blocks.1.attn.wk": 0, "blocks.0.attn.wo": 1}
    specs = {}
    for path, dim in parts.items():
        module = model.get_submodule(path)
        spec = split_spec(tuple(module.weight.shape), dim, 6, 7, pad=True)
        specs[f"{path}.weight"] = spec
        module.weight = torch.nn.Parameter(torch.empty(spec.shape, device="meta"))
    model.set_contract(model.contract.with_shards(specs))
    for source in (hf_source(folders[kind], cfg), seeded(cfg, 5)):
        value = source_values(model, source)
        for p in model.parameters():
            whole = value(p)
            for r0, r1 in [(0, 1), (1, whole.shape[0]), (whole.shape[0] - 1, whole.shape[0])]:
                assert torch.equal(value(p, (r0, r1)), whole[r0:r1])
