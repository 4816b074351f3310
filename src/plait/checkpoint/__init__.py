"""Checkpoints: layout-free sharded save and load with torch.distributed.checkpoint, atomic
commit, and resharding on load (docs/checkpoints.md).

How a checkpoint moves to another layout: nothing in it names a layout. Every tensor is
saved under its single-process name and shape (`"master/blocks.0.attn.wq.weight"`,
`"exp_avg/..."`, `"exp_avg_sq/..."`; the names, shapes, tp shards and tied copies' names all
from the model's contract, models/contract.py), and each rank writes only the boxes of it
that it holds: its tp slice (the contract's `ShardSpec`), cut to its ZeRO range (`boxes.py`
turns a flat range into rectangular boxes; `state.py` says which rank writes which
element). On load, a rank of any other layout asks for the full tensors of the parameters
its stage holds; `torch.distributed.checkpoint` assembles them from whichever boxes overlap,
and the rank keeps its own slice (`state.py`), which its optimizer engine turns back into
shards (`load_state_dict`). Beside the tensors, `trainer.json` holds what else continues the
run: the step, the sampler's position, the engine's step count and the fp16 loss scaler,
the config, the best validation so far; no random-generator state is saved, since dropout is
keyed by (seed, step, sample) (models/dropout.py). `io.py` saves and loads a rank's share;
`store.py` writes `trainer.json` and the manifest, commits the folder atomically and finds
the newest; a LoRA checkpoint names its frozen base instead of copying it (`base.py`);
`inspect.py` reads one whole for `plait checkpoint` and `plait export`.
"""
