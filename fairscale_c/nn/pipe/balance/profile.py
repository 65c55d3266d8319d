"""Per-layer cost of a Sequential: time (forward + backward) or memory (activations + parameters)."""

from __future__ import annotations

import copy
import time
from typing import Iterator, List, Tuple

import torch
from torch import nn

from ..microbatch import Tensors, TensorOrTensors, as_tuple


def _layers_on(module: nn.Sequential, device: torch.device) -> Iterator[nn.Module]:
    # Copies, so profiling neither moves the user's layers nor leaves gradients on them.
    for layer in module:
        clone = copy.deepcopy(layer).to(device)
        clone.train()
        yield clone


def _detached(values: Tensors) -> Tensors:
    return tuple(x.detach().requires_grad_(x.requires_grad) for x in values)


def _call(layer: nn.Module, values: Tensors, atomic: bool) -> Tuple[Tensors, bool]:
    out = layer(values[0] if atomic else values)
    return as_tuple(out), isinstance(out, torch.Tensor)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_times(module: nn.Sequential, sample: TensorOrTensors, timeout: float, device: torch.device) -> List[int]:
    """Microseconds spent in each layer's forward and backward, summed over as many passes as
    fit in `timeout` seconds (at least one)."""
    if any(p.grad is not None for p in module.parameters()):
        raise ValueError("some parameter already has gradient")
    start_atomic = isinstance(sample, torch.Tensor)
    start_values = tuple(x.detach().to(device).requires_grad_(x.requires_grad) for x in as_tuple(sample))
    totals = [0.0] * len(module)
    begun = time.perf_counter()
    while True:
        values, atomic = start_values, start_atomic
        for i, layer in enumerate(_layers_on(module, device)):
            values = _detached(values)
            _sync(device)
            tick = time.perf_counter()
            values, atomic = _call(layer, values, atomic)
            needs = tuple(y for y in values if y.requires_grad)
            if needs:
                torch.autograd.backward(needs, needs)
            _sync(device)
            totals[i] += time.perf_counter() - tick
        if time.perf_counter() - begun >= timeout:
            break
    return [int(t * 1_000_000) for t in totals]


def _saved_bytes(layer: nn.Module, values: Tensors, atomic: bool) -> Tuple[Tensors, bool, int]:
    """Run `layer` and count the bytes of the distinct storages autograd saves for backward,
    plus the outputs' (what a layer keeps alive in training, on any device)."""
    seen = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter):
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, atomic = _call(layer, values, atomic)
    for y in out:
        seen[y.untyped_storage().data_ptr()] = y.untyped_storage().nbytes()
    for x in values:  # the input is counted by the layer that produced it
        seen.pop(x.untyped_storage().data_ptr(), None)
    return out, atomic, sum(seen.values())


def profile_sizes(
    module: nn.Sequential, input: TensorOrTensors, chunks: int, param_scale: float, device: torch.device
) -> List[int]:
    """Bytes each layer needs in training: its activations for one micro-batch (measured on one
    sample, scaled to batch / chunks) plus `param_scale` times its parameters."""
    atomic = isinstance(input, torch.Tensor)
    inputs = as_tuple(input)
    latent_scale = inputs[0].size(0) / chunks
    values = tuple(x[:1].detach().to(device).requires_grad_(x.requires_grad) for x in inputs)
    sizes = []
    for layer in _layers_on(module, device):
        values = _detached(values)
        if device.type == "cuda":
            before = torch.cuda.memory_allocated(device)
            values, atomic = _call(layer, values, atomic)
            latent = torch.cuda.memory_allocated(device) - before
        else:
            values, atomic, latent = _saved_bytes(layer, values, atomic)
        params = sum(p.numel() * p.element_size() for p in layer.parameters())
        sizes.append(int(latent * latent_scale + params * param_scale))
    return sizes
