"""Checkpoints: layout-free sharded save and load with torch.distributed.checkpoint, atomic
commit, and resharding on load (docs/checkpoints.md).

How a checkpoint moves to another layout: nothing in it names a layout. Every tensor is
saved under its single-process name and shape (`"master/blocks.0.attn.qkv.weight"`,
`"exp_avg/..."`), and each rank writes only the boxes of it that it holds: its tp slice
(`parallel/tp/sharding.py`), cut to its ZeRO range (`boxes.py` turns a flat range into
rectangular boxes). On load, a rank of any other layout asks for the full tensors of the
parameters its stage holds; `torch.distributed.checkpoint` assembles them from whichever
boxes overlap, and the rank keeps its own slice (`state.py`), which its optimizer engine
turns back into shards (`load_state_dict`). The step, the sampler and the RNG come back with
it (`io.py`); folders are committed atomically and the newest is found (`store.py`);
`inspect.py` reads one whole for `plait checkpoint` and `plait export`.
"""
