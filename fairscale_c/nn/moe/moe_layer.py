"""MOELayer with FairScale 0.4.13's API: a mixture of experts spread over the ranks of a group,
GShard's Algorithm 2 (https://arxiv.org/abs/2006.16668).

::

    gate = Top2Gate(model_dim, num_experts=world_size * experts_per_rank)
    moe = MOELayer(gate, experts)          # experts: this rank's expert(s)
    out = moe(x)                           # x: (sequence, token, model_dim)
    loss = task_loss(out) + 0.01 * moe.l_aux

The gate sends each token to (up to) two experts; the tokens for expert e travel to the rank that
holds it in one all-to-all, come back through another, and are combined with the gate's weights.
Every rank holds ``len(experts)`` experts; expert e lives on rank ``e // len(experts)``.

Differences from FairScale's, none of them in the results:

- It runs on CPU ranks too (the all-to-alls go through fairscale_c.distributed: the shared-memory
  engine on one host, NCCL for CUDA tensors), and in one process without torch.distributed
  (a group of one rank).
- With the provided Top2Gate, tokens are dispatched and combined by index (two slots per token)
  instead of FairScale's einsums over dense (tokens x experts x capacity) tensors, which cost
  O(2 S^2 model_dim) work and O(2 S^2) memory for S tokens. Another gate (or a Top2Gate subclass
  that overrides ``forward``, or one with forward hooks) goes through the dense einsums, as in
  FairScale.
- Bad input raises ValueError / TypeError naming the argument where FairScale asserts.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ... import distributed as fdist
from ...internal.copying import deepcopy_sharing
from .top2gate import Routing, Top2Gate

__all__ = ["MOELayer"]


class _AllToAll(torch.autograd.Function):
    """All-to-all with equal blocks on dim 0; its gradient is the all-to-all of the gradient."""

    @staticmethod
    def forward(ctx: Any, group: Any, input: Tensor) -> Tensor:  # type: ignore[override]
        ctx.group = group
        input = input.detach().contiguous()  # the engine takes tensors without autograd history
        output = torch.empty_like(input)
        group.all_to_all_single(output, input)
        return output

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[None, Tensor]:  # type: ignore[override]
        return None, _AllToAll.apply(ctx.group, grad)


_ENGINE_GROUPS = (fdist.Group, fdist.LocalGroup)  # groups of fairscale_c.distributed itself


def _world_size(group: Any) -> int:
    if group is None:
        return 1
    if isinstance(group, _ENGINE_GROUPS):
        return group.size
    return dist.get_world_size(group)


class MOELayer(nn.Module):
    """Mixture of experts over the ranks of `group` (default: torch.distributed's default group;
    without torch.distributed, this process alone).

    Args:
        gate: maps tokens (S, model_dim) to ``(l_aux, combine_weights, dispatch_mask)`` (S, E,
            capacity), as Top2Gate does; E must be the group's size times the number of experts
            given here.
        experts: this rank's expert, or an ``nn.ModuleList`` of them. An expert is called on a
            tensor of shape (group size, 1, capacity, model_dim) and must return that shape. Their
            parameters get ``.expert = True`` (to leave them out of data-parallel reductions).
        group: a torch.distributed process group or a fairscale_c.distributed group.

    After a forward, ``l_aux`` holds the gate's load-balancing loss.
    """

    def __deepcopy__(self, memo: dict) -> "MOELayer":
        """A copy with its own gate and experts, on the same group."""
        return deepcopy_sharing(self, memo, [self.group])

    def __init__(self, gate: nn.Module, experts: Union[nn.Module, nn.ModuleList], group: Optional[Any] = None) -> None:
        super().__init__()
        if not isinstance(gate, nn.Module):
            raise TypeError(f"MOELayer: argument 'gate' must be an nn.Module, got {type(gate).__name__}")
        if not isinstance(experts, nn.Module):
            raise TypeError(
                f"MOELayer: argument 'experts' must be an nn.Module or nn.ModuleList, got {type(experts).__name__}"
            )
        self.gate = gate
        self.experts = experts if type(experts) is nn.ModuleList else nn.ModuleList([experts])
        if len(self.experts) == 0:
            raise ValueError("MOELayer: argument 'experts' is an empty ModuleList; expected at least one expert")
        if group is None and dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        self.group = group
        for expert in self.experts:
            for p in expert.parameters():
                p.expert = True  # type: ignore[attr-defined]
        self.world_size = _world_size(group)
        self.num_local_experts = len(self.experts)

    def _engine(self) -> Any:
        if isinstance(self.group, _ENGINE_GROUPS):
            return self.group
        return (
            fdist.group_for(self.group, argument="MOELayer: argument 'group'")
            if self.group is not None
            else fdist.LocalGroup()
        )

    def _compact_gate(self) -> bool:
        gate = self.gate
        return (
            isinstance(gate, Top2Gate)
            and type(gate).forward is Top2Gate.forward
            and not gate._forward_hooks
            and not gate._forward_pre_hooks
        )

    def forward(self, *input: Tensor, **kwargs: Any) -> Tensor:
        if len(input) != 1:
            raise ValueError(f"MOELayer.forward: expected one input tensor, got {len(input)}")
        x = input[0]
        if not isinstance(x, Tensor):
            raise TypeError(f"MOELayer.forward: argument 'input' must be a Tensor, got {type(x).__name__}")
        if x.dim() != 3:
            raise ValueError(
                f"MOELayer.forward: argument 'input' must have 3 dimensions (sequence, token, model), got shape "
                f"{tuple(x.shape)}"
            )
        if x.shape[0] % self.num_local_experts:
            raise ValueError(
                f"MOELayer.forward: dim 0 of 'input' ({x.shape[0]}) must be a multiple of the number of local "
                f"experts ({self.num_local_experts})"
            )
        d_model = x.shape[2]
        tokens = x.reshape(-1, d_model)
        routing: Optional[Routing] = None
        if self._compact_gate():
            routing = self.gate.route(tokens)  # type: ignore[operator]
            self.l_aux = routing.l_aux
            dispatched = _dispatch(tokens, routing)
        else:
            self.l_aux, combine_weights, dispatch_mask = self.gate(tokens)
            dispatched = torch.einsum("sec,sm->ecm", dispatch_mask.float(), tokens)
        experts = self.world_size * self.num_local_experts
        if dispatched.shape[0] != experts:
            raise ValueError(
                f"MOELayer.forward: the gate routes to {dispatched.shape[0]} experts, but the group's "
                f"{self.world_size} ranks x {self.num_local_experts} local experts make {experts}"
            )
        engine = self._engine()
        dispatched = _AllToAll.apply(engine, dispatched)
        # (experts, capacity, model) -> (ranks, local experts, capacity, model)
        dispatched = dispatched.reshape(self.world_size, self.num_local_experts, -1, d_model)
        chunks = dispatched.chunk(self.num_local_experts, dim=1)
        expert_output = torch.cat([expert(c) for c, expert in zip(chunks, self.experts)], dim=1)
        expert_output = _AllToAll.apply(engine, expert_output)
        expert_output = expert_output.reshape(experts, -1, d_model)
        if routing is not None:
            combined = _combine(expert_output, routing)
        else:
            combined = torch.einsum("sec,ecm->sm", combine_weights, expert_output)
        return combined.reshape(x.shape)


def _dispatch(tokens: Tensor, routing: Routing) -> Tensor:
    """(experts, capacity, model): slot c of expert e holds the token routed there, zeros elsewhere.
    A choice is dispatched where its weight is non-zero (FairScale's dispatch_mask)."""
    experts, capacity = routing.num_experts, routing.capacity
    sent = (routing.weights != 0).reshape(-1)
    where = (routing.experts * capacity + routing.slots).reshape(-1)[sent]
    which = torch.arange(tokens.shape[0], device=tokens.device).repeat_interleave(2)[sent]
    out = tokens.new_zeros(experts * capacity, tokens.shape[1])
    return out.index_copy(0, where, tokens.index_select(0, which)).reshape(experts, capacity, -1)


def _combine(expert_output: Tensor, routing: Routing) -> Tensor:
    """(tokens, model): each token's two expert outputs weighted by the gate (in the logits'
    dtype, as FairScale's combine_weights); a dropped choice has weight 0."""
    flat = expert_output.reshape(-1, expert_output.shape[-1])
    where = routing.experts * routing.capacity + routing.slots  # (S, 2)
    picked = flat.index_select(0, where.reshape(-1)).reshape(*where.shape, -1)
    weights = routing.weights.to(routing.l_aux.dtype)
    return (weights.unsqueeze(-1) * picked).sum(dim=1)
