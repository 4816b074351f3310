"""`--base-upcast` is PEFT's QLoRA in bf16: `prepare_model_for_kbit_training` upcasts the
embeddings, the head and the norms to fp32 (and PEFT keeps its adapters in fp32), so only the
NF4 products compute in bf16 (`bnb_4bit_compute_dtype`), their input cast down and their
output back up as bitsandbytes' `Linear4bit` does.

A tiny Llama in bf16 is saved 4-bit by transformers (bf16 compute); both sides read that
folder as it is. Compared: the loss of one forward (rtol 1e-5) and every adapter gradient
of its backward, to bf16's rounding step (2^-8 of the largest element) rather than fp32's:
plait's attention and transformers' (its key/value heads repeated) differ by an fp32 rounding
(~1e-7), which flips some elements' bf16 rounding in the next NF4 product; and the losses
of `plait train --precision bf16 --base-dtype nf4 --base-upcast` against the same 8 steps of
PEFT's model (the first rtol 1e-5, all 1e-4). Without the upcast (the base's rest and the
activations in bf16) plait's first loss is another one (3.5e-5 off, measured).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # a missing optional CPU kernel

from hf_models import llama_config  # noqa: E402
from plait.build.corpus import load_corpus  # noqa: E402
from plait.cli import build_parser, config_from_args  # noqa: E402
from plait.data import GlobalBatchSampler  # noqa: E402
from plait.mesh import build_mesh  # noqa: E402
from plait.models.declare import is_adapter  # noqa: E402
from plait.models.hf.peft import adapter_tensors  # noqa: E402
from plait.optim import build_optimizer, lr_at, set_lr  # noqa: E402
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
TRAJECTORY = 1e-4
BF16_STEP = 2.0**-8  # bf16's relative rounding step (see the module's docstring)
BF16 = torch.bfloat16
TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(7))


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def folder4(tmp_path_factory) -> Path:
    """A bf16 Llama saved 4-bit by transformers (NF4, double quantization, bf16 compute)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("upcast")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(llama_config(intermediate_size=128), dtype=BF16)
    model.save_pretrained(root / "bf16")
    return save_4bit(root / "bf16", root / "nf4", BF16)


def loss_of(logits: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), TOKENS[:, 1:].flatten())


def test_one_step_is_peft_upcast_qlora(folder4) -> None:
    cfg = qlora_config(folder4)
    start = random_adapters(cfg)
    ours, _ = plait_qlora(folder4, cfg, start, products=BF16)
    theirs = peft_qlora(folder4, BF16)
    peft.set_peft_model_state_dict(theirs, adapter_tensors(cfg, start))
    upcast = {p.dtype for n, p in theirs.named_parameters() if "lora_" in n or "norm" in n}
    assert upcast == {torch.float32}  # PEFT's side is the upcast one
    theirs.train()
    ours_loss, theirs_loss = loss_of(ours(TOKENS)), loss_of(theirs(input_ids=TOKENS).logits)
    torch.testing.assert_close(ours_loss, theirs_loss, rtol=RTOL, atol=0)
    ours_loss.backward()
    theirs_loss.backward()
    grads = {n: p.grad for n, p in ours.named_parameters() if is_adapter(n)}
    ours_grads, theirs_grads = adapter_tensors(cfg, grads), peft_tensors(theirs, lambda p: p.grad)
    assert sorted(ours_grads) == sorted(theirs_grads) and len(theirs_grads) == 28
    for key, grad in theirs_grads.items():
        assert grad.abs().max() > 0, key
        scale = BF16_STEP * grad.abs().max().item()
        torch.testing.assert_close(ours_grads[key], grad, rtol=0, atol=scale, msg=key)


def trainer(folder4: Path, tmp_path: Path, *flags: str) -> Trainer:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Four-bit products in bf16, everything else in fp32. " * 60)
    argv = ["train", "--init-from", str(folder4), "--data", str(corpus), "--lora-rank", "4",
            "--lora-alpha", "16", "--lora-targets", "all", "--base-dtype", "nf4", "--steps",
            "8", "--seq-len", "16", "--global-batch", "4", "--micro-batch", "2", "--lr",
            "1e-3", "--warmup-steps", "2", "--grad-clip", "1.0", "--device", "cpu",
            "--precision", "bf16", *flags, "--out", str(tmp_path / "run")]  # fmt: skip
    cfg = config_from_args(build_parser().parse_args(argv))
    return Trainer(cfg, build_mesh(cfg.parallel.layout, CPU), load_corpus(cfg))


def test_base_upcast_steps_are_peft_qlora_in_bf16(folder4, tmp_path) -> None:
    ours_run = trainer(folder4, tmp_path, "--base-upcast")
    start = {n: p.detach().clone() for n, p in ours_run.model.named_parameters() if is_adapter(n)}
    assert {p.dtype for p in ours_run.model.parameters() if p.numel()} == {torch.float32}
    ours = [ours_run.train_step().loss for _ in range(8)]
    cfg, corpus = ours_run.cfg, ours_run.corpus
    ours_run.close()

    model = peft_qlora(folder4, BF16)
    peft.set_peft_model_state_dict(model, adapter_tensors(cfg.model, start))
    model.train()
    t = cfg.train
    opt = build_optimizer(model, cfg.optim)
    sampler = GlobalBatchSampler(len(corpus.train), t.global_batch, t.seed)
    trainable = [p for p in model.parameters() if p.requires_grad]
    theirs = []
    for step in range(t.steps):
        x, y, _ = corpus.train.draw(sampler.next_batch())
        loss = F.cross_entropy(model(input_ids=x).logits.flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, cfg.optim.grad_clip)
        set_lr(opt, lr_at(step, cfg.optim, t.steps))
        opt.step()
        opt.zero_grad(set_to_none=True)
        theirs.append(loss.item())
    assert theirs[-1] < theirs[0] - 0.05  # the adapters learned something
    assert ours[0] == pytest.approx(theirs[0], rel=RTOL)  # the same first step
    # then Adam carries the gradients' bf16-step differences into the adapters
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=TRAJECTORY, atol=0)
    (tmp_path / "plain").mkdir()
    plain = trainer(folder4, tmp_path / "plain")  # bf16 activations: another first loss
    first = plain.train_step().loss
    plain.close()
    assert abs(first - theirs[0]) > 3 * RTOL * theirs[0]  # measured: 3.5e-5
