"""Checkpoints: layout-free sharded save and load with torch.distributed.checkpoint, atomic
commit, resharding on load (docs/checkpoints.md)."""
