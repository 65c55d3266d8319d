"""Utilities that are not part of FairScale's API: sharded checkpoints that are all-or-nothing
across ranks (:mod:`fairscale_c.utils.checkpoint`), and the random and autocast state a
recomputation replays (:mod:`fairscale_c.utils.replay`)."""

from .checkpoint import CheckpointError, load_all_shards, load_sharded, read_manifest, save_sharded

__all__ = ["CheckpointError", "load_all_shards", "load_sharded", "read_manifest", "save_sharded"]
