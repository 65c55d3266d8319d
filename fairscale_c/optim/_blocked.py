"""Stepping large CPU parameters in cache-sized blocks, for OSS's inner optimizer.

torch's single-tensor SGD, Adam and AdamW run one elementwise operation after another over the
whole parameter. For a parameter much larger than the caches (an embedding of millions of
elements), every one of those operations streams the parameter, its gradient and its state from
memory again. Stepped in blocks, a block's parameter, gradient and state stay in the cache across
the operations. Every element goes through the same operations with the same scalars, so the
result is bit for bit the whole-tensor step's (tested). Measured: docs/benchmarks.md, "OSS",
"2026-11-25".

Only where that holds is it used: the exact classes below (not subclasses, which may do anything
in their step), on CPU, with the single-tensor implementation (neither ``foreach`` nor ``fused``,
whose kernels already make one pass or group operations across tensors), not capturable or
differentiable, and once a parameter's state exists (the first step creates it whole).
"""

from __future__ import annotations

import contextlib
from typing import Dict, Iterator, List, Tuple

import torch
from torch.optim import SGD, Adam, AdamW, Optimizer

from ._oss_state import PER_ELEMENT_STATE

# Parameters with at least this many elements are stepped in blocks of _BLOCK elements: 64K float32
# elements are 256 KiB per tensor, so a block's parameter, gradient and two state tensors fit in a
# 1 MiB L2 cache.
_MIN_ELEMENTS = 1 << 20
_BLOCK = 1 << 16
_CLASSES = (SGD, Adam, AdamW)


def _group_eligible(group: dict) -> bool:
    return not (group.get("foreach") or group.get("fused") or group.get("capturable") or group.get("differentiable"))


def _param_eligible(optim: Optimizer, group: dict, p: torch.Tensor) -> bool:
    g = p.grad
    if p.numel() < _MIN_ELEMENTS or g is None or p.device.type != "cpu" or g.is_sparse or p.is_complex():
        return False
    if not (p.is_contiguous() and g.is_contiguous() and g.shape == p.shape and g.dtype == p.dtype):
        return False
    state = optim.state.get(p)
    if isinstance(optim, SGD):
        if group["momentum"] == 0:
            return True
        buf = None if state is None else state.get("momentum_buffer")
        return buf is not None and buf.shape == p.shape and buf.is_contiguous()
    if not state or "step" not in state:
        return False
    for key, value in state.items():
        if key in PER_ELEMENT_STATE:
            if not (torch.is_tensor(value) and value.shape == p.shape and value.is_contiguous()):
                return False
        elif torch.is_tensor(value) and value.numel() != 1:
            return False
    return True


def _blocks(optim: Optimizer, p: torch.Tensor) -> List[torch.Tensor]:
    """Block views of p, each with its gradient's block and a state whose per-element entries are
    views of p's state and whose scalar tensors (Adam's step) are copies."""
    flat, grad, n = p.detach().view(-1), p.grad.view(-1), p.numel()
    state = optim.state.get(p, {})
    out = []
    for lo in range(0, n, _BLOCK):
        hi = min(n, lo + _BLOCK)
        v = flat[lo:hi]
        v.grad = grad[lo:hi]
        optim.state[v] = {
            k: (s.view(-1)[lo:hi] if k in PER_ELEMENT_STATE else s.clone() if torch.is_tensor(s) else s)
            for k, s in state.items()
        }
        out.append(v)
    return out


@contextlib.contextmanager
def stepped_in_blocks(optim: Optimizer) -> Iterator[None]:
    """Within the block, ``optim.step()`` steps large eligible parameters in blocks; afterwards the
    param groups and state are as if it had stepped them whole."""
    if type(optim) not in _CLASSES:
        yield
        return
    swapped: List[Tuple[dict, list]] = []
    blocks: Dict[torch.Tensor, List[torch.Tensor]] = {}
    try:
        for group in optim.param_groups:
            if not _group_eligible(group):
                continue
            params = group["params"]
            big = [p for p in params if _param_eligible(optim, group, p)]
            if not big:
                continue
            for p in big:
                blocks[p] = _blocks(optim, p)
            swapped.append((group, params))
            group["params"] = [v for p in params for v in (blocks[p] if p in blocks else (p,))]
        yield
        for p, views in blocks.items():
            state = optim.state.get(p)
            if state is None:
                continue
            for key, value in state.items():  # scalars advance alike in every block: take the first's
                if key not in PER_ELEMENT_STATE and torch.is_tensor(value):
                    value.copy_(optim.state[views[0]][key])
    finally:
        for group, params in swapped:
            group["params"] = params
        for views in blocks.values():
            for v in views:
                optim.state.pop(v, None)
