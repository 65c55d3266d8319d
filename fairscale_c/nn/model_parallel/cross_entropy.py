"""Cross-entropy over logits whose vocabulary dimension is split over the model-parallel ranks
(fairscale.nn.model_parallel.cross_entropy): the full logits are never gathered; three
all-reduces over the model-parallel group (the max, the target's logit, the sum of
exponentials) give every rank the per-token loss."""

from __future__ import annotations

from typing import Any, Tuple

import torch

from ... import distributed as fdist
from .initialize import get_model_parallel_group, get_model_parallel_rank, get_model_parallel_world_size
from .utils import VocabUtility, check_ids_in_range

__all__ = ["vocab_parallel_cross_entropy"]


def _all_reduce(t: torch.Tensor, op: str) -> None:
    group = fdist.group_for(get_model_parallel_group())
    if group.size > 1:
        group.all_reduce(t, op=op)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        part = logits.shape[-1]
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(
            part, get_model_parallel_rank(), get_model_parallel_world_size()
        )
        # every model-parallel rank has the same targets: all raise, before anything is sent
        check_ids_in_range(target, part * get_model_parallel_world_size(), "vocab_parallel_cross_entropy: target")
        logits_max = logits.detach().max(dim=-1)[0].contiguous()
        _all_reduce(logits_max, "max")
        # Shifted by the global max (the caller's logits are left as they are; FairScale shifts
        # them in place).
        shifted = logits.detach() - logits_max.unsqueeze(-1)

        outside = (target < start) | (target >= end)
        local_target = (target - start).masked_fill(outside, 0).reshape(-1)
        rows = torch.arange(local_target.numel(), device=logits.device)
        predicted = shifted.reshape(-1, part)[rows, local_target].reshape(target.shape)
        predicted = predicted.masked_fill(outside, 0.0).contiguous()
        _all_reduce(predicted, "sum")

        exp = shifted.exp_()
        sum_exp = exp.sum(dim=-1).contiguous()
        _all_reduce(sum_exp, "sum")
        loss = torch.log(sum_exp) - predicted

        exp.div_(sum_exp.unsqueeze(-1))  # the softmax over the whole vocabulary, this rank's part
        ctx.save_for_backward(exp, outside, local_target)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Tuple[torch.Tensor, None]:  # type: ignore[override]
        softmax, outside, local_target = ctx.saved_tensors
        part = softmax.shape[-1]
        grad = softmax.clone()
        grad_2d = grad.view(-1, part)
        rows = torch.arange(grad_2d.shape[0], device=grad.device)
        grad_2d[rows, local_target] -= 1.0 - outside.reshape(-1).to(grad.dtype)
        grad.mul_(grad_output.unsqueeze(-1))
        return grad, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-token loss (the shape of `target`) of logits (..., vocabulary / model-parallel size) whose
    last dimension is this rank's slice of the vocabulary, against global vocabulary ids."""
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target)
