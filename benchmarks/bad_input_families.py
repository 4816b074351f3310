"""The bad-input sweep's cases for the model families (issue 31): a family plait does not
build, a config.json field it cannot express (Phi-3's longrope), a Hugging Face folder whose
weights disagree with its config.json (a tensor missing, a shape wrong) and a chat model's
folder without a chat template. `folders` makes what they name under `{S}`."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from bad_input_cases import FROM_HF, Case

PHI3_128K = {
    "model_type": "phi3", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_act": "silu",
    "rope_scaling": {"type": "longrope", "long_factor": [1.0] * 8, "short_factor": [1.0] * 8},
}  # fmt: skip
"""The shape of Phi-3-mini-128k's config.json, small: its RoPE is longrope."""


def family_cases() -> list[Case]:
    train = ("train", *FROM_HF, "--out", "{S}/new-run", "--init-from")
    return [
        Case("wrong value", ("train", *FROM_HF, "--out", "{S}/new-run", "--family", "mamba")),
        Case("wrong type", (*train, "{S}/hf-longrope")),
        Case("wrong type", ("generate", "--init-from", "{S}/hf-longrope", "--prompt", "x")),
        Case("wrong type", (*train, "{S}/hf-missing")),
        Case("wrong type", (*train, "{S}/hf-shape")),
        Case("wrong type", ("eval", "--init-from", "{S}/hf-shape", "--data", "{S}/text.txt")),
        Case("wrong type", ("generate", "--init-from", "{S}/hf-tok", "--chat", "--prompt", "x")),
    ]


def folders(root: Path) -> None:
    """{S}/hf-longrope (a config.json only: it is refused before any weight is read), and
    copies of {S}/hf-ok with one tensor removed ({S}/hf-missing) or a config.json whose
    MLP width disagrees with the weights ({S}/hf-shape)."""
    from safetensors.torch import load_file, save_file

    (root / "hf-longrope").mkdir()
    (root / "hf-longrope" / "config.json").write_text(json.dumps(PHI3_128K))
    shutil.copytree(root / "hf-ok", root / "hf-missing")
    weights = root / "hf-missing" / "model.safetensors"
    tensors = load_file(str(weights))
    del tensors[sorted(tensors)[-1]]
    save_file(tensors, str(weights))
    shutil.copytree(root / "hf-ok", root / "hf-shape")
    config = json.loads((root / "hf-ok" / "config.json").read_text())
    config["n_inner"] = 2 * config["n_inner"]
    (root / "hf-shape" / "config.json").write_text(json.dumps(config))
