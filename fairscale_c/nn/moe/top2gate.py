"""Top2Gate and top2gating with FairScale 0.4.13's API: GShard's top-2 gating
(https://arxiv.org/abs/2006.16668, Algorithm 1).

Each of S tokens goes to its most probable expert and to a second one drawn by the Gumbel-max
trick (the logits plus Gumbel noise, the first expert excluded). Each expert takes at most
``capacity = 2 * S // E`` tokens; first choices fill the capacity in token order, second choices
after all first choices; a choice past the capacity is dropped. The two kept weights of a token
are its softmax probabilities renormalised to sum to 1.

``top2gating(logits)`` returns FairScale's dense triple: ``l_aux`` (the load-balancing loss),
``combine_weights`` (S, E, capacity) and ``dispatch_mask`` (its non-zeros). Those are
O(S * E * capacity) = O(2 S^2) in memory; MOELayer here routes from the compact form
(:func:`top2_routing`: two experts, two slots and two weights per token) instead.

The noise is drawn as FairScale draws it (``torch.rand`` of the logits' shape in the default
dtype, turned into Gumbel(0, 1) samples the way torch.distributions does), so the same seed routes
the same tokens to the same experts under either library.
"""

from __future__ import annotations

from typing import NamedTuple, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor
from ...internal.args import as_int

__all__ = ["Top2Gate", "top2gating", "top2_routing", "Routing", "gumbel_rsample", "one_hot"]


class Routing(NamedTuple):
    """Where the tokens of one gating go: for token s and choice k (0: first, 1: second),
    ``experts[s, k]``, ``slots[s, k]`` (the position in that expert's capacity buffer; 0 where
    dropped) and ``weights[s, k]`` (float32; 0 where dropped). ``l_aux`` has the logits' dtype."""

    l_aux: Tensor
    experts: Tensor  # (S, 2) int64
    slots: Tensor  # (S, 2) int64
    weights: Tensor  # (S, 2) float32
    capacity: int
    num_experts: int


def gumbel_rsample(shape: Tuple[int, ...], device: torch.device) -> Tensor:
    """Gumbel(0, 1) samples of `shape` (default dtype): -log(-log(u)), u uniform in
    [tiny, 1 - eps), one ``torch.rand`` draw."""
    dtype = torch.get_default_dtype()
    finfo = torch.finfo(dtype)
    low = torch.tensor(finfo.tiny, dtype=dtype, device=device)
    high = torch.tensor(1.0 - finfo.eps, dtype=dtype, device=device)
    u = low + torch.rand(shape, dtype=dtype, device=device) * (high - low)
    return -torch.log(-torch.log(u))


def one_hot(tensor: Tensor, num_classes: int) -> Tensor:
    """One-hot encoding along a new last dimension, in `tensor`'s dtype."""
    if num_classes <= 0:
        raise ValueError(f"one_hot: argument 'num_classes' must be a positive integer, got {num_classes!r}")
    out = torch.zeros(tensor.shape + (num_classes,), device=tensor.device, dtype=tensor.dtype)
    return out.scatter_(-1, tensor.unsqueeze(-1), 1)


def top2_routing(logits: Tensor) -> Routing:
    """The compact form of top-2 gating on `logits` (S tokens, E experts)."""
    if logits.dim() != 2:
        raise ValueError(
            f"top2gating: argument 'logits' must be 2-D (tokens, experts), got shape {tuple(logits.shape)}"
        )
    num_tokens, num_experts = logits.shape
    if num_experts < 1 or num_tokens % num_experts:
        raise ValueError(
            f"top2gating: the number of tokens ({num_tokens}) must be a multiple of the number of experts "
            f"({num_experts})"
        )
    capacity = 2 * num_tokens // num_experts
    gates = F.softmax(logits, dim=1, dtype=torch.float)  # softmax in float32, as in mixed precision

    first = torch.argmax(gates, dim=1)
    mask1 = one_hot(first, num_experts)
    noisy = logits + gumbel_rsample(tuple(logits.shape), logits.device)
    second = torch.argmax(noisy.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = one_hot(second, num_experts)

    # Capacity slots: first choices in token order, then second choices after every first choice.
    slot1 = (torch.cumsum(mask1, dim=0) - 1).gather(1, first.unsqueeze(1)).squeeze(1)
    per_expert1 = mask1.sum(dim=0)
    slot2 = (torch.cumsum(mask2, dim=0) - 1 + per_expert1).gather(1, second.unsqueeze(1)).squeeze(1)

    # Load-balancing loss: mean over experts of (mean gate) x (fraction of first choices).
    l_aux = torch.mean(gates.mean(dim=0) * mask1.float().mean(dim=0))

    kept1, kept2 = slot1 < capacity, slot2 < capacity
    g1 = gates.gather(1, first.unsqueeze(1)).squeeze(1) * kept1
    g2 = gates.gather(1, second.unsqueeze(1)).squeeze(1) * kept2
    denom = torch.clamp(g1 + g2, min=torch.finfo(g1.dtype).eps)
    weights = torch.stack([g1 / denom, g2 / denom], dim=1)
    slots = torch.stack([slot1 * kept1, slot2 * kept2], dim=1)
    experts = torch.stack([first, second], dim=1)
    return Routing(l_aux.to(logits.dtype), experts, slots, weights, capacity, num_experts)


def dense(routing: Routing, dtype: torch.dtype) -> Tuple[Tensor, Tensor]:
    """FairScale's (combine_weights, dispatch_mask) from the compact form: combine_weights[s, e, c]
    is token s's weight for slot c of expert e (in `dtype`), dispatch_mask its non-zeros."""
    num_tokens = routing.experts.shape[0]
    tokens = torch.arange(num_tokens, device=routing.experts.device).unsqueeze(1).expand(-1, 2)
    combine = routing.weights.new_zeros(num_tokens, routing.num_experts, routing.capacity)
    # A dropped choice adds its weight, 0, at slot 0: nothing.
    combine = combine.index_put((tokens, routing.experts, routing.slots), routing.weights, accumulate=True)
    combine = combine.to(dtype)
    return combine, combine.bool()


def top2gating(logits: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """Top-2 gating on `logits` (S tokens, E experts, S a multiple of E): (l_aux, combine_weights
    (S, E, 2S/E) in the logits' dtype, dispatch_mask (bool, the same shape))."""
    routing = top2_routing(logits)
    combine, dispatch = dense(routing, logits.dtype)
    return routing.l_aux, combine, dispatch


class Top2Gate(torch.nn.Module):
    """The gate of an MOELayer: a bias-free linear map from the model dimension to one logit per
    expert, then top-2 gating. ``l_aux, combine_weights, dispatch_mask = gate(tokens)`` for
    tokens of shape (S, model_dim)."""

    wg: torch.nn.Linear

    def __init__(self, model_dim: int, num_experts: int) -> None:
        super().__init__()
        for name, value in (("model_dim", model_dim), ("num_experts", num_experts)):
            if as_int(value) is None or value < 1:
                raise ValueError(f"Top2Gate: argument '{name}' must be a positive int, got {value!r}")
        model_dim, num_experts = as_int(model_dim), as_int(num_experts)
        self.wg = torch.nn.Linear(model_dim, num_experts, bias=False)

    def forward(self, input: Tensor) -> Tuple[Tensor, Tensor, Tensor]:  # type: ignore[override]
        return top2gating(self.wg(input))

    def route(self, input: Tensor) -> Routing:
        """The compact form of ``forward(input)`` (same draws of the noise, same result)."""
        return top2_routing(self.wg(input))
