"""Gradient scalers for mixed-precision training with sharded models (FairScale 0.4.13's
``fairscale.optim.grad_scaler``).

``GradScaler`` is torch's, except that it also unscales float16 gradients (pure fp16 models, or
FSDP with ``compute_dtype=torch.float16`` and no mixed precision), where torch raises
"Attempting to unscale FP16 gradients".

``ShardedGradScaler`` is for models whose gradients are sharded across ranks (FSDP, OSS): each
rank sees only its shard, so only some ranks may find an inf/NaN. ``unscale_`` therefore takes
the maximum of the found-inf flag over ``process_group`` (one all-reduce through fairscale_c's
engine), so every rank skips the same steps and backs off the same scale. Both scalers run on CPU
as well as CUDA: the scale lives on the device of the first tensor passed to ``scale()``.
"""

from typing import Any, Dict, Optional

import torch
import torch.distributed as dist

from fairscale_c import distributed as fdist


def _default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class GradScaler(torch.cuda.amp.GradScaler):
    """torch.amp.GradScaler that unscales float16 gradients too (FairScale's GradScaler). Its class
    is ``torch.cuda.amp.GradScaler``'s, as FairScale's is, so ``isinstance`` checks written for
    FairScale hold; it is built through ``torch.amp.GradScaler`` (without the CUDA class's
    deprecation warning) on the device found at run time."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
    ) -> None:
        torch.amp.GradScaler.__init__(
            self,
            _default_device(),
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        self._device = dev.type  # the scale follows the first scaled tensor (CPU or CUDA)
        super()._lazy_init_scale_growth_tracker(dev)

    def _unscale_grads_(self, optimizer: Any, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool):
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, True)


class ShardedGradScaler(GradScaler):
    """A GradScaler for sharded gradients: the found-inf flag is combined over ``process_group``
    (default: the default group once torch.distributed is initialised; without it, this is a
    plain GradScaler, except in a process launched as one of several ranks, where the first
    unscale raises), so all ranks step, or skip, together."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: Any = None,
    ) -> None:
        super().__init__(init_scale, growth_factor, backoff_factor, growth_interval, enabled)
        self.group = process_group
        self._comm: Optional[Any] = None

    def __getstate__(self) -> Dict[str, Any]:
        # the engine group is looked up again where the copy is used (torch.save, deepcopy)
        state = super().__getstate__()
        state["_comm"] = None
        return state

    def _group_comm(self) -> Any:
        if self._comm is None:
            if self.group is None and not (dist.is_available() and dist.is_initialized()):
                fdist.require_initialised_world("ShardedGradScaler(process_group=None)")
            self._comm = fdist.group_for(self.group, argument="ShardedGradScaler: argument 'process_group'")
        return self._comm

    def unscale_(self, optimizer: Any) -> None:
        """Unscale this optimizer's gradients (fp16 included) and agree with every rank of the
        group on whether any of them found an inf/NaN. Collective: every rank must call it (or
        ``step``) for the same optimizers in the same order."""
        if not self._enabled:
            return
        self._group_comm()  # a world without torch.distributed is refused before anything is unscaled
        super().unscale_(optimizer)
        self._agree(self._per_optimizer_states[id(optimizer)]["found_inf_per_device"])

    def _check_inf_per_device(self, optimizer: Any) -> Dict[torch.device, torch.Tensor]:
        """What torch's ``step`` calls instead of ``unscale_`` for an optimizer that unscales
        inside its own step (``_step_supports_amp_scaling``: the fused Adam, AdamW and SGD): the
        flags it hands that step and ``update`` are agreed on by every rank too."""
        per_device = super()._check_inf_per_device(optimizer)
        self._agree(per_device)
        return per_device

    def _agree(self, per_device: Dict[torch.device, torch.Tensor]) -> None:
        """Make this rank's found-inf flags the maximum over the group (collective)."""
        comm = self._group_comm()
        if comm.size == 1:
            return
        # One all-reduce per call whatever this rank holds (a rank without gradients still takes
        # part), on the scale's device.
        flag = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        for found in per_device.values():
            flag = torch.maximum(flag, found.to(flag.device))
        comm.all_reduce(flag, op="max")
        if not per_device:
            per_device[flag.device] = flag
        for found in per_device.values():
            found.copy_(flag.to(found.device))
