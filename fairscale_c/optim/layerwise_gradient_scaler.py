"""LayerwiseGradientScaler: a gradient scale of its own for each layer of a network, as
fairscale.optim.layerwise_gradient_scaler.LayerwiseGradientScaler (docs/migration.md).

The layers are the model's modules in the order ``named_modules()`` lists them, and the forward
must run them in that order, one after the other, the last with scale 1 (an ``nn.Identity`` at the
end does it), as FairScale requires. ``scale()`` registers a full backward hook on every layer
that multiplies the gradient leaving layer i (its input gradient) by ``s[i-1] / s[i]``, so the
gradient reaching layer i's output, and with it layer i's parameter gradients, is the true one
times ``s[i]``. ``unscale()`` divides each layer's gradients by its scale and removes the hooks;
``step(optimizer)`` steps unless a gradient is inf or NaN, then updates every scale.

Differences from FairScale's class, each where FairScale's computes a wrong step:
- ``unscale()`` decides which layers to divide from the gradients it is given. FairScale's uses
  the inf/NaN flags of the previous ``step``, so in the step after an overflow it leaves the
  overflowing layer's gradients scaled and the optimizer steps with them.
- ``scale()`` twice before ``unscale()`` keeps one set of hooks (FairScale's stacks them, which
  multiplies the gradients twice); ``unscale()`` without a ``scale()`` before it raises.
- ``step()`` after a ``scale()`` with no ``unscale()`` unscales first, as torch's GradScaler does.
- Bad arguments raise, naming the argument: a ``layer_scale_dict`` key that names no module, a
  scale that is not a finite number > 0, a ``growth_interval`` below 1.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Dict, List, Tuple

import torch
import torch.nn as nn
from ..internal.args import as_int

__all__ = ["LayerInfo", "GradientHelper", "LayerwiseGradientScaler"]


class LayerInfo:
    """One layer's record: ``layer_name``, ``layer``, ``scaling_factor``, ``found_inf_or_nan`` (in
    the gradients last checked), ``growth_tracker`` (steps since the scale last changed) and
    ``scale_layer`` (whether the layer is in ``layer_scale_dict``, so its scale is updated)."""

    def __init__(self, name: str, layer: nn.Module, scale: float = 1.0, scale_layer: bool = False) -> None:
        self.layer_name = name
        self.layer = layer
        self.scaling_factor = scale
        self.found_inf_or_nan = False
        self.growth_tracker = 0
        self.scale_layer = scale_layer


class GradientHelper:
    """The backward hook of one layer: multiplies each input gradient by ``inputs_multiplier *
    outputs_multiplier`` (the previous layer's scale over this layer's)."""

    def __init__(self, name: str, inputs_multiplier: float, outputs_multiplier: float) -> None:
        self.layer_name = name
        self.inputs_multiplier = inputs_multiplier
        self.outputs_multiplier = outputs_multiplier

    def scale_gradients(self, m: nn.Module, inputs: Tuple, outputs: Tuple) -> Any:
        factor = self.inputs_multiplier * self.outputs_multiplier
        if factor == 1.0:
            return None  # the gradients pass unchanged
        return tuple(g.mul(factor) if g is not None else None for g in inputs)


def _check_scale(name: str, value: Any, where: str = "LayerwiseGradientScaler: argument 'layer_scale_dict'") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{where} maps {name!r} to {value!r}; expected a finite number > 0")
    return float(value)


class LayerwiseGradientScaler:
    """``LayerwiseGradientScaler(model, layer_scale_dict, growth_factor=2.0, backoff_factor=0.5,
    growth_interval=10000, min_scale=float32 tiny, max_scale=float32 max)``.

    ``layer_scale_dict`` maps module names (as ``model.named_modules()`` gives them) to their
    initial scales; every other module has scale 1 and keeps it. Each step::

        optimizer.zero_grad()
        scaler.scale()
        loss_fn(model(x), y).backward()
        scaler.unscale()
        scaler.step(optimizer)

    An inf or NaN in any gradient skips the optimizer's step; the scale of each listed layer whose
    gradients held one is multiplied by ``backoff_factor``, and that of a listed layer with
    ``growth_interval`` clean steps in a row by ``growth_factor``, both kept within
    [``min_scale``, ``max_scale``]. An empty ``layer_scale_dict`` makes ``scale`` and ``unscale``
    do nothing and ``step`` call ``optimizer.step()``.
    """

    def __init__(
        self,
        model: nn.Module,
        layer_scale_dict: dict,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 10000,
        min_scale: float = torch.finfo(torch.float32).tiny,
        max_scale: float = torch.finfo(torch.float32).max,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"LayerwiseGradientScaler: argument 'model' must be a torch.nn.Module, got {type(model).__name__}"
            )
        if not isinstance(layer_scale_dict, Mapping):
            raise TypeError(
                "LayerwiseGradientScaler: argument 'layer_scale_dict' must be a dict of module names to scales, "
                f"got {type(layer_scale_dict).__name__}"
            )
        if as_int(growth_interval) is None or growth_interval < 1:
            raise ValueError(
                f"LayerwiseGradientScaler: argument 'growth_interval' must be an int >= 1, got {growth_interval!r}"
            )
        growth_interval = as_int(growth_interval)
        if not min_scale <= max_scale:
            raise ValueError(
                f"LayerwiseGradientScaler: argument 'min_scale' ({min_scale}) must not exceed 'max_scale' ({max_scale})"
            )
        self._model = model
        self._layer_scale_dict: dict = layer_scale_dict
        self._growth_factor = growth_factor
        self._backoff_factor = backoff_factor
        self._growth_interval = growth_interval
        self._apply_layerwise_scaling = len(layer_scale_dict) > 0
        self._min_scale = min_scale
        self._max_scale = max_scale
        self._handles: List = []
        self._scaled = False  # scale() called and its gradients not yet unscaled
        self.layer_info: List[LayerInfo] = []
        if self._apply_layerwise_scaling:
            if not growth_factor > 1.0:
                raise AssertionError(
                    f"LayerwiseGradientScaler: argument 'growth_factor' must be > 1.0, got {growth_factor}"
                )
            if not backoff_factor < 1.0:
                raise AssertionError(
                    f"LayerwiseGradientScaler: argument 'backoff_factor' must be < 1.0, got {backoff_factor}"
                )
            self.layer_info = self._build_layer_info()

    def _build_layer_info(self) -> List[LayerInfo]:
        names = set()
        infos = []
        for name, layer in self._model.named_modules():
            if name == "":
                continue
            names.add(name)
            if name in self._layer_scale_dict:
                infos.append(LayerInfo(name, layer, _check_scale(name, self._layer_scale_dict[name]), True))
            else:
                infos.append(LayerInfo(name, layer, 1.0))
        unknown = [k for k in self._layer_scale_dict if k not in names]
        if unknown:
            raise ValueError(
                f"LayerwiseGradientScaler: argument 'layer_scale_dict' names no module of the model: {unknown!r} "
                f"(the model's modules: {sorted(names)!r})"
            )
        return infos

    def scale(self) -> None:
        """Registers each layer's backward hook with the current scales (replacing those of an
        earlier ``scale()`` not yet followed by ``unscale()``)."""
        if not self._apply_layerwise_scaling:
            return
        self._remove_hooks()
        previous = 1.0
        for info in self.layer_info:
            helper = GradientHelper(info.layer_name, previous, 1.0 / info.scaling_factor)
            self._handles.append(info.layer.register_full_backward_hook(helper.scale_gradients))
            previous = info.scaling_factor
        self._scaled = True

    def _remove_hooks(self) -> None:
        while self._handles:
            self._handles.pop().remove()

    def _find_inf_or_nan(self) -> List[bool]:
        """Whether each layer's gradients hold an inf or NaN, with one host sync per device."""
        by_device: Dict[torch.device, Tuple[List[int], List[torch.Tensor]]] = {}
        for idx, info in enumerate(self.layer_info):
            for param in info.layer.parameters():
                if param.grad is not None:
                    owners, grads = by_device.setdefault(param.grad.device, ([], []))
                    owners.append(idx)
                    grads.append(param.grad.detach())
        found = [False] * len(self.layer_info)
        for owners, grads in by_device.values():
            bad = [g.isfinite().all().logical_not() for g in grads]
            for owner, flag in zip(owners, torch.stack(bad).tolist()):
                found[owner] = found[owner] or flag
        return found

    def _check_for_inf_or_nan(self) -> None:
        for info, found in zip(self.layer_info, self._find_inf_or_nan()):
            info.found_inf_or_nan = found

    def unscale(self) -> None:
        """Divides the gradients of each layer that holds no inf or NaN by its scale, and removes
        the hooks ``scale()`` registered."""
        if not self._apply_layerwise_scaling:
            return
        if not self._scaled:
            raise RuntimeError(
                "LayerwiseGradientScaler.unscale() called without a scale() before it since the last unscale(): "
                "the gradients are not scaled"
            )
        self._remove_hooks()
        self._scaled = False
        self._check_for_inf_or_nan()
        for info in self.layer_info:
            if info.found_inf_or_nan or info.scaling_factor == 1.0:
                continue
            grads = [p.grad for p in info.layer.parameters() if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, 1.0 / info.scaling_factor)

    def step(self, optimizer: Any) -> None:
        """Calls ``optimizer.step()`` unless a gradient is inf or NaN, then updates the scales."""
        if not self._apply_layerwise_scaling:
            optimizer.step()
            return
        if self._scaled:
            self.unscale()  # checks the gradients as it divides them
        else:
            self._check_for_inf_or_nan()
        if not any(info.found_inf_or_nan for info in self.layer_info):
            optimizer.step()
        self._update_scale()

    def _clamp(self, value: float) -> float:
        return max(self._min_scale, min(value, self._max_scale))

    def _update_scale(self) -> None:
        for info in self.layer_info:
            if info.found_inf_or_nan:
                if info.scale_layer:
                    info.scaling_factor = self._clamp(self._backoff_factor * info.scaling_factor)
                    info.growth_tracker = 0
            else:
                info.growth_tracker += 1
                if info.scale_layer and info.growth_tracker == self._growth_interval:
                    info.scaling_factor = self._clamp(self._growth_factor * info.scaling_factor)
                    info.growth_tracker = 0

    def get_layer_info(self) -> List[LayerInfo]:
        """The LayerInfo of every layer, in ``named_modules()`` order."""
        return self.layer_info

    def get_backward_hooks(self) -> List:
        """``(name, hooks)`` for every module of the model, as FairScale's returns them."""
        return [(name, layer._get_backward_hooks()) for name, layer in self._model.named_modules() if name != ""]

    def state_dict(self) -> Dict[str, Any]:
        """Each layer's scale and growth tracker, for a checkpoint (FairScale's class has none)."""
        return {
            "scaling_factor": {info.layer_name: info.scaling_factor for info in self.layer_info},
            "growth_tracker": {info.layer_name: info.growth_tracker for info in self.layer_info},
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Restores what ``state_dict()`` returned, for a model with the same module names."""
        if not isinstance(state_dict, Mapping) or set(state_dict) != {"scaling_factor", "growth_tracker"}:
            raise ValueError(
                "LayerwiseGradientScaler.load_state_dict: argument 'state_dict' must be what state_dict() returned "
                "(keys 'scaling_factor' and 'growth_tracker')"
            )
        names = {info.layer_name for info in self.layer_info}
        for key in ("scaling_factor", "growth_tracker"):
            if set(state_dict[key]) != names:
                raise ValueError(
                    f"LayerwiseGradientScaler.load_state_dict: argument 'state_dict' holds {key!r} for modules "
                    f"{sorted(state_dict[key])!r}; this scaler's are {sorted(names)!r}"
                )
        for info in self.layer_info:
            info.scaling_factor = _check_scale(
                info.layer_name,
                state_dict["scaling_factor"][info.layer_name],
                "LayerwiseGradientScaler.load_state_dict: argument 'state_dict'",
            )
            info.growth_tracker = int(state_dict["growth_tracker"][info.layer_name])
