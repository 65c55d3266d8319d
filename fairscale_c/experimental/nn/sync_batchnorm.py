"""SyncBatchNorm: batch normalisation whose statistics cover the whole batch across a process group,
as fairscale.experimental.nn.SyncBatchNorm (docs/experimental.md).

Forward: each rank's per-channel mean, variance and count go to every rank in one all_gather of
2C + 1 values, and are combined with the parallel-variance formula (no E[x^2] - E[x]^2
cancellation). Backward: one all_reduce of 2C values (the sums of dy and of dy * xhat). The
weight and bias gradients stay local, as with torch's and FairScale's (a data-parallel wrapper
averages them). Statistics are float32 (float64 for float64 input); the output has the input's
dtype. The per-element passes are torch's fused batch-norm kernels (the statistics, the
normalisation, the backward's sums).

Under checkpoint_wrapper the statistics are computed (and the running statistics updated) in the
first pass only; the recomputation reuses them, so it neither communicates again nor counts the
batch twice.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from ... import _C
from ...distributed import group_for
from ...internal.copying import deepcopy_sharing
from ...nn.checkpoint import is_checkpointing, is_recomputing


def _stat_dtype(input: Tensor) -> torch.dtype:
    return torch.float64 if input.dtype == torch.float64 else torch.float32


def _calculate_stats(input: Tensor, eps: float, group: Any) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(mean, biased var, invstd, total count) per channel over every rank's batch."""
    channels, dtype = input.size(1), _stat_dtype(input)
    count = input.numel() // channels if channels else 0
    if count:
        x = input if input.dtype == dtype else input.to(dtype)
        mean, var = torch.batch_norm_update_stats(x, None, None, 0.0)  # var: biased
        local = torch.cat([mean, var, torch.tensor([float(count)], dtype=dtype, device=input.device)])
    else:
        local = torch.zeros(2 * channels + 1, dtype=dtype, device=input.device)
    gathered = torch.empty(group.size * local.numel(), dtype=dtype, device=input.device)
    group.all_gather(gathered, local)
    if gathered.device.type == "cpu":  # the combination in one C call
        out = torch.empty(3 * channels + 1, dtype=dtype)
        _C.cpu_bn_combine(gathered, group.size, eps, out)
        return out[:channels], out[channels : 2 * channels], out[2 * channels : 3 * channels], out[3 * channels :]
    rows = gathered.view(group.size, -1)
    means, vars_, counts = rows[:, :channels], rows[:, channels:-1], rows[:, -1:]
    total = counts.sum()
    mean = (counts * means).sum(0) / total
    var = (counts * (vars_ + (means - mean) ** 2)).sum(0) / total
    return mean, var, torch.rsqrt(var + eps), total


class _SyncBatchNormFunction(torch.autograd.Function):
    """y = (x - mean) * invstd * weight + bias with statistics computed outside (so that a
    checkpoint's recomputation reuses them); backward all-reduces the two per-channel sums the
    input gradient needs."""

    @staticmethod
    def forward(ctx: Any, input: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], mean: Tensor,
                var: Tensor, invstd: Tensor, total: Tensor, eps: float, group: Any) -> Tensor:  # fmt: skip
        ctx.save_for_backward(input, weight, mean, invstd, total)
        ctx.group = group
        # torch's kernel takes the parameters in the statistics' dtype beside a lower-precision input
        weight, bias = (t if t is None or t.dtype == mean.dtype else t.to(mean.dtype) for t in (weight, bias))
        return F.batch_norm(input, mean, var, weight, bias, False, 0.0, eps)

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> Tuple[Optional[Tensor], ...]:
        input, weight, mean, invstd, total = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_output = grad_output.contiguous()
        # this rank's sums of dy * xhat and of dy (xhat = (x - mean) * invstd): the weight's and
        # bias's gradients, and after an all_reduce over the group what the input's needs
        if input.numel() and input.device.type == "cpu":
            _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                grad_output, input, None, None, None, mean, invstd, True, 0.0, [False, True, True]
            )
        elif input.numel():  # the reduction torch's SyncBatchNorm uses off the host
            sum_dy, sum_dy_xmu, _, _ = torch.batch_norm_backward_reduce(
                grad_output, input, mean, invstd, None, True, False, False
            )
            sum_dy_xhat = sum_dy_xmu * invstd
        else:  # this rank holds no rows (torch's kernel divides by the row count)
            sum_dy_xhat = sum_dy = torch.zeros_like(mean)
        sums = torch.cat([sum_dy, sum_dy_xhat])
        if sums.dtype != mean.dtype:
            sums = sums.to(mean.dtype)
        work = ctx.group.all_reduce(sums, async_op=True) if need_input else None
        grad_weight = sum_dy_xhat.to(weight.dtype) if need_weight else None
        grad_bias = sum_dy.to(weight.dtype) if need_bias else None
        grad_input = None
        if need_input:
            work.wait()
            # dx = a * dy + b * (x - mean) + c, per channel
            if sums.device.type == "cpu":  # the coefficients in one C call
                channels = mean.numel()
                coeffs = torch.empty(3 * channels, dtype=mean.dtype)
                w = None if weight is None else weight.detach()
                _C.cpu_bn_coeffs(sums, float(total), invstd, w, coeffs)
                a, b, c = coeffs[:channels], coeffs[channels : 2 * channels], coeffs[2 * channels :]
            else:
                mean_dy, mean_dy_xhat = (sums / total).chunk(2)
                a = invstd if weight is None else invstd * weight.to(invstd.dtype)
                b, c = -a * invstd * mean_dy_xhat, -a * mean_dy
            if input.numel():
                x = input if input.dtype == a.dtype else input.to(a.dtype)
                # b * (x - mean) + c in one kernel: batch_norm with unit variance and no eps (the
                # aten op; F.batch_norm refuses eps 0)
                xmu_part = torch.batch_norm(x, b, c, mean, torch.ones_like(mean), False, 0.0, 0.0, False)
                shape = (1, -1) + (1,) * (input.ndim - 2)
                grad_input = torch.addcmul(xmu_part, grad_output, a.view(shape)).to(input.dtype)
            else:
                grad_input = torch.zeros_like(input)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


class SyncBatchNorm(torch.nn.BatchNorm2d):
    """fairscale.experimental.nn.SyncBatchNorm: ``SyncBatchNorm(num_features, eps=1e-5,
    momentum=0.1, affine=True, track_running_stats=True, *, process_group=None)``. In training,
    with torch.distributed initialised, the statistics span every rank of ``process_group``
    (default: the whole world); otherwise it is a plain BatchNorm. Inputs of 2 or more dimensions,
    channels on dim 1 (as torch.nn.SyncBatchNorm takes them)."""

    def __init__(self, *args: Any, process_group: Optional["dist.ProcessGroup"] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._process_group = process_group if process_group is not None else dist.group.WORLD
        self.saved_for_2nd_fwd: List[Tuple[Tensor, Tensor, Tensor, Tensor]] = []
        self.disable_patch_batchnorm = True

    def __deepcopy__(self, memo: dict) -> "SyncBatchNorm":
        """A copy with its own parameters and statistics, on the same process group."""
        return deepcopy_sharing(self, memo, [self._process_group])

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"SyncBatchNorm: expected an input of 2 or more dimensions, got {input.dim()}D")

    def forward(self, input: Tensor) -> Tensor:
        if not (dist.is_available() and dist.is_initialized()) or not self.training:
            return super().forward(input)
        self._check_input_dim(input)
        if input.size(1) != self.num_features:
            raise ValueError(
                f"SyncBatchNorm: input has {input.size(1)} channels (dim 1); expected num_features={self.num_features}"
            )
        group = group_for(self._process_group, argument="SyncBatchNorm: argument 'process_group'")
        if group.size == 1 and input.numel() <= input.size(1):
            raise ValueError(
                "SyncBatchNorm: expected more than 1 value per channel when training, got input size "
                f"{list(input.shape)}"
            )
        if is_recomputing():
            mean, var, invstd, total = self.saved_for_2nd_fwd.pop(0)
        else:
            with torch.no_grad():
                mean, var, invstd, total = _calculate_stats(input, self.eps, group)
                if total.device.type == "cpu" and float(total) == 1:  # the same total on every rank
                    raise ValueError(
                        "SyncBatchNorm: expected more than 1 value per channel when training, got "
                        f"{int(total)} over the {group.size} ranks' batches "
                        f"(this rank's input size {list(input.shape)})"
                    )
                if self.track_running_stats:
                    self._track_running_stats(mean, var, total)
            if is_checkpointing():
                self.saved_for_2nd_fwd.append((mean, var, invstd, total))
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, mean, var, invstd, total, self.eps, group)

    def _track_running_stats(self, mean: Tensor, var: Tensor, total: Tensor) -> None:
        self.num_batches_tracked.add_(1)
        momentum = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        unbiased = var * (total / (total - 1))
        self.running_mean.lerp_(mean.to(self.running_mean.dtype), momentum)
        self.running_var.lerp_(unbiased.to(self.running_var.dtype), momentum)

    @classmethod
    def convert_sync_batchnorm(
        cls, module: torch.nn.Module, process_group: Optional["dist.ProcessGroup"] = None
    ) -> torch.nn.Module:
        """Every ``BatchNorm*D`` in ``module`` replaced by a SyncBatchNorm over ``process_group``
        that shares its parameters and buffers; a BatchNorm ``module`` itself gives a new layer."""
        out = module
        if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
            out = cls(
                module.num_features,
                module.eps,
                module.momentum,
                module.affine,
                module.track_running_stats,
                process_group=process_group,
            )
            if module.affine:
                with torch.no_grad():
                    out.weight = module.weight
                    out.bias = module.bias
            out.running_mean = module.running_mean
            out.running_var = module.running_var
            out.num_batches_tracked = module.num_batches_tracked
            if hasattr(module, "qconfig"):
                out.qconfig = module.qconfig
        for name, child in module.named_children():
            out.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return out


__all__ = ["SyncBatchNorm"]
