"""LoRA checkpoints hold the adapters and name their base (checkpoint/base.py).

A LoRA run on a Hugging Face base folder saves only the adapters and their Adam moments; its
trainer state names the folder and its SHA-256. Resumed in the same layout it continues
bitwise; in another layout within rtol 1e-5 (fp32). Resuming on another base or with other
adapters is refused naming both; `checkpoint info` shows the adapters and the base; `plait
export --format hf --merge` writes a folder whose transformers logits are the LoRA model's,
from a single-process, a tp=2 and a pp=2 checkpoint.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from hf_models import gpt2_config, llama_config, save
from lora_parity import lora_config
from plait.checkpoint import inspect, store
from plait.checkpoint.base import folder_sha256
from plait.checkpoint.io import saved_shapes
from plait.cli import main
from plait.errors import ConfigError
from plait.mesh import build_mesh
from plait.models.declare import is_adapter
from plait.models.hf.load import load_config
from plait.train import Trainer
from reference import corpus_for

STEPS, AT = 6, 3


def _config(folder: str | None, layout: dict, **lora):
    """A rank-4 LoRA run (lr 1e-2: the adapters move visibly in three steps) on the Hugging
    Face base `folder`, or on the seeded tiny-llama when None."""
    cfg = lora_config(steps=STEPS, lr=1e-2, **layout)
    if folder is not None:
        cfg.model = replace(load_config(Path(folder)), lora_rank=4, lora_targets="all")
        cfg.checkpoint.init_from = folder
    for key, value in lora.items():
        setattr(cfg.model, key, value)
    cfg.validate()
    return cfg


def _phase(folder, layout, steps, save_to=None, load=None):
    cfg = _config(folder, layout)
    trainer = Trainer(cfg, build_mesh(cfg.parallel.layout, torch.device("cpu"), 60),
                      corpus_for(cfg))  # fmt: skip
    if load:
        trainer.load(Path(load))
    losses = [trainer.train_step().loss for _ in range(steps)]
    if save_to:
        trainer.save(Path(save_to))
    trainer.close()
    return losses


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bases")
    return {
        "llama": save(llama_config(), root / "llama"),
        "gpt2": save(gpt2_config(), root / "gpt2"),
        "llama-other": save(llama_config(), root / "llama-other", seed=1),
    }


@pytest.fixture(scope="module")
def runs(world2, bases, tmp_path_factory) -> dict:
    """dp=2 on the LLaMA folder: 6 steps uninterrupted, 3 saved, resumed at dp=2 and pp=2;
    tp=2 and pp=2 saved; GPT-2 in this process saved."""
    root, llama = tmp_path_factory.mktemp("runs"), str(bases["llama"])
    dp2, pp2, tp2 = dict(dp=2), dict(pp=2, accum=2), dict(tp=2, accum=2)
    full = world2.run(_phase, llama, dp2, STEPS)[0]
    first = world2.run(_phase, llama, dp2, AT, save_to=str(root / "dp2"))[0]
    ckpt = str(store.step_dir(root / "dp2", AT))
    same = world2.run(_phase, llama, dp2, STEPS - AT, load=ckpt)[0]
    piped = world2.run(_phase, llama, pp2, STEPS - AT, load=ckpt)[0]
    world2.run(_phase, llama, tp2, AT, save_to=str(root / "tp2"))
    world2.run(_phase, llama, pp2, AT, save_to=str(root / "pp2"))
    _phase(str(bases["gpt2"]), dict(accum=2), AT, save_to=str(root / "gpt2"))
    found = {k: store.step_dir(root / k, AT) for k in ("dp2", "tp2", "pp2", "gpt2")}
    return dict(full=full, first=first, same=same, piped=piped, **found)


def test_resume_is_bitwise_in_the_same_layout_and_close_in_another(runs) -> None:
    assert runs["first"] + runs["same"] == runs["full"]
    torch.testing.assert_close(torch.tensor(runs["piped"]), torch.tensor(runs["full"][AT:]),
                               rtol=1e-5, atol=0)  # fmt: skip


def test_the_checkpoint_holds_the_adapters_and_names_its_base(runs, bases) -> None:
    for saved in ("dp2", "tp2", "pp2", "gpt2"):  # never a frozen tensor, whatever layout saved
        keys = saved_shapes(runs[saved])
        assert keys and all(is_adapter(k.split("/", 1)[1]) for k in keys), sorted(keys)[:4]
        assert {k.split("/", 1)[0] for k in keys} == {"master", "exp_avg", "exp_avg_sq"}
    path = runs["dp2"]
    keys = saved_shapes(path)
    state = store.read_trainer(path)
    sha = folder_sha256(bases["llama"])
    assert state["base"] == {"init_from": str(bases["llama"].resolve()), "sha256": sha,
                             "seed": state["config"]["train"]["seed"]}  # fmt: skip
    facts = inspect.info(path)
    adapters = sum(torch.Size(s).numel() for k, s in keys.items() if k.startswith("master/"))
    assert facts["adapter_parameters"] == adapters == facts["parameters"]
    assert facts["adapter_bytes"] == 4 * adapters
    assert facts["base"] == f"{bases['llama'].resolve()} (sha256 {sha[:12]}...)"
    assert facts["lora"] == "rank 4, alpha 8.0, targets 'all'"


def _refused(path: Path, cfg) -> str:
    with pytest.raises(ConfigError) as e:
        store.check_resumable(path, cfg.to_dict())
    return str(e.value)


def test_resuming_on_another_base_or_other_adapters_is_refused(runs, bases, tmp_path) -> None:
    path, llama = runs["dp2"], str(bases["llama"])
    moved = tmp_path / "moved"  # the same content elsewhere is the same base
    moved.mkdir()
    for f in bases["llama"].iterdir():
        (moved / f.name).write_bytes(f.read_bytes())
    store.check_resumable(path, _config(str(moved), dict(dp=2)).to_dict())
    other = _refused(path, _config(str(bases["llama-other"]), dict(dp=2)))
    assert f"trained on --init-from {bases['llama'].resolve()} (sha256" in other
    assert f"this run's base is --init-from {bases['llama-other'].resolve()} (sha256" in other
    rank = _refused(path, _config(llama, dict(dp=2), lora_rank=8))
    assert "holds LoRA adapters of rank 4, targets 'all'" in rank
    assert "this run asks for LoRA adapters of rank 8, targets 'all'" in rank
    targets = _refused(path, _config(llama, dict(dp=2), lora_targets="q,v"))
    assert "asks for LoRA adapters of rank 4, targets 'q,v'" in targets
    plain = _refused(path, _config(llama, dict(dp=2), lora_rank=None))
    assert "this run asks for no adapters (full fine-tuning)" in plain
    assert "\n" not in other + rank + plain


def test_a_seeded_base_is_named_by_its_seed(tmp_path) -> None:
    _phase(None, {}, 1, save_to=str(tmp_path))
    path = store.step_dir(tmp_path, 1)
    assert store.read_trainer(path)["base"]["init_from"] is None
    assert inspect.info(path)["base"] == "the seeded init (seed 0)"
    cfg = _config(None, {})
    cfg.train.seed = 1
    message = _refused(path, cfg)
    assert "trained on the seeded init (seed 0); this run's base is the seeded init (seed 1)" in (
        message
    )
    # reading it back: the seeded base plus the adapters, the trained model
    model, trained = inspect.load_model(path), Trainer(_config(None, {}), build_mesh(
        cfg.parallel.layout, torch.device("cpu"), 60), corpus_for(cfg))  # fmt: skip
    trained.load(path)
    for name, p in trained.model.named_parameters():
        assert torch.equal(dict(model.named_parameters())[name], p.detach()), name
    trained.close()


@pytest.mark.parametrize("saved", ["gpt2", "tp2", "pp2"])
def test_merged_export_gives_the_lora_models_logits(runs, bases, saved, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    out = tmp_path / "merged"
    assert main(["export", "--checkpoint", str(runs[saved]), "--merge", "--out", str(out)]) == 0
    assert not any("lora" in k for k in json.loads((out / "config.json").read_text()))
    lora = inspect.load_model(runs[saved]).eval()
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    base = AutoModelForCausalLM.from_pretrained(bases["gpt2" if saved == "gpt2" else "llama"])
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got, before = lora(tokens), hf(tokens).logits, base.eval()(tokens).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (want - before).abs().max() > 1e-2  # the adapters trained: merging is seen


def test_exports_that_mean_nothing_are_refused(runs, tmp_path, capsys) -> None:
    out = str(tmp_path / "x")
    assert main(["export", "--checkpoint", str(runs["gpt2"]), "--out", out]) == 2
    line = capsys.readouterr().err.strip()
    assert "holds LoRA adapters (rank 4): add --merge" in line and "--format peft" in line
    plain = lora_config(steps=1)
    plain.model.lora_rank = None
    trainer = Trainer(plain, build_mesh(plain.parallel.layout, torch.device("cpu"), 60),
                      corpus_for(plain))  # fmt: skip
    trainer.train_step()
    trainer.save(tmp_path / "plain")
    trainer.close()
    ck = str(store.step_dir(tmp_path / "plain", 1))
    assert main(["export", "--checkpoint", ck, "--merge", "--out", out]) == 2
    assert "has no LoRA adapters to merge" in capsys.readouterr().err
    assert main(["export", "--checkpoint", ck, "--out", out, "--init-from", str(tmp_path)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"holds its whole model (no LoRA adapters): --init-from {tmp_path} names no base" in err
    assert not Path(out).exists()


def test_a_changed_base_folder_is_named_when_read(runs, bases, tmp_path) -> None:
    folder = tmp_path / "base"
    save(gpt2_config(), folder)
    _phase(str(folder), {}, 1, save_to=str(tmp_path / "run"))
    path = store.step_dir(tmp_path / "run", 1)
    save(gpt2_config(), folder, seed=3)  # retrained in place
    with pytest.raises(ConfigError, match="that folder now holds other weights"):
        inspect.load_model(path)


def test_train_refuses_another_base_before_any_worker(runs, bases, tmp_path, capsys) -> None:
    lora = ["--lora-rank", "4", "--lora-targets", "all"]
    argv = ["train", "--init-from", str(bases["llama-other"]), *lora,
            "--resume", str(runs["dp2"]), "--out", str(tmp_path / "o")]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "holds adapters trained on --init-from" in err and str(bases["llama-other"]) in err
    assert not (tmp_path / "o").exists()


def _eval(argv: list[str], tmp: Path) -> float:
    from plait.cli import build_parser
    from plait.cli.evaluate import check_request
    from plait.evaluate import eval_worker

    request = check_request(build_parser().parse_args(["eval", *argv]))
    mesh = build_mesh(request.cfg.parallel.layout, torch.device("cpu"), 60)
    return eval_worker(request.cfg, mesh, request.checkpoint, str(tmp / "eval.json"))["loss"]


def test_eval_of_a_lora_checkpoint_is_the_merged_models(runs, tmp_path) -> None:
    """`eval --checkpoint` builds the recorded base and loads the adapters: the loss of the
    merged export, evaluated as a plain Hugging Face folder."""
    text = tmp_path / "text.txt"
    text.write_text("The adapters live beside a frozen base; the base is named. " * 40)
    merged = tmp_path / "merged"
    assert main(["export", "--checkpoint", str(runs["gpt2"]), "--merge", "--out", str(merged)]) == 0
    flags = ["--data", str(text), "--seq-len", "32", "--no-progress"]
    lora = _eval(["--checkpoint", str(runs["gpt2"]), *flags], tmp_path)
    plain = _eval(["--init-from", str(merged), *flags], tmp_path)
    assert lora == pytest.approx(plain, rel=1e-5)


def test_a_moved_base_is_named_again_with_init_from(tmp_path, capsys) -> None:
    """The base folder moved after training: reading the checkpoint says how to name it;
    `--init-from NEWDIR` (the same SHA-256) gives `generate`, `eval` and `export --merge` the
    figures they gave before the move, and a resumed run the same losses; a folder of other
    weights is refused naming both."""
    orig, new = tmp_path / "orig", tmp_path / "new"
    save(gpt2_config(), orig)
    _phase(str(orig), {}, 1, save_to=str(tmp_path / "run"))
    ck = str(store.step_dir(tmp_path / "run", 1))
    text = tmp_path / "text.txt"
    text.write_text("The adapters live beside a frozen base; the base is named. " * 40)
    flags = ["--data", str(text), "--seq-len", "32", "--no-progress"]
    gen = ["generate", "--checkpoint", ck, "--prompt", "The base", "--max-new-tokens", "4"]
    before = (_eval(["--checkpoint", ck, *flags], tmp_path), main(gen), capsys.readouterr().out)
    resumed = _phase(str(orig), {}, 2, load=ck)
    orig.rename(new)
    with pytest.raises(ConfigError, match="give its new place with --init-from NEWDIR"):
        inspect.load_model(Path(ck))
    moved = ["--init-from", str(new)]
    assert _eval(["--checkpoint", ck, *moved, *flags], tmp_path) == before[0]
    assert (main([*gen, *moved]), capsys.readouterr().out) == before[1:]
    out = tmp_path / "merged"
    assert main(["export", "--checkpoint", ck, "--merge", "--out", str(out), *moved]) == 0
    assert _phase(str(new), {}, 2, load=ck) == resumed
    save(gpt2_config(), tmp_path / "other", seed=3)
    capsys.readouterr()  # transformers' progress bar
    argv = ["export", "--checkpoint", ck, "--merge", "--out", str(tmp_path / "x")]
    assert main([*argv, "--init-from", str(tmp_path / "other")]) == 2
    err = " ".join(capsys.readouterr().err.split())  # rich wraps at its width
    assert f"--init-from {tmp_path / 'other'} holds other weights (sha256" in err
    assert f"the adapters of checkpoint '{ck}' were trained on, --init-from {orig} (sha" in err
    assert main([*gen, "--init-from", str(tmp_path / "nowhere")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "nowhere is not a folder (the base model's new place)" in err
