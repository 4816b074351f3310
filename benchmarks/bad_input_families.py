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
        *windowed_cases(train),
    ]


GEMMA3_VISION = {"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"]}
GEMMA3_SCALED = {
    "model_type": "gemma3_text", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16,
    "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0}},
}  # fmt: skip
"""Gemma 3 4B's shape, small: its global layers' RoPE is linearly scaled."""
GEMMA2_LAYERS = {
    "model_type": "gemma2", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
    "num_hidden_layers": 3, "num_attention_heads": 4, "head_dim": 16,
    "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
}  # fmt: skip
"""Layer types no period describes (plait: every n-th layer global)."""


ZERO_WINDOW = ("--model", "tiny-mistral", "--sliding-window", "0")


def windowed_cases(train: tuple[str, ...]) -> list[Case]:
    """Mistral and Gemma: a window of 0 positions, Gemma 3's multimodal folder, its scaled
    global RoPE (4B and up) and irregular layer types."""
    return [
        Case("wrong value", ("train", *FROM_HF, "--out", "{S}/new-run", *ZERO_WINDOW)),
        Case("wrong type", (*train, "{S}/hf-gemma3-vision")),
        Case("wrong type", (*train, "{S}/hf-gemma3-scaled")),
        Case("wrong type", ("generate", "--init-from", "{S}/hf-gemma2-layers", "--prompt", "x")),
    ]


def windowed_folders(root: Path) -> None:
    """The config.json of each windowed case (refused before any weight is read)."""
    for name, config in (("hf-gemma3-vision", GEMMA3_VISION), ("hf-gemma3-scaled", GEMMA3_SCALED),
                         ("hf-gemma2-layers", GEMMA2_LAYERS)):  # fmt: skip
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))


def folders(root: Path) -> None:
    """{S}/hf-longrope (a config.json only: it is refused before any weight is read), and
    copies of {S}/hf-ok with one tensor removed ({S}/hf-missing) or a config.json whose
    MLP width disagrees with the weights ({S}/hf-shape)."""
    from safetensors.torch import load_file, save_file

    windowed_folders(root)
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
