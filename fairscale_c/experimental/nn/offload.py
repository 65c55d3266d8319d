"""OffloadModel: train an nn.Sequential whose parameters live on an offload device (the host) and
visit the compute device one slice at a time, as fairscale.experimental.nn.OffloadModel
(docs/experimental.md).

The model is cut into ``num_slices`` consecutive slices of about equal parameter counts
(FairScale's rule). Each slice's parameters and buffers have a home on ``offload_device`` (pinned
host memory when the compute device is CUDA); the slice is loaded onto ``device`` just before it
runs and copied home right after, in forward and again in backward, so the device holds one or two
slices' weights at a time. Gradients come home with their slice, so the optimizer steps the
parameters where they live. The activation passed from one slice to the next is copied at each
boundary, so a slice may start with an in-place op (FairScale's refuses that).

- ``checkpoint_activation=False``: the slices run with autograd; a boundary function between two
  slices swaps them in forward and in backward. Autograd keeps the activations on the device.
- ``checkpoint_activation=True``: the forward runs without autograd and keeps only each slice's
  input, on the offload device; the backward recomputes each slice from it (with the random
  state and the autocast state its forward had, so dropout masks and precisions repeat) and
  ``num_microbatches`` splits each slice's batch into that many pieces per visit.

Differences from FairScale's class: it runs where the compute device is the CPU too (FairScale's
refuses without CUDA; there, with ``device`` and ``offload_device`` the same, nothing moves); the
copies home are ordered after the compute that produced them (FairScale's run on side streams
with nothing ordering them); each slice's recomputation restores the random state of that slice's
own forward (FairScale's restores the state of the first slice for every slice, so dropout masks
after the first slice differ from the forward's); bad arguments raise naming them.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import nn

from ...utils.replay import autocast, autocast_state, capture_rng, restore_rng
from ...internal.args import as_int

__all__ = ["OffloadModel", "ModelShard"]

_HOST = torch.device("cpu")


def _split(modules: Sequence[nn.Module], number_splits: int) -> List[List[nn.Module]]:
    """FairScale's split into min(len(modules), number_splits) consecutive groups: a new one is
    started when the current one holds parameters and the next module would take it past
    total / number_splits."""
    number_splits = min(len(modules), number_splits)
    splits: List[List[nn.Module]] = [[] for _ in range(number_splits)]
    count = [sum(p.numel() for p in m.parameters()) for m in modules]
    per_shard = sum(count) // number_splits
    current, held = 0, 0
    for m, n in zip(modules, count):
        if held > 0 and held + n > per_shard and current < number_splits - 1:
            current, held = current + 1, 0
        splits[current].append(m)
        held += n
    return splits  # as FairScale's: the last ones may be empty (identity slices)


class ModelShard(nn.Module):
    """One slice: its tensors' homes on the offload device, and the moves to and from ``device``."""

    def __init__(self, cpu_model_shard: nn.Module, device: torch.device, offload_device: torch.device, index: int):
        super().__init__()
        self.model_shard = cpu_model_shard
        self.index = index
        self.device, self.offload_device = torch.device(device), torch.device(offload_device)
        self._moves = self.device != self.offload_device
        pin = self._moves and self.device.type == "cuda" and self.offload_device.type == "cpu"
        self._homes: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (tensor whose .data moves, its home)
        with torch.no_grad():
            for t in list(self.model_shard.parameters()) + list(self.model_shard.buffers()):
                home = t.data.to(self.offload_device)
                if pin:
                    home = home.pin_memory()
                t.data = home
                self._homes.append((t, home))

    def forward(self, *inputs: Any) -> Any:  # type: ignore[override]
        return self.model_shard(*inputs)

    @torch.no_grad()
    def load(self, non_blocking: bool = True) -> None:
        """Copies the slice's parameters, buffers and gradients onto ``device`` (from pinned
        memory without blocking the host, unless ``non_blocking`` is False)."""
        if not self._moves:
            return
        for t, home in self._homes:
            if t.data.device != self.device:
                t.data = home.to(self.device, non_blocking=non_blocking)
            if isinstance(t, nn.Parameter) and t.grad is not None and t.grad.device != self.device:
                t.grad = t.grad.to(self.device, non_blocking=non_blocking)

    @torch.no_grad()
    def drop(self, non_blocking: bool = True) -> None:
        """Copies them home (after the work that produced them) and frees the device's copies.
        ``non_blocking`` is accepted for FairScale's signature: the copies home always complete
        before this returns, so the host copies can be read at once."""
        if not self._moves:
            return
        for t, home in self._homes:
            if t.data.device != home.device:
                home.copy_(t.data)
                t.data = home
            if isinstance(t, nn.Parameter) and t.grad is not None and t.grad.device != home.device:
                t.grad = t.grad.to(home.device)

    # FairScale's names for the same moves
    forward_load = backward_load = to_device = load
    forward_drop = backward_drop = drop


def _to(device: torch.device, values: Tuple[Any, ...]) -> Tuple[Any, ...]:
    return tuple(v.to(device) if isinstance(v, torch.Tensor) else v for v in values)


class _Boundary(torch.autograd.Function):
    """Between slice ``index`` and ``index + 1`` (index -1: before the first): in forward, sends
    slice ``index`` home and loads the next; in backward, the reverse. ``anchor`` (an empty tensor
    that requires grad) puts the function in the graph even when the model's input needs no
    gradient, so the first slice goes home at the end of backward too."""

    @staticmethod
    def forward(ctx: Any, index: int, slices: List[ModelShard], anchor: torch.Tensor, *inputs: Any) -> Any:  # type: ignore[override]
        ctx.index, ctx.slices = index, slices
        if index >= 0:
            slices[index].drop()
        if index + 1 < len(slices):
            slices[index + 1].load()
        ctx.mark_non_differentiable(*[t for t in inputs if isinstance(t, torch.Tensor) and not t.is_floating_point()])
        # copies, not the inputs themselves: a slice that starts with an in-place op (ReLU(inplace=True))
        # may not modify what a custom function returned as-is
        return tuple(t.clone() if isinstance(t, torch.Tensor) and t.is_floating_point() else t for t in inputs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        index, slices = ctx.index, ctx.slices
        if index + 1 < len(slices):
            slices[index + 1].drop()
        if index >= 0:
            slices[index].load()
        return (None, None, None) + grads


class _Checkpointed(torch.autograd.Function):
    """The whole model without autograd in forward, keeping each slice's input on the offload
    device; backward recomputes slice by slice, last first."""

    @staticmethod
    def forward(ctx: Any, model: "OffloadModel", anchor: torch.Tensor, *inputs: Any) -> Any:  # type: ignore[override]
        ctx.model = model
        ctx.needs = [isinstance(t, torch.Tensor) and t.requires_grad for t in inputs]
        saved, rng = [], []
        values = _to(model.device, inputs)
        with torch.no_grad():
            for shard in model.model_slices:
                # a copy even where the devices are the same: the slice may modify its input in place
                saved.append(
                    tuple(v.to(model.offload_device, copy=True) if isinstance(v, torch.Tensor) else v for v in values)
                )
                shard.load()
                rng.append(capture_rng(model.device))
                values = model._run_slice(shard, values)
                shard.drop()
        ctx.saved, ctx.rng = saved, rng
        ctx.autocast = autocast_state()
        return values[0] if len(values) == 1 else values

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        model = ctx.model
        grads = tuple(g.to(model.device) if isinstance(g, torch.Tensor) else g for g in grads)
        outer = capture_rng(model.device)
        for shard, saved, rng in zip(reversed(model.model_slices), reversed(ctx.saved), reversed(ctx.rng)):
            shard.load()
            values = tuple(
                v.to(model.device).detach().requires_grad_(v.is_floating_point()) if isinstance(v, torch.Tensor) else v
                for v in saved
            )  # each micro-batch below becomes a leaf of its own, whose .grad is the input gradient
            restore_rng(rng, model.device)
            in_grads: List[List[torch.Tensor]] = [[] for _ in values]
            for chunk, chunk_grads in model._chunks(values, grads):
                chunk = tuple(
                    c.detach().requires_grad_(c.requires_grad) if isinstance(c, torch.Tensor) else c for c in chunk
                )
                # the forward's autocast state; the slice gets copies: it may modify its input in place
                with torch.enable_grad(), autocast(ctx.autocast):
                    outs = shard(*(c.clone() if isinstance(c, torch.Tensor) and c.requires_grad else c for c in chunk))
                outs = outs if isinstance(outs, tuple) else (outs,)
                pairs = [(o, g) for o, g in zip(outs, chunk_grads) if o.requires_grad and g is not None]
                if pairs:
                    torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
                for k, c in enumerate(chunk):
                    if isinstance(c, torch.Tensor) and c.requires_grad:
                        in_grads[k].append(c.grad if c.grad is not None else torch.zeros_like(c))
            grads = tuple(torch.cat(g) if g else None for g in in_grads)
            shard.drop()
        restore_rng(outer, model.device)
        return (None, None) + tuple(g if need else None for g, need in zip(grads, ctx.needs))


class OffloadModel(nn.Module):
    """``OffloadModel(model, device, offload_device=torch.device("cpu"), num_slices=3,
    checkpoint_activation=False, num_microbatches=1)``: ``model`` an nn.Sequential (cut into
    slices here) or a list of modules (each a slice already, e.g. from ``shard_model``). Inputs go
    to ``device``; the output is on ``device``."""

    def __init__(
        self,
        model: Any,
        device: torch.device,
        offload_device: torch.device = _HOST,
        num_slices: int = 3,
        checkpoint_activation: bool = False,
        num_microbatches: int = 1,
    ):
        super().__init__()
        if not (isinstance(model, nn.Sequential) or type(model) is list):
            raise TypeError(
                "OffloadModel: argument 'model' must be an nn.Sequential or a list of modules, "
                f"got {type(model).__name__}"
            )
        if len(model) == 0 or not all(isinstance(m, nn.Module) for m in model):
            raise TypeError("OffloadModel: argument 'model' must hold at least one nn.Module, and nothing else")
        if device is None:
            raise TypeError("OffloadModel: argument 'device' must be a torch.device, got None")
        for name, v in (("num_slices", num_slices), ("num_microbatches", num_microbatches)):
            if as_int(v) is None or v < 1:
                raise ValueError(f"OffloadModel: argument '{name}' must be an int >= 1, got {v!r}")
        num_slices, num_microbatches = as_int(num_slices), as_int(num_microbatches)
        if not checkpoint_activation and num_microbatches > 1:
            raise RuntimeError("We currently only support microbatches with activation checkpointing.")
        self.device, self.offload_device = torch.device(device), torch.device(offload_device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        splits = [[m] for m in model] if type(model) is list else _split(list(model), num_slices)
        self.model_slices: List[ModelShard] = [
            ModelShard(m[0] if type(model) is list else nn.Sequential(*m), self.device, self.offload_device, i)
            for i, m in enumerate(splits)
        ]
        self._model = nn.Sequential(*self.model_slices)
        self._checkpoint_activation = checkpoint_activation
        self._num_microbatches = num_microbatches

    def _chunks(self, values: Tuple[Any, ...], grads: Optional[Tuple[Any, ...]] = None) -> Any:
        """The micro-batches of ``values`` (and of ``grads``), split on dim 0."""
        n = self._num_microbatches
        split = [torch.chunk(v, n) if isinstance(v, torch.Tensor) else None for v in values]
        count = min((len(s) for s in split if s is not None), default=1)
        gsplit = None if grads is None else [torch.chunk(g, count) if g is not None else None for g in grads]
        for k in range(count):
            chunk = tuple(s[k] if s is not None else v for s, v in zip(split, values))
            yield chunk, (None if gsplit is None else tuple(s[k] if s is not None else None for s in gsplit))

    def _run_slice(self, shard: ModelShard, values: Tuple[Any, ...]) -> Tuple[Any, ...]:
        outs = [shard(*chunk) for chunk, _ in self._chunks(values)]
        if isinstance(outs[0], tuple):
            return tuple(torch.cat(parts) for parts in zip(*outs))
        return (torch.cat(outs),)

    def forward(self, *inputs: Any, **_: Any) -> Any:  # type: ignore[override]
        anchor = torch.empty(0, device=self.device, requires_grad=torch.is_grad_enabled())
        if self._checkpoint_activation:
            return _Checkpointed.apply(self, anchor, *inputs)
        values = _to(self.device, inputs)
        for index in range(-1, len(self.model_slices)):
            if index >= 0:
                out = self.model_slices[index](*values)
                values = out if isinstance(out, tuple) else (out,)
            values = _Boundary.apply(index, self.model_slices, anchor, *values)
        return values[0] if len(values) == 1 else values
