"""fairscale_c.experimental.nn.data_parallel — mirrors fairscale.experimental.nn.data_parallel:
SlowMoDistributedDataParallel (LocalSGD or stochastic gradient push, with slow momentum) on CPU
ranks (shared-memory engine) and CUDA ranks (NCCL). See docs/experimental.md."""

from .gossip import SlowMoBaseAlgorithm, SlowMoDistributedDataParallel

__all__ = ["SlowMoBaseAlgorithm", "SlowMoDistributedDataParallel"]
