"""QLoRA in one process is PEFT's QLoRA (fp32 compute, rtol 1e-5).

A tiny LlamaForCausalLM (every Linear's rows whole 64-blocks) is saved, then loaded by
transformers with `BitsAndBytesConfig(load_in_4bit=True, nf4, double quantization, fp32
compute)` and saved again 4-bit; both sides read that 4-bit folder as it is, so both hold
bitsandbytes' own codes (plait's quantizer against bitsandbytes' is tests/test_nf4_format.py).
PEFT's side: `prepare_model_for_kbit_training`, then LoRA on every Linear of a block
(`Linear4bit`). Compared: the loss and every adapter gradient of one forward/backward with
random A and B (B nonzero, so A's gradient is not trivially zero); what autograd keeps for
backward (no tensor of a quantized weight's size); and 20 steps of `plait train
--base-dtype nf4` (the Trainer: AdamW, warmup and cosine, clipping, two micro-batches) against
the same 20 steps of PEFT's model, loss by loss.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # a missing optional CPU kernel

from hf_models import llama_config, save  # noqa: E402
from plait.build.corpus import load_corpus  # noqa: E402
from plait.checkpoint import inspect, store  # noqa: E402
from plait.cli import build_parser, config_from_args, main  # noqa: E402
from plait.data import GlobalBatchSampler  # noqa: E402
from plait.mesh import build_mesh  # noqa: E402
from plait.models.declare import is_adapter  # noqa: E402
from plait.models.hf.peft import adapter_tensors  # noqa: E402
from plait.models.nf4.source import nf4_source  # noqa: E402
from plait.models.transformer import Transformer  # noqa: E402
from plait.optim import build_optimizer, lr_at, set_lr  # noqa: E402
from plait.parallel.zero.nf4_base import nf4_targets  # noqa: E402
from plait.train import Trainer  # noqa: E402
from qlora_models import (  # noqa: E402
    CPU,
    peft_qlora,
    peft_tensors,
    plait_qlora,
    qlora_config,
    random_adapters,
    save_4bit,
)

RTOL = 1e-5
TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matrices: one thread is the fastest (two fight over a loaded machine's cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def folder4(tmp_path_factory) -> Path:
    """A Llama saved 4-bit by transformers (NF4, double quantization, fp32 compute)."""
    root = tmp_path_factory.mktemp("qlora")
    full = save(llama_config(intermediate_size=128), root / "fp32")
    return save_4bit(full, root / "nf4", torch.float32)


def loss_of(logits: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), TOKENS[:, 1:].flatten())


def test_one_step_is_peft_linear4bit(folder4) -> None:
    cfg = qlora_config(folder4)
    start = random_adapters(cfg)
    ours, held = plait_qlora(folder4, cfg, start)
    leaves = ("attn.wq", "attn.wk", "attn.wv", "attn.wo", "mlp.w_gate", "mlp.w_up", "mlp.w_down")
    assert sorted(held) == sorted(f"blocks.{i}.{leaf}.weight" for i in range(2) for leaf in leaves)
    theirs = peft_qlora(folder4)
    loaded = peft.set_peft_model_state_dict(theirs, adapter_tensors(cfg, start))
    assert not loaded.unexpected_keys
    saved: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ours_loss = loss_of(ours(TOKENS))
    weights = {s for h in held.values() for s in (h.weight.shape, h.weight.shape[::-1])}
    assert saved and not weights & set(saved), "a dequantized weight was kept for backward"
    theirs.train()
    theirs_loss = loss_of(theirs(input_ids=TOKENS).logits)
    torch.testing.assert_close(ours_loss, theirs_loss, rtol=RTOL, atol=0)
    ours_loss.backward()
    theirs_loss.backward()
    grads = {n: p.grad for n, p in ours.named_parameters() if is_adapter(n)}
    ours_grads, theirs_grads = adapter_tensors(cfg, grads), peft_tensors(theirs, lambda p: p.grad)
    assert sorted(ours_grads) == sorted(theirs_grads) and len(theirs_grads) == 28
    for key, grad in theirs_grads.items():
        assert grad.abs().max() > 0, key
        scale = RTOL * grad.abs().max().item()  # fp32 sums in another order
        torch.testing.assert_close(ours_grads[key], grad, rtol=RTOL, atol=scale, msg=key)


def test_plait_quantizes_the_folder_as_transformers_does(folder4) -> None:
    """From the unquantized folder, plait's NF4 weights are transformers' own: the 4-bit
    codes, nested scales and offsets byte for byte; the absmax codes but where bitsandbytes'
    CPU kernel breaks a near-tie by its 65536-bin table (tests/test_nf4_format.py), where
    they are neighbours."""
    cfg = qlora_config(folder4)
    ours = nf4_source(cfg, 0, str(folder4.parent / "fp32"))
    theirs = nf4_source(cfg, 0, str(folder4))
    model = Transformer(cfg)
    differ = total = 0
    for entry, _ in nf4_targets(model):
        a, b = ours(entry.name, entry.decl.shape), theirs(entry.name, entry.decl.shape)
        assert (a.shape, a.dtype) == (b.shape, b.dtype) == (entry.decl.shape, torch.float32)
        assert torch.equal(a.codes, b.codes) and torch.equal(a.nested, b.nested)
        assert torch.equal(a.offset, b.offset)
        gap = (a.absmax.int() - b.absmax.int()).abs()
        assert gap.max() <= 1, entry.name
        differ, total = differ + int(gap.sum()), total + gap.numel()
    assert differ <= total // 20, (differ, total)  # near-ties only


@pytest.fixture(scope="module")
def qlora_run(folder4, tmp_path_factory) -> Path:
    """Two steps of `plait train --base-dtype nf4` on the 4-bit folder: its run folder."""
    root = tmp_path_factory.mktemp("qlora-run")
    corpus = root / "corpus.txt"
    corpus.write_text("Adapters trained over four bits, and out to PEFT. " * 40)
    run = root / "run"
    assert main(["train", "--init-from", str(folder4), "--data", str(corpus), "--lora-rank",
                 "4", "--lora-alpha", "16", "--lora-targets", "all", "--base-dtype", "nf4",
                 "--steps", "2", "--lr", "1e-2", "--seq-len", "16", "--global-batch", "2",
                 "--micro-batch", "1", "--eval-batches", "1", "--no-progress", "--device",
                 "cpu", "--out", str(run)]) == 0  # fmt: skip
    return run


def test_a_qlora_checkpoint_exports_to_peft_on_the_4bit_model(folder4, qlora_run, tmp_path) -> None:
    """A QLoRA run's checkpoint names its base and its quantization; `plait export --format
    peft` loads in PEFT on transformers' 4-bit model with the logits plait computes for the
    checkpoint (its base read back dequantized, as the run computed with it), which are
    also those of plait's NF4 model with the checkpoint's adapters."""
    from transformers import AutoModelForCausalLM

    checkpoint = store.complete(qlora_run)
    assert store.read_trainer(checkpoint)["base"]["quantization"] == "nf4"
    out = tmp_path / "peft"
    assert (
        main(["export", "--checkpoint", str(qlora_run), "--format", "peft", "--out", str(out)]) == 0
    )
    base = AutoModelForCausalLM.from_pretrained(folder4, dtype=torch.float32)
    # In train mode, as in training (no dropout here): in eval mode on a CPU with AVX512-BF16
    # bitsandbytes repacks the weights for its own inference kernel, another arithmetic.
    theirs = peft.PeftModel.from_pretrained(base, out, is_trainable=True).train()
    logits = theirs(input_ids=TOKENS).logits.detach()
    with torch.no_grad():
        ours = inspect.load_model(checkpoint).eval()(TOKENS)
        torch.testing.assert_close(ours, logits, rtol=RTOL, atol=1e-6)
        cfg = inspect.model_config(checkpoint)
        nf4_model, _ = plait_qlora(folder4, cfg, inspect.read_masters(checkpoint))
        torch.testing.assert_close(nf4_model(TOKENS), ours, rtol=RTOL, atol=1e-6)


def test_a_merged_qlora_export_is_a_plain_fp32_model(folder4, qlora_run, tmp_path) -> None:
    """`plait export --format hf --merge` of a QLoRA run merges the adapters into the
    dequantized base in fp32 (W = dequantize(NF4) + s·B·A) and writes a plain, unquantized
    fp32 folder: transformers loads it without bitsandbytes and gives the logits of plait's
    NF4 model with the run's adapters."""
    from transformers import AutoModelForCausalLM

    checkpoint = store.complete(qlora_run)
    out = tmp_path / "merged"
    assert main(["export", "--checkpoint", str(qlora_run), "--format", "hf", "--merge",
                 "--out", str(out)]) == 0  # fmt: skip
    hf = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in hf and not any("lora" in k for k in hf)
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    assert {p.dtype for p in merged.parameters()} == {torch.float32}
    cfg = inspect.model_config(checkpoint)
    nf4_model, _ = plait_qlora(folder4, cfg, inspect.read_masters(checkpoint))
    with torch.no_grad():
        want, got = nf4_model(TOKENS), merged(input_ids=TOKENS).logits
        before = AutoModelForCausalLM.from_pretrained(folder4).train()(input_ids=TOKENS).logits
    torch.testing.assert_close(got, want, rtol=RTOL, atol=1e-5)
    assert (want - before).abs().max() > 1e-2  # the adapters trained: merging is seen


def test_twenty_steps_are_peft_qlora(folder4, tmp_path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("QLoRA trains adapters over a four-bit base, exactly. " * 60)
    argv = ["train", "--init-from", str(folder4), "--data", str(corpus), "--lora-rank", "4",
            "--lora-alpha", "16", "--lora-targets", "all", "--base-dtype", "nf4", "--steps",
            "20", "--seq-len", "16", "--global-batch", "4", "--micro-batch", "2", "--lr",
            "1e-3", "--warmup-steps", "2", "--grad-clip", "1.0", "--device", "cpu",
            "--out", str(tmp_path / "run")]  # fmt: skip
    cfg = config_from_args(build_parser().parse_args(argv))
    trainer = Trainer(cfg, build_mesh(cfg.parallel.layout, CPU), load_corpus(cfg))
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if is_adapter(n)}
    whole = sum(4 * p.numel() for p in trainer.model.parameters())
    assert trainer.engine.memory.current("parameters") < 0.6 * whole  # NF4, not fp32
    ours = [trainer.train_step().loss for _ in range(20)]
    trainer.close()

    model = peft_qlora(folder4)
    peft.set_peft_model_state_dict(model, adapter_tensors(cfg.model, start))
    model.train()
    t = cfg.train
    opt = build_optimizer(model, cfg.optim)
    sampler = GlobalBatchSampler(len(trainer.corpus.train), t.global_batch, t.seed)
    trainable = [p for p in model.parameters() if p.requires_grad]
    theirs = []
    for step in range(t.steps):
        x, y, _ = trainer.corpus.train.draw(sampler.next_batch())
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, cfg.optim.grad_clip)
        set_lr(opt, lr_at(step, cfg.optim, t.steps))
        opt.step()
        opt.zero_grad(set_to_none=True)
        theirs.append(loss.item())
    assert theirs[-1] < theirs[0] - 0.1  # the adapters learned something
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=RTOL, atol=0)
