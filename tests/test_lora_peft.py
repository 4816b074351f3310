"""Single-process LoRA is PEFT's LoRA, and adapters travel both ways (fp32, rtol 1e-5).

Tiny LlamaForCausalLM (grouped-query attention) and GPT2LMHeadModel (q, k and v in one
Conv1D, stored (in, out)) are built from configs; PEFT wraps them with LoraConfig on every
Linear of a block, and plait loads the same base with the same A and B (B nonzero, so A's
gradient is not trivially zero): the loss and every adapter gradient after one
forward/backward, and the logits after a few AdamW steps (plain loops), are PEFT's. A folder
plait writes loads in `PeftModel.from_pretrained` with plait's logits and one PEFT writes
loads into plait with PEFT's; `plait train/eval/generate --adapter` and `plait export
--format peft` (dp=1, tp=2, pp=2, ZeRO-3) go through the command line; bad adapters stop before any
worker starts, with one line.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

import in_process  # noqa: E402
from hf_models import gpt2_config, hf_model, llama_config, save  # noqa: E402
from plait.checkpoint import inspect, store  # noqa: E402
from plait.cli import main  # noqa: E402
from plait.cli.models import load_generator  # noqa: E402
from plait.errors import ConfigError  # noqa: E402
from plait.models.architecture import ModelConfig  # noqa: E402
from plait.models.declare import is_adapter  # noqa: E402
from plait.models.hf.load import hf_source, load_config  # noqa: E402
from plait.models.hf.peft import (  # noqa: E402
    adapter_model_fields,
    adapter_source,
    adapter_tensors,
    read_adapter_config,
    save_adapter,
)
from plait.models.init import ValueSource, fill_parameters, with_adapters  # noqa: E402
from plait.models.transformer import Transformer  # noqa: E402

RTOL, ATOL = 1e-5, 1e-6
RANK, ALPHA = 4, 16.0
PEFT_ALL = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],  # c_proj: attn's and mlp's
}
ALL = {"llama": "q,k,v,o,gate,up,down", "gpt2": "q,k,v,o,up,down"}
# Adam divides by the gradient's root mean square, so an element whose gradient is near zero
# turns fp32 rounding into a step of up to lr: a small lr keeps that under the tolerance while
# the steps still move the logits (by ~0.5 here; asserted).
ADAMW = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bases")
    return {
        "llama": save(llama_config(), root / "llama"),
        "gpt2": save(gpt2_config(), root / "gpt2"),
        "llama-wide": save(llama_config(intermediate_size=128), root / "llama-wide"),
    }


def lora_config(folder: Path, targets: str = "all") -> ModelConfig:
    cfg = load_config(folder)
    cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets = RANK, ALPHA, targets
    cfg.validate()
    return cfg


def random_adapters(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Every adapter of `cfg`, A and B alike ~ N(0, 0.1^2)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in Transformer(cfg).named_parameters() if is_adapter(n)}
    return {n: torch.randn(s, generator=gen) * 0.1 for n, s in shapes.items()}


def given(tensors: dict[str, torch.Tensor]) -> ValueSource:
    return lambda name, shape, shard: tensors[name]


def plait_model(folder: Path, cfg: ModelConfig, adapters: ValueSource) -> Transformer:
    model = Transformer(cfg)
    fill_parameters(model, with_adapters(hf_source(folder, cfg), cfg, 0, adapters))
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
    return model.eval()


def peft_model(folder: Path, kind: str, targets: list[str]):
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=targets,
                             fan_in_fan_out=kind == "gpt2", task_type="CAUSAL_LM")  # fmt: skip
    return peft.get_peft_model(hf_model(folder), config).eval()


def peft_adapters(model, what) -> dict[str, torch.Tensor]:
    """PEFT's adapter tensors (or their gradients) under the keys its files use."""
    return {n.replace(".default", ""): what(p) for n, p in model.named_parameters()
            if p.requires_grad}  # fmt: skip


def loss_of(logits: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), TOKENS[:, 1:].flatten())


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        out = model(TOKENS)
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_loss_gradients_and_steps_are_peft(folders, kind: str) -> None:
    cfg = lora_config(folders[kind])
    start = random_adapters(cfg, seed=1)
    ours = plait_model(folders[kind], cfg, given(start))
    theirs = peft_model(folders[kind], kind, PEFT_ALL[kind])
    loaded = peft.set_peft_model_state_dict(theirs, adapter_tensors(cfg, start))
    assert not loaded.unexpected_keys
    assert sorted(peft_adapters(theirs, lambda p: p)) == sorted(adapter_tensors(cfg, start))
    before = logits(ours)
    losses = [loss_of(ours(TOKENS)), loss_of(theirs(input_ids=TOKENS).logits)]
    torch.testing.assert_close(losses[0], losses[1], rtol=RTOL, atol=0)
    for loss in losses:
        loss.backward()
    grads = {n: p.grad for n, p in ours.named_parameters() if is_adapter(n)}
    ours_grads, theirs_grads = adapter_tensors(cfg, grads), peft_adapters(theirs, lambda p: p.grad)
    assert sorted(ours_grads) == sorted(theirs_grads)
    for key, grad in theirs_grads.items():
        assert grad.abs().max() > 0, key  # B nonzero: A's gradient is not trivially zero
        scale = RTOL * grad.abs().max().item()  # fp32 sums in another order: relative to
        torch.testing.assert_close(ours_grads[key], grad, rtol=RTOL, atol=scale)  # the tensor
    steps = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], **ADAMW)
             for m in (ours, theirs)]  # fmt: skip
    for step in range(4):
        if step:
            for opt, model in zip(steps, (ours, theirs), strict=True):
                opt.zero_grad()
                loss_of(logits_of(model)).backward()
        for opt in steps:
            opt.step()
    after = logits(ours)
    assert not torch.allclose(after, before, rtol=1e-3)  # the steps moved it
    torch.testing.assert_close(after, logits(theirs), rtol=RTOL, atol=ATOL)


def logits_of(model) -> torch.Tensor:
    out = model(TOKENS)
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.mark.parametrize(
    ("kind", "targets", "modules"),
    [
        ("llama", "all", sorted(PEFT_ALL["llama"])),
        ("llama", "", ["q_proj", "v_proj"]),
        ("gpt2", "all", ["attn.c_proj", "c_attn", "c_fc", "mlp.c_proj"]),
        ("gpt2", "o", ["attn.c_proj"]),  # not mlp's c_proj
    ],
)
def test_peft_loads_what_plait_saves(folders, tmp_path, kind, targets, modules) -> None:
    cfg = lora_config(folders[kind], targets)
    adapters = random_adapters(cfg, seed=2)
    save_adapter(tmp_path / "adapter", cfg, adapters, str(folders[kind]))
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["target_modules"],
            config["fan_in_fan_out"], config["base_model_name_or_path"]) == (
        "LORA", RANK, 16, modules, kind == "gpt2", str(folders[kind]),
    )  # fmt: skip
    theirs = peft.PeftModel.from_pretrained(hf_model(folders[kind]), tmp_path / "adapter").eval()
    ours = logits(plait_model(folders[kind], cfg, given(adapters)))
    assert not torch.allclose(ours, logits(hf_model(folders[kind])), rtol=1e-3)
    torch.testing.assert_close(ours, logits(theirs), rtol=RTOL, atol=ATOL)


@pytest.fixture(scope="module")
def peft_saved(folders, tmp_path_factory) -> dict[str, Path]:
    """Adapters on every Linear of a block, random A and B, as PEFT itself saves them."""
    root = tmp_path_factory.mktemp("peft-saved")
    out = {}
    for seed, kind in enumerate(("llama", "gpt2")):
        model = peft_model(folders[kind], kind, PEFT_ALL[kind])
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        model.save_pretrained(root / kind)
        out[kind] = root / kind
    return out


def from_adapter(base: Path, folder: Path) -> tuple[ModelConfig, Transformer]:
    cfg = load_config(base)
    fields = adapter_model_fields(read_adapter_config(folder), cfg)
    for key, value in fields.items():
        setattr(cfg, key, value)
    return cfg, plait_model(base, cfg, adapter_source(folder, cfg))


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_plait_reads_what_peft_saves(folders, peft_saved, kind: str) -> None:
    fields = adapter_model_fields(read_adapter_config(peft_saved[kind]), load_config(
        folders[kind]))  # fmt: skip
    assert fields == {"lora_rank": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0,
                      "lora_targets": ALL[kind]}  # fmt: skip
    _, ours = from_adapter(folders[kind], peft_saved[kind])
    theirs = peft.PeftModel.from_pretrained(hf_model(folders[kind]), peft_saved[kind]).eval()
    torch.testing.assert_close(logits(ours), logits(theirs), rtol=RTOL, atol=ATOL)


def test_an_adapter_without_tensors_is_never_written(folders, tmp_path) -> None:
    with pytest.raises(ConfigError, match="no adapter tensors to write"):
        save_adapter(tmp_path / "empty", load_config(folders["llama"]), {}, "")
    assert not (tmp_path / "empty").exists()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "corpus.txt"
    path.write_text("Adapters in and out of plait, as PEFT writes them. " * 40)
    return path


RUN = ["--steps", "2", "--seq-len", "16", "--global-batch", "2", "--micro-batch", "1",
       "--eval-batches", "1", "--no-progress", "--device", "cpu"]  # fmt: skip


def plait_checkpoint_logits(base: Path, run: Path) -> torch.Tensor:
    """What plait computes for a LoRA checkpoint: the base's folder and its adapters."""
    checkpoint = store.complete(run)
    cfg = inspect.model_config(checkpoint)
    return logits(plait_model(base, cfg, given(inspect.read_masters(checkpoint))))


@pytest.mark.parametrize(
    "layout",
    [[], ["--tp", "2"], ["--pp", "2"], ["--dp", "2", "--zero", "3"]],
    ids=["dp1", "tp2", "pp2", "dp2-zero3"],
)
def test_export_peft_loads_in_peft(folders, corpus, world2, tmp_path, layout) -> None:
    argv = [
        "--init-from",
        str(folders["llama"]),
        "--data",
        str(corpus),
        "--out",
        str(tmp_path / "run"),
        *RUN,
        "--lora-rank",
        "4",
        "--lora-targets",
        "all",
        *layout,
    ]
    if layout:  # fmt: skip
        code, err = in_process.train(world2, argv)
    else:
        code = main(["train", *argv])
        err = ""
    assert code == 0, err[-3000:]
    out = tmp_path / "peft"
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--format", "peft",
                 "--out", str(out)]) == 0  # fmt: skip
    theirs = peft.PeftModel.from_pretrained(hf_model(folders["llama"]), out).eval()
    ours = plait_checkpoint_logits(folders["llama"], tmp_path / "run")
    torch.testing.assert_close(logits(theirs), ours, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("layout", [["--tp", "2"], ["--dp", "2", "--zero", "3"]],
                         ids=["tp2", "dp2-zero3"])  # fmt: skip
def test_train_from_a_peft_adapter(folders, peft_saved, corpus, world2, tmp_path, layout) -> None:
    """GPT-2 (c_attn's B split three ways, then by output under tp; c_proj's A by input;
    under ZeRO-3 each rank reads its rows) trained from PEFT's adapter: the checkpoint's
    adapters are the folder's, moved by two small steps, and export back to PEFT."""
    run = tmp_path / "run"
    code, err = in_process.train(world2, ["--init-from", str(folders["gpt2"]), "--adapter",
                                          str(peft_saved["gpt2"]), "--data", str(corpus),
                                          "--out", str(run), *RUN, "--lr", "1e-3",
                                          "--warmup-steps", "0", *layout])  # fmt: skip
    assert code == 0, err[-3000:]
    assert main(["export", "--checkpoint", str(run), "--format", "peft", "--out",
                 str(tmp_path / "peft")]) == 0  # fmt: skip
    start = load_file(str(peft_saved["gpt2"] / "adapter_model.safetensors"))
    trained = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    assert sorted(trained) == sorted(start)
    moved = max((trained[k] - start[k]).abs().max().item() for k in start)
    assert 0 < moved < 5e-3  # two Adam steps of lr 1e-3 from the folder's values
    theirs = peft.PeftModel.from_pretrained(hf_model(folders["gpt2"]), tmp_path / "peft").eval()
    ours = plait_checkpoint_logits(folders["gpt2"], run)
    torch.testing.assert_close(logits(theirs), ours, rtol=RTOL, atol=ATOL)


def test_eval_and_generate_with_a_peft_adapter(folders, peft_saved, corpus, capsys) -> None:
    """`plait eval --adapter` gives PEFT's loss; `plait generate --adapter`'s model PEFT's
    logits (its text would need byte ids: this vocabulary has 300)."""
    base, adapter = folders["llama"], peft_saved["llama"]
    theirs = peft.PeftModel.from_pretrained(hf_model(base), adapter).eval()
    data = torch.tensor(list(corpus.read_bytes()))
    n = (len(data) - 1) // 16
    windows = torch.stack([data[i * 16 : i * 16 + 17] for i in range(n)])
    with torch.no_grad():
        out = theirs(input_ids=windows[:, :-1]).logits
    want = F.cross_entropy(out.flatten(0, 1), windows[:, 1:].flatten()).item()
    assert main(["eval", "--init-from", str(base), "--adapter", str(adapter), "--data",
                 str(corpus), "--seq-len", "16", "--device", "cpu", "--json"]) == 0  # fmt: skip
    assert json.loads(capsys.readouterr().out)["loss"] == pytest.approx(want, rel=1e-5)
    args = argparse.Namespace(checkpoint=None, init_from=str(base), adapter=str(adapter))
    torch.testing.assert_close(logits(load_generator(args)), logits(theirs), rtol=RTOL, atol=ATOL)


def _bad(folder: Path, tmp_path: Path, what: str) -> Path:
    """A copy of a good PEFT folder with one thing wrong."""
    bad = tmp_path / what
    shutil.copytree(folder, bad)
    config = json.loads((bad / "adapter_config.json").read_text())
    if what == "bad-json":
        (bad / "adapter_config.json").write_text("{not json")
    elif what == "pickle":
        (bad / "adapter_model.safetensors").rename(bad / "adapter_model.bin")
    elif what == "no-weights":
        (bad / "adapter_model.safetensors").unlink()
    elif what == "bad-weights":
        (bad / "adapter_model.safetensors").write_bytes(b"\x00" * 16)
    else:
        config.update({"dora": {"use_dora": True}, "head": {"target_modules": ["lm_head"]},
                       "regex": {"target_modules": r".*\.0\.self_attn\.q_proj"}}[what])  # fmt: skip
        (bad / "adapter_config.json").write_text(json.dumps(config))
    return bad


@pytest.mark.parametrize(
    ("what", "message"),
    [
        ("missing", "is not a folder (a PEFT adapter folder)"),
        ("bad-json", "adapter_config.json' is not readable JSON"),
        ("no-weights", "has no adapter_model.safetensors"),
        ("pickle", "holds adapter_model.bin (a pickle), which plait does not run"),
        ("bad-weights", "adapter_model.safetensors' is not a readable safetensors file"),
        ("dora", "use_dora=True is not plain LoRA; plait cannot compute it"),
        (
            "head",
            "target_modules=['lm_head'] adapt 'lm_head' (1 such), which is not a Linear "
            "of a LLaMA block that plait adapts",
        ),
        (
            "regex",
            "adapts self_attn.q_proj in layers [0] of 2 only; plait adapts a target in every layer",
        ),
    ],
)
def test_bad_adapters_stop_before_workers(peft_saved, folders, corpus, tmp_path, capsys, what,
                                          message) -> None:  # fmt: skip
    adapter = tmp_path / "nowhere" if what == "missing" else _bad(peft_saved["llama"], tmp_path,
                                                                  what)  # fmt: skip
    run = tmp_path / "run"
    argv = ["--init-from", str(folders["llama"]), "--adapter", str(adapter), "--data",
            str(corpus), "--out", str(run), *RUN]  # fmt: skip
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not run.exists()


def test_an_adapter_for_another_base_or_rank_is_refused(folders, peft_saved, corpus, tmp_path,
                                                        capsys) -> None:  # fmt: skip
    adapter = str(peft_saved["llama"])
    cases = [
        (["train", "--init-from", str(folders["llama-wide"]), "--adapter", adapter],
         "tensor 'base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight' has shape "
         "[96, 4], the base model needs [128, 4]"),
        (["train", "--init-from", str(folders["llama"]), "--adapter", adapter, "--lora-rank",
          "8"], f"lora.rank=8 conflicts with r=4 from --adapter {adapter}"),
        (["train", "--adapter", adapter], f"--adapter {adapter} needs --init-from BASE"),
        (["eval", "--init-from", str(folders["gpt2"]), "--adapter", adapter],
         "target_modules=['down_proj', 'gate_proj', 'k_proj', 'o_proj', 'q_proj', 'up_proj', "
         "'v_proj'] match no module of the base; its Linears: c_attn, c_fc, c_proj"),
    ]  # fmt: skip
    for argv, message in cases:  # eval refuses training flags (--out, --steps) of its own
        run = ["--out", str(tmp_path / "run"), *RUN] if argv[0] == "train" else RUN[2:4]
        assert main([*argv, "--data", str(corpus), *run]) == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / "run").exists()
    assert main(["train", "--init-from", str(folders["llama"]), "--adapter", adapter,
                 "--lora-targets", "all", "--lora-alpha", "16", "--data", str(corpus), "--out",
                 str(tmp_path / "agrees"), *RUN, "--steps", "1", "--no-save"]) == 0  # fmt: skip
    assert main(["generate", "--checkpoint", str(tmp_path), "--adapter", adapter, "--prompt",
                 "x"]) == 2  # fmt: skip
    assert "goes with --init-from BASE" in capsys.readouterr().err


def test_export_peft_needs_adapters(folders, corpus, tmp_path, capsys) -> None:
    run = tmp_path / "run"
    assert main(["train", "--init-from", str(folders["llama"]), "--data", str(corpus),
                 "--out", str(run), *RUN, "--steps", "1"]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(run), "--format", "peft", "--out",
                 str(tmp_path / "peft")]) == 2  # fmt: skip
    assert "has no LoRA adapters (its run had no --lora-rank)" in capsys.readouterr().err
    assert not (tmp_path / "peft").exists()
