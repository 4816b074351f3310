"""PEFT adapter folders as PEFT (0.21) writes them today: the Linears an adapter_config.json
targets are found the way PEFT finds them (names, dotted suffixes, the full paths it writes
for "all-linear", a pattern, layers_to_transform, exclude_modules), checked against the
modules PEFT itself wraps on the same tiny base; what plait cannot express is refused in one
line naming it; and an "all-linear" adapter saved by PEFT loads in `plait train --adapter` and
`plait eval --adapter` with PEFT's loss."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from hf_models import gpt2_config, hf_model, llama_config, save  # noqa: E402
from plait.cli import main  # noqa: E402
from plait.errors import ConfigError  # noqa: E402
from plait.models.block_table import table_for  # noqa: E402
from plait.models.hf.load import load_config  # noqa: E402
from plait.models.hf.peft import adapter_model_fields  # noqa: E402
from plait.models.hf.peft_targets import block_modules  # noqa: E402
from plait.models.lora import parse_targets  # noqa: E402

BASE = {"peft_type": "LORA", "r": 4, "lora_alpha": 8}


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bases")
    return {"llama": save(llama_config(num_hidden_layers=3), root / "llama"),
            "gpt2": save(gpt2_config(n_layer=3), root / "gpt2"),
            "llama2": save(llama_config(), root / "llama2")}  # fmt: skip


def _peft_wraps(folder: Path, **config) -> set[str]:
    """The module names PEFT itself gives a LoRA layer under `config`."""
    model = peft.get_peft_model(hf_model(folder), peft.LoraConfig(r=4, **config))
    inner = model.base_model.model
    return {n for n, m in inner.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}


def _plait_wraps(folder: Path, config: dict) -> set[str]:
    """The module names plait adapts for `config`: its targets in every layer."""
    cfg = load_config(folder)
    fields = adapter_model_fields({**BASE, **config}, cfg)
    names = parse_targets(fields["lora_targets"], cfg.arch)
    leaves = {table_for(cfg.arch).targets[n] for n in names}
    return {m for m, held in block_modules(cfg).items() if any(lf in leaves for _, lf in held)}


LLAMA_SAME = [
    {"target_modules": "all-linear"},
    {"target_modules": "ALL-LINEAR"},
    {"target_modules": ["q_proj", "v_proj"]},
    {"target_modules": ["self_attn.q_proj", "mlp.down_proj"]},
    {"target_modules": [f"model.layers.{i}.mlp.up_proj" for i in range(3)]},
    {"target_modules": r".*\.(k|o)_proj"},
    {"target_modules": ["q_proj", "k_proj"], "layers_to_transform": [0, 1, 2]},
    {"target_modules": ["up_proj"], "layers_to_transform": [0, 1, 2], "layers_pattern": "layers"},
    {"target_modules": "all-linear", "exclude_modules": ["gate_proj", "up_proj"]},
    {"target_modules": ["q_proj", "v_proj"], "exclude_modules": r".*\.v_proj"},
    {"target_modules": ["q_proj", "v_proj"], "modules_to_save": []},
    {"target_modules": None},  # PEFT's default for the architecture
]
GPT2_SAME = [
    {"target_modules": "all-linear"},
    {"target_modules": ["c_attn"]},
    {"target_modules": ["attn.c_proj", "c_fc"]},
    {"target_modules": [f"transformer.h.{i}.mlp.c_proj" for i in range(3)]},
]


@pytest.mark.parametrize(
    ("kind", "config"),
    [("llama", c) for c in LLAMA_SAME] + [("gpt2", c) for c in GPT2_SAME],
    ids=[f"llama-{i}" for i in range(len(LLAMA_SAME))]
    + [f"gpt2-{i}" for i in range(len(GPT2_SAME))],
)
def test_the_linears_are_those_peft_wraps(bases, kind, config) -> None:
    peft_config = {k: v for k, v in config.items() if v is not None}
    if kind == "gpt2":
        peft_config["fan_in_fan_out"] = True
    assert _plait_wraps(bases[kind], config) == _peft_wraps(bases[kind], **peft_config)


REFUSED = [
    ({"target_modules": ["q_proj"], "layers_to_transform": [0, 2]},
     "layers_to_transform=[0, 2] adapts self_attn.q_proj in layers [0, 2] of 3 only"),
    ({"target_modules": ["q_proj"], "layers_to_transform": 1},
     "layers_to_transform=1 adapts self_attn.q_proj in layers [1] of 3 only"),
    ({"target_modules": ["model.layers.0.self_attn.q_proj"]},
     "adapts self_attn.q_proj in layers [0] of 3 only"),
    ({"target_modules": ["q_proj", "lm_head"]},
     "adapt 'lm_head' (1 such), which is not a Linear of a LLaMA block that plait adapts"),
    ({"target_modules": ["self_attn"]}, "adapt 'model.layers.0.self_attn' (3 such)"),
    ({"target_modules": ["qkv_proj"]}, "match no module of the base; its Linears: down_proj"),
    ({"target_modules": "(q_proj"}, "target_modules='(q_proj' is no regular expression"),
    ({"target_modules": 3}, "target_modules=3 is neither a list of module names nor a regular"),
    ({"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]},
     "modules_to_save=['lm_head'] is not plain LoRA; plait cannot compute it"),
    ({"target_modules": ["q_proj"], "use_dora": True}, "use_dora=True is not plain LoRA"),
    ({"target_modules": ["q_proj"], "use_rslora": True}, "use_rslora=True is not plain LoRA"),
    ({"target_modules": ["q_proj"], "rank_pattern": {"q_proj": 8}},
     "rank_pattern={'q_proj': 8} is not plain LoRA"),
    ({"target_modules": ["q_proj"], "alpha_pattern": {"q_proj": 2}},
     "alpha_pattern={'q_proj': 2} is not plain LoRA"),
    ({"target_modules": ["q_proj"], "init_lora_weights": "pissa"},
     "init_lora_weights='pissa' also rewrites the base's weights"),
]  # fmt: skip


@pytest.mark.parametrize(("config", "message"), REFUSED, ids=[m[:30] for _, m in REFUSED])
def test_what_plait_cannot_express_is_refused_naming_it(bases, config, message) -> None:
    with pytest.raises(ConfigError) as e:
        adapter_model_fields({**BASE, **config}, load_config(bases["llama"]), "a.json")
    assert message in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith("a.json: ")


@pytest.fixture(scope="module")
def all_linear(bases, tmp_path_factory) -> Path:
    """An "all-linear" adapter as PEFT 0.21 saves it on a 2-layer base (target_modules: the
    14 full module paths; from 20 on PEFT shortens them to suffixes, which the mapping test
    covers), its A and B random so the loss differs from the base's."""
    model = peft.get_peft_model(hf_model(bases["llama2"]), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"))  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    out = tmp_path_factory.mktemp("peft") / "all-linear"
    model.save_pretrained(out)
    saved = json.loads((out / "adapter_config.json").read_text())["target_modules"]
    assert "model.layers.0.self_attn.k_proj" in saved and len(saved) == 2 * 7
    return out


def _peft_loss(base: Path, adapter: Path, corpus: Path, seq: int) -> float:
    """PEFT's token-mean cross entropy over every whole window of `seq` + 1 bytes."""
    model = peft.PeftModel.from_pretrained(hf_model(base), adapter).eval()
    data = torch.tensor(list(corpus.read_bytes()))
    n = (len(data) - 1) // seq
    windows = torch.stack([data[i * seq : i * seq + seq + 1] for i in range(n)])
    with torch.no_grad():
        out = model(input_ids=windows[:, :-1]).logits
    return F.cross_entropy(out.flatten(0, 1), windows[:, 1:].flatten()).item()


def test_an_all_linear_adapter_gives_peft_loss_in_eval_and_train(
    bases, all_linear, tmp_path, capsys
) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("PEFT writes full module paths for all-linear. " * 30)
    base = str(bases["llama2"])
    want = _peft_loss(bases["llama2"], all_linear, corpus, 16)
    common = ["--data", str(corpus), "--seq-len", "16", "--device", "cpu"]
    assert main(["eval", "--init-from", base, "--adapter", str(all_linear),
                 *common, "--json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["loss"] == pytest.approx(want, rel=1e-5)
    run = tmp_path / "run"  # a step too small to move fp32 values: the checkpoint holds the adapter
    assert main(["train", "--init-from", base, "--adapter", str(all_linear),
                 *common, "--out", str(run), "--steps", "1", "--global-batch", "2",
                 "--micro-batch", "1", "--eval-batches", "1", "--no-progress", "--lr", "1e-30",
                 "--min-lr", "0", "--weight-decay", "0"]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["eval", "--checkpoint", str(run), *common, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["loss"] == pytest.approx(want, rel=1e-5)
    config = json.loads((run / "config.json").read_text())
    assert config["model"]["lora_targets"] == "q,k,v,o,gate,up,down"
