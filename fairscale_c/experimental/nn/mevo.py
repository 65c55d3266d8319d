"""MEVO (MemoryEfficientVocabOutput): the output projection, softmax and NLL loss fused and tiled so
that the (tokens x vocabulary) logits never exist at once, as
fairscale.experimental.nn.mevo.MemoryEfficientVocabOutput (docs/experimental.md).

The forward streams over the vocabulary tiles once per token tile, keeping a running maximum and
sum of exponentials per token (an online log-sum-exp), and saves only the input, the weight, the
targets and one float32 per token. The backward recomputes each tile's logits once and turns
them into the gradient tile ``softmax - onehot``. So a step computes the logits twice and holds
one tile of them at a time; FairScale's MEVO computes them in separate max, sum and target passes
and recomputes the max and sum passes in backward, about twice the matrix products. The loss is
``logsumexp(logits) - logits[target]`` per token, which stays finite where FairScale's
``log(exp(target - max) / sum)`` underflows to ``-log(0)``. Reductions run in float32 (float64
for float64 inputs). Under torch.autocast the backward recomputes the logits in the forward's
autocast state, so both passes see the same logits.

LMCL (``scale`` given): logits are ``scale * (cos(x, w) - margin * onehot(target))``, as in
FairScale (CosFace). FairScale places the margin of a vocabulary tile at columns counted from
``tile index * this tile's rows``, which is wrong for a shorter last tile; here the margin is at
the target's own column whatever the tiling.

The weight's gradient goes through autograd (FairScale's MEVO writes ``proj_weight.grad``
itself), so it accumulates like any other and reaches tied weights and flattened parameters. The
``trigger`` parameter FairScale's MEVO registers is kept (its state dicts have the key) and, as
there, gets a zero gradient.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from ...utils.replay import autocast, autocast_state
from ...internal.args import as_int

__all__ = [
    "MemoryEfficientVocabOutput",
    "BaselineSoftmax",
    "BaselineSoftmaxNllLoss",
    "BackwardTrigger",
    "BackwardTriggerFn",
    "get_data",
    "lmcl_matmul",
]


def _next_power_of_2_or_max(n: int, max_n: int) -> int:
    """The smallest power of 2 >= n (1 for n == 0), at most max_n."""
    p = 1 if n <= 1 else 1 << (n - 1).bit_length()
    return min(p, max_n)


def _reshape_inputs(input: torch.Tensor, target: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """(batch, seq, d) inputs and (batch, seq) targets as (tokens, d) and (tokens,)."""
    if input.dim() == 3:
        input = input.reshape(-1, input.shape[2])
    if target.dim() == 2:
        target = target.reshape(-1)
    return input, target


def get_data(
    shape: Tuple[Tuple[int, int], Tuple[int, int]], dtype: torch.dtype = torch.float16, device: str = "cuda"
) -> Tuple[torch.Tensor, nn.Parameter, torch.Tensor]:
    """FairScale's test helper: ``((tokens, d), (d, vocab))`` gives a random input (requiring
    grad), the weight of a bias-free Linear(d, vocab) and random targets."""
    (tokens, d1), (d2, vocabs) = shape
    if d1 != d2:
        raise ValueError(f"get_data: argument 'shape' has input width {d1} and weight width {d2}; expected equal")
    input = torch.rand(tokens, d1, device=device, dtype=dtype).requires_grad_(True)
    weight = nn.Linear(d2, vocabs, bias=False).to(device=device, dtype=dtype).weight
    target = (torch.rand(tokens, device=device) * vocabs).long()
    return input, weight, target


def _lmcl_logits(i: torch.Tensor, w: torch.Tensor, tgt: torch.Tensor, col0: int, margin: float, scale: float):
    """LMCL logits of input rows ``i`` against the weight rows ``w`` that start at vocabulary
    column ``col0``: ``scale * (cos(i, w) - margin at each row's target column)``."""
    logits = torch.matmul(F.normalize(i, dim=1), F.normalize(w, dim=1).T)
    cols = torch.arange(col0, col0 + w.shape[0], device=i.device)
    logits = logits - margin * (cols.unsqueeze(0) == tgt.reshape(-1, 1)).to(logits.dtype)
    return logits * scale


def lmcl_matmul(
    i: torch.Tensor, w: torch.Tensor, tgt: torch.Tensor, w_idx: int, margin: float, scale: Optional[float]
) -> torch.Tensor:
    """FairScale's helper: LMCL logits of ``i`` against weight tile ``w``, the ``w_idx``-th tile of
    ``w``'s size (so its first column is ``w_idx * len(w)``)."""
    return _lmcl_logits(i, w, tgt, w_idx * w.shape[0], margin, 1.0 if scale is None else scale)


def _tile_logits(x: torch.Tensor, w: torch.Tensor, tgt: torch.Tensor, col0: int, margin: float, scale: Optional[float]):
    """One tile of logits, in float32 (float64 for float64 inputs)."""
    logits = _lmcl_logits(x, w, tgt, col0, margin, scale) if scale is not None else torch.matmul(x, w.T)
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _targets_in(ti: torch.Tensor, c0: int, cols: int) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """The rows of a token tile whose target lies in vocabulary columns [c0, c0 + cols), and those
    targets counted from c0; None when no row's does."""
    local = ti - c0
    hit = (local >= 0) & (local < cols)
    if not bool(hit.any()):
        return None
    rows = hit.nonzero().squeeze(1)
    return rows, local[rows]


class _TiledSoftmaxNll(torch.autograd.Function):
    """Per-token ``logsumexp(logits) - logits[target]`` over tiles of tokens and of the vocabulary."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, target: torch.Tensor, x_split: int, w_split: int,
                margin: float, scale: Optional[float]) -> torch.Tensor:  # fmt: skip
        acc = torch.promote_types(x.dtype, torch.float32)
        lse = torch.empty(x.shape[0], dtype=acc, device=x.device)
        score = torch.empty_like(lse)
        with torch.no_grad():
            for r0 in range(0, x.shape[0], x_split):
                xi, ti = x[r0 : r0 + x_split], target[r0 : r0 + x_split]
                run_max: Optional[torch.Tensor] = None
                run_sum = torch.zeros(xi.shape[0], dtype=acc, device=x.device)
                tscore = torch.zeros_like(run_sum)
                for c0 in range(0, w.shape[0], w_split):
                    wj = w[c0 : c0 + w_split]
                    logits = _tile_logits(xi, wj, ti, c0, margin, scale)
                    tile_max = logits.amax(dim=1)
                    new_max = tile_max if run_max is None else torch.maximum(run_max, tile_max)
                    if run_max is not None:
                        run_sum.mul_(torch.exp(run_max - new_max))
                    run_sum.add_(torch.exp(logits - new_max.unsqueeze(1)).sum(dim=1))
                    run_max = new_max
                    targets = _targets_in(ti, c0, wj.shape[0])
                    if targets is not None:
                        tscore[targets[0]] = logits[targets]
                assert run_max is not None
                lse[r0 : r0 + x_split] = run_max + torch.log(run_sum)
                score[r0 : r0 + x_split] = tscore
        ctx.save_for_backward(x, w, target, lse)
        ctx.splits, ctx.lmcl = (x_split, w_split), (margin, scale)
        ctx.autocast = autocast_state()
        return lse - score

    @staticmethod
    def backward(ctx: Any, grad_nll: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        x, w, target, lse = ctx.saved_tensors
        x_split, w_split = ctx.splits
        margin, scale = ctx.lmcl
        need_x, need_w = ctx.needs_input_grad[:2]
        acc = lse.dtype
        grad_x = torch.zeros(x.shape, dtype=acc, device=x.device) if need_x else None
        grad_w = torch.zeros(w.shape, dtype=acc, device=w.device) if need_w else None
        grad_nll = grad_nll.to(acc)
        for r0 in range(0, x.shape[0], x_split):
            xi = x[r0 : r0 + x_split].detach().requires_grad_(need_x)
            ti, gi = target[r0 : r0 + x_split], grad_nll[r0 : r0 + x_split]
            lse_i = lse[r0 : r0 + x_split].unsqueeze(1)
            for c0 in range(0, w.shape[0], w_split):
                wj = w[c0 : c0 + w_split].detach().requires_grad_(need_w)
                with torch.enable_grad(), autocast(ctx.autocast):  # the forward's autocast state
                    logits = _tile_logits(xi, wj, ti, c0, margin, scale)
                # d nll / d logits = softmax - onehot(target), times the token's incoming gradient
                g = torch.exp(logits.detach() - lse_i)
                targets = _targets_in(ti, c0, wj.shape[0])
                if targets is not None:
                    g[targets] -= 1.0
                g.mul_(gi.unsqueeze(1))
                inputs = [t for t, need in ((xi, need_x), (wj, need_w)) if need]
                grads = torch.autograd.grad(logits, inputs, g)
                if need_w:
                    grad_w[c0 : c0 + w_split] += grads[-1]
                if need_x:
                    grad_x[r0 : r0 + x_split] += grads[0]
        return (
            None if grad_x is None else grad_x.to(x.dtype),
            None if grad_w is None else grad_w.to(w.dtype),
            None,
            None,
            None,
            None,
            None,
        )


class BackwardTriggerFn(torch.autograd.Function):
    """Returns the weight; in backward passes the weight's gradient through and gives the trigger
    a zero gradient."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, trigger_tensor: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.trigger_shape, ctx.trigger_dtype = trigger_tensor.shape, trigger_tensor.dtype
        return w.view_as(w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return grad, torch.zeros(ctx.trigger_shape, dtype=ctx.trigger_dtype, device=grad.device)


class BackwardTrigger(nn.Module):
    """FairScale's trigger module: holds a one-element ``trigger`` parameter linked to a weight;
    calling it returns the weight (or the one given) with the trigger in its autograd graph."""

    def __init__(self, linked_param: torch.Tensor):
        super().__init__()
        if not isinstance(linked_param, nn.Parameter):
            raise TypeError(
                f"BackwardTrigger: argument 'linked_param' must be an nn.Parameter, got {type(linked_param).__name__}"
            )
        self.trigger = nn.Parameter(torch.rand(1, dtype=linked_param.dtype, device=linked_param.device))
        self.trigger._linked_param = linked_param

    def forward(self, weight: Optional[torch.Tensor] = None) -> torch.Tensor:  # type: ignore[override]
        return BackwardTriggerFn.apply(self.trigger._linked_param if weight is None else weight, self.trigger)


class MemoryEfficientVocabOutput(nn.Module):
    """``MEVO(proj_weight, tile_factor=16, reduction="sum", margin=0.35, scale=None)``: in training
    (or given a target), ``forward(input, target)`` returns the summed (or mean) cross-entropy of
    ``input @ proj_weight.T`` against ``target``; in eval mode without a target, the logits.
    ``input`` is (tokens, d) or (batch, seq, d), ``target`` (tokens,) or (batch, seq).
    ``tile_factor`` splits the tokens and the vocabulary into about that many tiles each (powers
    of two, as FairScale rounds them)."""

    def __init__(
        self,
        proj_weight: nn.Parameter,
        tile_factor: int = 16,
        reduction: str = "sum",
        margin: float = 0.35,
        scale: Optional[float] = None,
    ):
        super().__init__()
        if not isinstance(proj_weight, nn.Parameter) or proj_weight.dim() != 2:
            raise TypeError("MEVO: argument 'proj_weight' must be a 2-D nn.Parameter (vocabulary x d_model)")
        if as_int(tile_factor) is None or tile_factor < 1:
            raise ValueError(f"MEVO: argument 'tile_factor' must be an int >= 1, got {tile_factor!r}")
        tile_factor = as_int(tile_factor)
        if reduction not in ("sum", "mean"):
            raise ValueError(f"MEVO: argument 'reduction' must be 'sum' or 'mean', got {reduction!r}")
        self.proj_weight = proj_weight
        self.tf_in, self.tf_w = tile_factor, tile_factor
        self.fp_max = self.fp_sum = self.fp_target = True  # FairScale's flags: float32 reductions (always here)
        self.log_softmax = True
        self.reduction = reduction
        self.margin = margin
        self.scale = scale
        self.trigger = BackwardTrigger(self.proj_weight)

    def eval_forward(self, input: torch.Tensor) -> torch.Tensor:
        """The logits, unfused (LMCL's normalisation and margin do not apply at eval time)."""
        return torch.matmul(input, self.proj_weight.T)

    def forward(self, input: torch.Tensor, target: Optional[torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        if not self.training and target is None:
            return self.eval_forward(input)
        if not isinstance(input, torch.Tensor) or not isinstance(target, torch.Tensor):
            raise TypeError("MEVO: arguments 'input' and 'target' must be tensors in training")
        input, target = _reshape_inputs(input, target)
        tokens, d_model = input.shape
        vocab, d2 = self.proj_weight.shape
        if d_model != d2:
            raise ValueError(f"MEVO: argument 'input' has width {d_model}; proj_weight has {d2}")
        if target.shape != (tokens,):
            raise ValueError(f"MEVO: argument 'target' has shape {tuple(target.shape)}; expected ({tokens},)")
        if target.dtype != torch.long:
            raise TypeError(f"MEVO: argument 'target' must be int64 class indices, got {target.dtype}")
        if tokens and bool(((target < 0) | (target >= vocab)).any()):
            raise ValueError(f"MEVO: argument 'target' holds indices outside [0, {vocab})")
        x_split = _next_power_of_2_or_max(tokens // self.tf_in, max(tokens, 1))
        w_split = _next_power_of_2_or_max(vocab // self.tf_w, vocab)
        weight = self.trigger(self.proj_weight)
        nll = _TiledSoftmaxNll.apply(input, weight, target, x_split, w_split, self.margin, self.scale)
        loss = nll.sum()
        return loss / tokens if self.reduction == "mean" else loss


MEVO = MemoryEfficientVocabOutput


class BaselineSoftmax(nn.Module):
    """FairScale's unfused reference: the projection (or LMCL's logits) then a float32
    (log-)softmax over the whole vocabulary. Any device (FairScale's asserts CUDA)."""

    def __init__(
        self,
        proj_weight: nn.Parameter,
        tile_factor: int = 0,
        log_softmax: bool = True,
        margin: float = 0.35,
        scale: Optional[float] = None,
    ):
        super().__init__()
        out_dim, in_dim = proj_weight.shape
        self.fc = nn.Linear(in_dim, out_dim, bias=False, device=proj_weight.device, dtype=proj_weight.dtype)
        self.fc.weight = proj_weight
        self.fp16 = proj_weight.dtype == torch.float16
        self.log_softmax = log_softmax
        self.margin = margin
        self.scale = scale

    def lmcl_pre_softmax(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return _lmcl_logits(input, self.fc.weight, target, 0, self.margin, self.scale)

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        input, target = _reshape_inputs(input, target)
        x = self.lmcl_pre_softmax(input, target) if self.scale is not None else self.fc(input)
        if self.log_softmax:
            return F.log_softmax(x, dim=-1, dtype=torch.float32)
        return F.softmax(x, dim=-1, dtype=torch.float32)


class BaselineSoftmaxNllLoss(BaselineSoftmax):
    """BaselineSoftmax followed by the summed NLL loss: what MEVO computes, unfused."""

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        input, target = _reshape_inputs(input, target)
        return F.nll_loss(super().forward(input, target), target, reduction="sum")
