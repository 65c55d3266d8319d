"""patch_batchnorm, as fairscale.nn.checkpoint.checkpoint_utils.patch_batchnorm: BatchNorm layers
that leave their running statistics alone in forwards run without autograd.

checkpoint_wrapper does not need it (it freezes the statistics during its own recomputation,
see checkpoint_activations.py); it is here for code that calls it, e.g. around a checkpointing
scheme of its own whose first pass runs under torch.no_grad().
"""

from __future__ import annotations

from typing import Any, List

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm


def _stop_tracking_without_grad(bn: _BatchNorm, inputs: Any) -> None:
    if not torch.is_grad_enabled():
        bn._fsc_tracking_before_patch = bn.track_running_stats
        bn.track_running_stats = False


def _restore_tracking(bn: _BatchNorm, inputs: Any, output: Any) -> None:
    tracking = bn.__dict__.pop("_fsc_tracking_before_patch", None)
    if tracking is not None:
        bn.track_running_stats = tracking


def patch_batchnorm(module: nn.Module) -> List[Any]:
    """Make every BatchNorm in ``module`` (1d, 2d, 3d, SyncBatchNorm, ...; not those with a
    ``disable_patch_batchnorm`` attribute) skip its running statistics in a forward run with
    autograd disabled, as if that forward had not happened. Returns the hook handles
    (``handle.remove()`` undoes it)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"patch_batchnorm: argument 'module' must be an nn.Module, got {type(module).__name__}")
    handles: List[Any] = []
    for child in module.modules():
        if isinstance(child, _BatchNorm) and not hasattr(child, "disable_patch_batchnorm"):
            handles.append(child.register_forward_pre_hook(_stop_tracking_without_grad))
            handles.append(child.register_forward_hook(_restore_tracking))
    return handles


__all__ = ["patch_batchnorm"]
