"""The two sides of bench_lora.py: plait's Trainer, and transformers + peft in a plain loop
(optionally under DistributedDataParallel), started from the same base folder and adapters."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from common import Side
from plait.config import Config, build_config
from plait.data import GlobalBatchSampler
from plait.data.sampler import replica_share, split_micro
from plait.models.declare import describe
from plait.models.hf.config_json import hf_config
from plait.models.hf.peft import adapter_tensors
from plait.models.init import init_value
from plait.models.presets import get_preset
from plait.train import Trainer

PEFT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_config(p: argparse.ArgumentParser) -> None:
    """The model, adapter and batch options both sides share."""
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--alpha", type=float, default=32.0)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)


def base_model(opts: argparse.Namespace) -> Any:
    """A small-llama reshaped by the options (byte vocabulary)."""
    cfg = get_preset("small-llama")
    cfg.n_layers, cfg.d_model, cfg.n_heads = opts.layers, opts.hidden, opts.heads
    cfg.n_kv_heads, cfg.max_seq_len, cfg.ffn_hidden = opts.kv_heads, opts.seq_len, None
    cfg.validate()
    return cfg


def base_folder(root: Path, opts: argparse.Namespace) -> Path:
    """The base as a Hugging Face folder with seeded weights (transformers writes it)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(opts.seed)
    hf = hf_config(base_model(opts))
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf))
    folder = root / "base"
    model.save_pretrained(folder)
    return folder


def plait_config(
    opts: argparse.Namespace, folder: Path, dp: int, zero: int, base_dtype: str = "auto"
) -> Config:
    overrides = {
        "lora": {"rank": opts.rank, "alpha": opts.alpha, "targets": "all",
                 "base_dtype": base_dtype},
        "parallel": {"dp": dp},
        "memory": {"zero": zero},
        "train": {"micro_batch": opts.micro_batch, "global_batch": opts.global_batch,
                  "seq_len": opts.seq_len, "seed": opts.seed, "device": "cpu", "steps": 100_000},
        "checkpoint": {"init_from": str(folder)},
        "optim": {"lr": opts.lr, "min_lr": opts.lr, "warmup_steps": 0, "weight_decay": 0.0,
                  "grad_clip": 1.0},
        "log": {"progress": False},
    }  # fmt: skip
    from plait.models.hf.load import load_config

    cfg = build_config(f"hf:{folder}", overrides, load_config(folder))
    cfg.validate()
    return cfg


@contextmanager
def saved_bytes(into: dict[str, int]) -> Iterator[None]:
    """The most bytes autograd holds for backward at once, each storage counted once."""
    held: dict[int, int] = {}

    def pack(t: torch.Tensor) -> Any:
        ptr = t.untyped_storage().data_ptr()
        held[ptr] = t.untyped_storage().nbytes()
        into["activations"] = max(into.get("activations", 0), sum(held.values()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield


def start_adapters(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The adapters' initial values, whole, as every layout's Trainer draws them (seed and
    name: models/init.py), read from the contract rather than from a rank's shards."""
    cfg = trainer.cfg
    trainable = [e for e in describe(cfg.model).params() if e.decl.trainable]
    return {e.name: init_value(cfg.model, e.name, e.decl.shape, cfg.train.seed) for e in trainable}


class TrainerSide(Side):
    """plait: one `train_step` per step; the sampler mirrored for the peer."""

    def __init__(self, name: str, trainer: Trainer) -> None:
        super().__init__(name)
        self.trainer = trainer
        rows, t = trainer.corpus.train, trainer.cfg.train
        self.mirror = GlobalBatchSampler(len(rows), t.global_batch, t.seed)
        self.bytes_per_step = 0
        self.figures: dict[str, int] = {}

    def step(self, idx: torch.Tensor) -> float:
        return self.trainer.train_step().loss

    def measure_memory(self) -> None:
        """One step under the activation meter (it counts as a warm-up step)."""
        self.mirror.next_batch()
        self.losses.append(self.trainer.train_step(meter_activations=True).loss)
        memory = self.trainer.engine.memory
        trainable = [p for p in self.trainer.model.parameters() if p.requires_grad]
        self.figures = {
            "states": memory.model_state_bytes(),
            "activations": memory.peak("activations"),
            "trainable": sum(p.numel() for p in trainable),
        }
        self.bytes_per_step = self.trainer.comm.stats.total()[2]

    def memory(self) -> dict[str, int]:
        return self.figures


class PeftSide(Side):
    """transformers + peft, a plain loop: the same batches as `like`'s sampler gives, the
    same micro-batches, AdamW and clipping; DDP over the default group when `ddp`."""

    def __init__(self, name: str, folder: Path, like: Trainer, opts: argparse.Namespace,
                 ddp: bool, load: Any = None) -> None:  # fmt: skip
        """`load(folder)`: the base model (default: transformers' fp32 model)."""
        from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
        from transformers import AutoModelForCausalLM

        super().__init__(name)
        if load is None:
            base = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
        else:
            base = load(folder)
        config = LoraConfig(r=opts.rank, lora_alpha=opts.alpha, target_modules=PEFT_TARGETS)
        self.model = get_peft_model(base, config)
        set_peft_model_state_dict(self.model, adapter_tensors(like.cfg.model, start_adapters(like)))
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        t, o = (
            like.cfg.train,
            like.cfg.optim,
        )  # plait's AdamW hyper-parameters (betas 0.9, 0.95; eps 1e-8)
        self.opt = torch.optim.AdamW(self.params, lr=opts.lr, betas=(o.beta1, o.beta2),
                                     eps=1e-8, weight_decay=0.0)  # fmt: skip
        self.net = self.model
        self.bucket_bytes = [0]
        if ddp:
            self.net = self._ddp(self.model)
        mesh = like.mesh
        self.micro, self.replica = t.micro_batch, (mesh.coord.dp, mesh.size("dp"))
        self.rows, self.clip = like.corpus.train, like.cfg.optim.grad_clip
        self.mirror = GlobalBatchSampler(len(self.rows), t.global_batch, t.seed)
        self.bytes_per_step = 0
        self.figures: dict[str, int] = {}

    def _ddp(self, model: torch.nn.Module) -> torch.nn.Module:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel as DDP

        net, tally = DDP(model, broadcast_buffers=False), self.bucket_bytes

        def counted(state, bucket):  # unannotated: DDP checks a hook's annotations
            tally[0] += bucket.buffer().numel() * bucket.buffer().element_size()
            return allreduce_hook(state, bucket)

        net.register_comm_hook(None, counted)
        return net

    def step(self, idx: torch.Tensor, meter: dict[str, int] | None = None) -> float:
        """One optimizer step on this replica's share of the global batch `idx`; `meter`:
        keep the most bytes any one micro-batch saves for backward."""
        mine, _ = replica_share(idx, *self.replica)
        micro = split_micro(mine, self.micro)
        total = 0.0
        for i, m in enumerate(micro):
            x, y, _ = self.rows.draw(m)
            last = i == len(micro) - 1
            sync = nullcontext() if last or self.net is self.model else self.net.no_sync()
            with sync, saved_bytes(meter) if meter is not None else nullcontext():
                logits = self.net(input_ids=x).logits
                loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
                (loss / len(micro)).backward()
            total += float(loss.detach()) / len(micro)
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return self._global_mean(total)

    def _global_mean(self, loss: float) -> float:
        if self.replica[1] == 1:
            return loss
        t = torch.tensor([loss])
        torch.distributed.all_reduce(t)
        return float(t) / self.replica[1]

    def measure_memory(self) -> None:
        """One step under the saved-tensor meter; states = parameters + gradients + AdamW
        moments, as held at the step's end (gradients counted before they are dropped)."""
        idx = self.mirror.next_batch()
        figures: dict[str, int] = {}
        self.bucket_bytes[0] = 0
        self.losses.append(self.step(idx, figures))
        states = sum(p.numel() * p.element_size() for p in self.model.parameters())
        states += sum(p.numel() * p.element_size() for p in self.params)  # their gradients
        for s in self.opt.state.values():
            states += sum(v.numel() * v.element_size() for v in s.values() if v.dim())
        self.figures = {**figures, "states": states,
                        "trainable": sum(p.numel() for p in self.params)}  # fmt: skip
        self.bytes_per_step = self.bucket_bytes[0]

    def memory(self) -> dict[str, int]:
        return self.figures
