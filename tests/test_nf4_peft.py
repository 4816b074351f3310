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
from plait.memory_tracker import MemoryTracker  # noqa: E402
from plait.mesh import build_mesh  # noqa: E402
from plait.models.architecture import ModelConfig  # noqa: E402
from plait.models.contract import contract_of  # noqa: E402
from plait.models.declare import is_adapter  # noqa: E402
from plait.models.hf.load import hf_source, load_config  # noqa: E402
from plait.models.hf.peft import adapter_tensors  # noqa: E402
from plait.models.init import with_adapters  # noqa: E402
from plait.models.nf4.source import nf4_source  # noqa: E402
from plait.models.transformer import Transformer  # noqa: E402
from plait.optim import build_optimizer, lr_at, set_lr  # noqa: E402
from plait.parallel.zero.nf4_base import hold_nf4, nf4_targets  # noqa: E402
from plait.train import Trainer  # noqa: E402

RTOL = 1e-5
RANK, ALPHA = 4, 16.0
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))
CPU = torch.device("cpu")


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
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    root = tmp_path_factory.mktemp("qlora")
    full = save(llama_config(intermediate_size=128), root / "fp32")
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                               bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=torch.float32)  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(full, quantization_config=quant,
                                                 dtype=torch.float32)  # fmt: skip
    model.save_pretrained(root / "nf4")
    return root / "nf4"


def peft_qlora(folder: Path):
    """PEFT's QLoRA on the 4-bit folder: Linear4bit bases, adapters on every Linear."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    base = peft.prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, lora_dropout=0.0, target_modules=TARGETS,
                             task_type="CAUSAL_LM")  # fmt: skip
    return peft.get_peft_model(base, config)


def qlora_config(folder: Path) -> ModelConfig:
    cfg = load_config(folder)
    cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets = RANK, ALPHA, "all"
    cfg.validate()
    return cfg


def plait_qlora(folder: Path, cfg: ModelConfig, adapters: dict[str, torch.Tensor]):
    """plait's model over the folder's NF4 weights (held as the engine holds them)."""
    model = Transformer(cfg)
    source = with_adapters(hf_source(folder, cfg), cfg, 0, lambda name, s, sh: adapters[name])
    quantized = {entry.name for entry, _ in nf4_targets(model)}
    with torch.no_grad():
        for entry, p in contract_of(model).bind(model):
            if entry.name not in quantized:
                p.copy_(source(entry.name, tuple(p.shape), None))
    held = hold_nf4(model, nf4_source(cfg, 0, str(folder)), CPU, MemoryTracker(CPU))
    return model, held


def random_adapters(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in Transformer(cfg).named_parameters() if is_adapter(n)}
    return {n: torch.randn(s, generator=gen) * 0.1 for n, s in shapes.items()}


def peft_tensors(model, what) -> dict[str, torch.Tensor]:
    return {n.replace(".default", ""): what(p) for n, p in model.named_parameters()
            if p.requires_grad}  # fmt: skip


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


def test_a_qlora_checkpoint_exports_to_peft_on_the_4bit_model(folder4, tmp_path) -> None:
    """A QLoRA run's checkpoint names its base and its quantization; `plait export --format
    peft` loads in PEFT on transformers' 4-bit model with the logits plait computes for the
    checkpoint (its base read back dequantized, as the run computed with it), which are
    also those of plait's NF4 model with the checkpoint's adapters."""
    from transformers import AutoModelForCausalLM

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Adapters trained over four bits, and out to PEFT. " * 40)
    run = tmp_path / "run"
    assert main(["train", "--init-from", str(folder4), "--data", str(corpus), "--lora-rank",
                 "4", "--lora-alpha", "16", "--lora-targets", "all", "--base-dtype", "nf4",
                 "--steps", "2", "--lr", "1e-2", "--seq-len", "16", "--global-batch", "2",
                 "--micro-batch", "1", "--eval-batches", "1", "--no-progress", "--device",
                 "cpu", "--out", str(run)]) == 0  # fmt: skip
    checkpoint = store.complete(run)
    assert store.read_trainer(checkpoint)["base"]["quantization"] == "nf4"
    out = tmp_path / "peft"
    assert main(["export", "--checkpoint", str(run), "--format", "peft", "--out", str(out)]) == 0
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
    opt = build_optimizer(model, t)
    sampler = GlobalBatchSampler(len(trainer.corpus.train), t.global_batch, t.seed)
    trainable = [p for p in model.parameters() if p.requires_grad]
    theirs = []
    for step in range(t.steps):
        x, y, _ = trainer.corpus.train.draw(sampler.next_batch())
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, t.grad_clip)
        set_lr(opt, lr_at(step, t))
        opt.step()
        opt.zero_grad(set_to_none=True)
        theirs.append(loss.item())
    assert theirs[-1] < theirs[0] - 0.1  # the adapters learned something
    torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=RTOL, atol=0)
