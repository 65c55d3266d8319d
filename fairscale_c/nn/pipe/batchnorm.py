"""DeferredBatchNorm: BatchNorm whose running statistics cover the whole mini-batch.

Inside a Pipe each micro-batch is normalised by its own statistics (as plain BatchNorm would do
for that micro-batch), but the running mean and variance are updated once per mini-batch, from
sums over all its micro-batches, so they end as a BatchNorm fed the whole mini-batch at once
would leave them. Recomputation under checkpointing does not count twice.
"""

from __future__ import annotations

from typing import Optional, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..checkpoint import is_recomputing

TModule = TypeVar("TModule", bound=nn.Module)

__all__ = ["DeferredBatchNorm", "begin_mini_batch"]


class DeferredBatchNorm(_BatchNorm):
    """BatchNorm that commits running statistics every `chunks` micro-batches.

    A Pipe calls `begin` before each training mini-batch with the number of micro-batches it
    actually made, which is smaller than `chunks` for a batch of fewer than `chunks` rows, so the
    commit still happens once per mini-batch. The running variance is the unbiased variance over
    the mini-batch, as ``nn.BatchNorm*`` computes it (FairScale's keeps the biased one)."""

    sum: Tensor
    sum_squares: Tensor

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: Optional[float] = 0.1,
        affine: bool = True,
        chunks: int = 1,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats=True)
        self.register_buffer("sum", torch.zeros_like(self.running_mean))
        self.register_buffer("sum_squares", torch.zeros_like(self.running_var))
        self.counter = 0
        self.tracked = 0
        self.chunks = chunks
        self._expected = chunks

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() <= 2:
            raise ValueError(f"expected at least 3D input (got {input.dim()}D input)")

    def begin(self, micro_batches: int) -> None:
        """Start a mini-batch of `micro_batches` micro-batches, dropping the sums of one that
        did not finish (its forward raised)."""
        with torch.no_grad():
            self.sum.zero_()
            self.sum_squares.zero_()
        self.counter = 0
        self.tracked = 0
        self._expected = micro_batches

    def _track(self, input: Tensor) -> bool:
        dims = [0, *range(2, input.dim())]
        with torch.no_grad():
            x = input.detach().to(self.sum.dtype)
            self.sum += x.sum(dims)
            self.sum_squares += (x * x).sum(dims)
        self.counter += input.numel() // input.size(1)
        self.tracked += 1
        return self.tracked == self._expected

    def _commit(self) -> None:
        self.num_batches_tracked += 1
        factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        n = self.counter
        mean = self.sum / n
        var = (self.sum_squares - mean * self.sum) / max(n - 1, 1)
        with torch.no_grad():
            self.running_mean.mul_(1 - factor).add_(mean, alpha=factor)
            self.running_var.mul_(1 - factor).add_(var, alpha=factor)
            self.sum.zero_()
            self.sum_squares.zero_()
        self.counter = 0
        self.tracked = 0
        self._expected = self.chunks

    def forward(self, input: Tensor) -> Tensor:
        if not self.training:
            return F.batch_norm(
                input, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
            )
        if not is_recomputing() and self._track(input):
            self._commit()
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    @classmethod
    def convert_deferred_batch_norm(cls, module: TModule, chunks: int = 1) -> TModule:
        """Replace every BatchNorm with running statistics in `module` (or `module` itself) by a
        DeferredBatchNorm sharing its parameters and buffers."""
        if isinstance(module, DeferredBatchNorm) and module.chunks is chunks:
            return module
        out: nn.Module = module
        if isinstance(module, _BatchNorm) and module.track_running_stats:
            out = DeferredBatchNorm(module.num_features, module.eps, module.momentum, module.affine, chunks)
            out = out.to(module.running_mean.device)
            if module.affine:
                out.register_parameter("weight", module.weight)
                out.register_parameter("bias", module.bias)
            out.register_buffer("running_mean", module.running_mean)
            out.register_buffer("running_var", module.running_var)
            out.register_buffer("num_batches_tracked", module.num_batches_tracked)
            out.train(module.training)
        for name, child in module.named_children():
            out.add_module(name, cls.convert_deferred_batch_norm(child, chunks))
        return out  # type: ignore[return-value]


def begin_mini_batch(module: nn.Module, micro_batches: int) -> None:
    """Tell every DeferredBatchNorm in `module` that a training mini-batch of `micro_batches`
    micro-batches starts."""
    for m in module.modules():
        if isinstance(m, DeferredBatchNorm) and m.training:
            m.begin(micro_batches)
