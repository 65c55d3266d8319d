"""DynamicLossScaler: loss scaling for mixed precision whose scale lives on the host, so it works
for optimizers on any device (CPU included), as fairscale.experimental.optim.DynamicLossScaler
(docs/experimental.md).

``scaler.scale(loss).backward()``, then ``scaler.step(optimizer)`` (which skips the step when a
gradient is inf or NaN, lowering the scale) and ``scaler.update()`` (which raises the scale after
``scale_window`` steps without an overflow).
"""

from __future__ import annotations

import math
from collections import defaultdict
from enum import Enum
from typing import Any, Dict, List, Optional

import torch
from ...internal.args import as_int


class OptState(Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _refresh_per_optimizer_state() -> OptState:
    return OptState.READY


def _grads(optimizer: torch.optim.Optimizer) -> List[torch.Tensor]:
    return [p.grad.detach() for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


class DynamicLossScaler:
    """``DynamicLossScaler(init_scale=2.0**15, scale_factor=2.0, scale_window=2000, tolerance=0.0,
    threshold=None, min_loss_scale=1e-4)``: the scale starts at ``init_scale``; an overflow divides
    it by ``scale_factor`` (not below ``threshold``) once the share of overflowing steps since the
    last change reaches ``tolerance``; ``scale_window`` steps without one multiply it by
    ``scale_factor``. A scale at or below ``min_loss_scale`` raises FloatingPointError."""

    def __init__(
        self,
        init_scale: float = 2.0**15,
        scale_factor: float = 2.0,
        scale_window: int = 2000,
        tolerance: float = 0.0,
        threshold: Optional[float] = None,
        min_loss_scale: float = 1e-4,
    ) -> None:
        if not scale_factor > 1.0:
            raise ValueError(f"DynamicLossScaler: argument 'scale_factor' must be > 1.0, got {scale_factor}")
        if as_int(scale_window) is None or scale_window < 1:
            raise ValueError(f"DynamicLossScaler: argument 'scale_window' must be an int >= 1, got {scale_window!r}")
        scale_window = as_int(scale_window)
        self.loss_scale = init_scale
        self.scale_factor = scale_factor
        self.scale_window = scale_window
        self.tolerance = tolerance
        self.threshold = threshold
        self.min_loss_scale = min_loss_scale
        self._iter = 0
        self._last_overflow_iter = -1
        self._last_rescale_iter = -1
        self._overflows_since_rescale = 0
        self._per_optimizer_states: Dict[int, OptState] = defaultdict(_refresh_per_optimizer_state)

    def scale(self, outputs: Any) -> Any:
        """``outputs`` (a tensor, or an iterable of tensors) times the loss scale."""
        if isinstance(outputs, torch.Tensor):
            return self.loss_scale * outputs
        return type(outputs)(self.loss_scale * o for o in outputs)

    @staticmethod
    def _norm(grads: List[torch.Tensor]) -> float:
        if not grads:
            return 0.0
        norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
        return torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms])).item()

    def _decrease_loss_scale(self) -> None:
        self.loss_scale /= self.scale_factor
        if self.threshold is not None:
            self.loss_scale = max(self.loss_scale, self.threshold)

    def _check_overflow(self, grad_norm: float) -> None:
        """On an inf/NaN norm: count the overflow, lower the scale when the share of overflowing
        steps since the last change reaches the tolerance, and raise OverflowError."""
        if not (math.isinf(grad_norm) or math.isnan(grad_norm)):
            return
        prev_scale = self.loss_scale
        self._last_overflow_iter = self._iter
        self._overflows_since_rescale += 1
        if self._overflows_since_rescale / float(self._iter - self._last_rescale_iter) >= self.tolerance:
            self._decrease_loss_scale()
            self._last_rescale_iter = self._iter
            self._overflows_since_rescale = 0
        if self.loss_scale <= self.min_loss_scale:
            self.loss_scale = prev_scale
            raise FloatingPointError(
                f"Minimum loss scale reached ({self.min_loss_scale}). Your loss is probably exploding. Try lowering "
                "the learning rate, using gradient clipping or increasing the batch size."
            )
        self._iter += 1
        raise OverflowError("setting loss scale to: " + str(self.loss_scale))

    def update(self) -> None:
        """Raise the scale after ``scale_window`` iterations without an overflow; a new iteration."""
        if (self._iter - self._last_overflow_iter) % self.scale_window == 0:
            self.loss_scale *= self.scale_factor
            self._last_rescale_iter = self._iter
        self._iter += 1
        self._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """Unscale the gradients (unless :meth:`unscale_` did) and step the optimizer; ``None``
        without stepping when a gradient is inf or NaN (the scale is lowered)."""
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if DynamicLossScaler is enabled.")
        state = self._per_optimizer_states[id(optimizer)]
        if state is OptState.STEPPED:
            raise RuntimeError("step() has already been called since the last update().")
        try:
            self._check_overflow(self._norm(_grads(optimizer)))
        except OverflowError:
            return None
        if state is OptState.READY:
            self.unscale_(optimizer)
        retval = optimizer.step(*args, **kwargs)
        self._per_optimizer_states[id(optimizer)] = OptState.STEPPED
        return retval

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the loss scale (once per iteration, before step)."""
        state = self._per_optimizer_states[id(optimizer)]
        if state is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        grads = _grads(optimizer)
        if grads:
            with torch.no_grad():
                torch._foreach_mul_(grads, 1.0 / float(self.loss_scale))
        self._per_optimizer_states[id(optimizer)] = OptState.UNSCALED

    def state_dict(self) -> Optional[Dict[str, float]]:
        return {"loss_scale": self.loss_scale} if self.loss_scale is not None else None

    def load_state_dict(self, state_dict: Dict[str, float]) -> None:
        if "loss_scale" in state_dict:
            self.loss_scale = state_dict["loss_scale"]


__all__ = ["DynamicLossScaler"]
