"""FSDP's full parameters: all-gathering the flat shards into the full buffers, pointing the
module's attributes at views of them, and releasing them (a mixin of FullyShardedDataParallel,
whose instance attributes it uses)."""

from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from fairscale_c.distributed import local_copy as _copy  # copies/casts that keep autograd's version counters

from ._handle import Gathering, alloc_storage, free_storage

_any_instance = False  # set by the first FSDP instance: until then a step costs nothing here


def note_instance() -> None:
    global _any_instance
    _any_instance = True


def _count_step(optimizer: Any, *unused: Any) -> None:
    """After an optimizer step: count it on each FSDP shard it holds (``_fsc_steps``)."""
    if not _any_instance:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if getattr(p, "_fsc_fsdp_managed", False):
                p._fsc_steps = getattr(p, "_fsc_steps", 0) + 1


# Full parameters an instance keeps between forwards (the root's; reshard_after_forward=False)
# that were gathered before a step of their shards are gathered again at the next forward. Every
# rank steps a flat parameter's shards alike, so every rank gathers it again alike (an optimizer
# of other parameters, stepped on some ranks only, does not count).
register_optimizer_step_post_hook(_count_step)


class ReleasedParameter(torch.Tensor):
    """Stands, between steps, for a parameter whose values are in a released full buffer: it has
    the parameter's shape, dtype, device and requires_grad, and no data; any operation on it
    raises a RuntimeError saying where the values are."""

    @staticmethod
    def __new__(cls, shape: Any, dtype: torch.dtype, device: torch.device, requires_grad: bool) -> "ReleasedParameter":
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=requires_grad)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return f"ReleasedParameter(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.device})"

    @property
    def requires_grad(self) -> bool:  # type: ignore[override]
        return torch._C.TensorBase.requires_grad.__get__(self)

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        self.requires_grad_(value)

    def requires_grad_(self, requires_grad: bool = True) -> "ReleasedParameter":
        """Refused: the parameter is a part of a flat parameter, which trains or not as a whole
        (FairScale's view of the flat parameter refuses it too, as a non-leaf)."""
        raise RuntimeError(
            "requires_grad of a parameter that a FullyShardedDataParallel instance holds in a flat parameter "
            "cannot change after wrapping: set it before wrapping (frozen and trainable parameters get flat "
            "parameters of their own), change the whole instance with its requires_grad_(), or wrap with "
            "flatten_parameters=False"
        )

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise RuntimeError(
            f"{func}: a parameter held by a FullyShardedDataParallel instance has no values outside the instance's "
            "forward (its full buffer is released between steps); read it inside summon_full_params(), or call "
            "the module through the instance"
        )


class FullParams:
    """The full buffers' life cycle of one FSDP instance."""

    @torch.no_grad()
    def _start_gather(self, refresh: bool = False) -> None:
        """Start (asynchronously) the all-gather of every flat parameter that is not full yet, and
        with `refresh` (a forward's) of every one whose shard an optimizer has stepped since its
        gather. Not in backward: that reads what its forward computed with."""
        for h in self._all_handles:
            steps = getattr(h.param, "_fsc_steps", 0)
            if h.gathering is not None or (h.has_full and (not refresh or h.gathered_at == steps)):
                continue
            h.gathered_at = steps
            full = h.full.detach()
            alloc_storage(full)  # on the current stream, which the collective is ordered after
            shard = h.param.detach()
            if shard.dtype is not full.dtype or shard.device != full.device:
                # Cast straight into this rank's block of the full buffer and gather in place.
                n = h.layout.shard_numel
                mine = full[self.rank * n : (self.rank + 1) * n]
                _copy(mine, shard)
                shard = mine
            if self.all_gather_tracker is not None:
                self.all_gather_tracker.notify_all_gather(full, shard)
            h.gathering = Gathering(self.comm.all_gather(full, shard, async_op=True), shard)

    def _finish_gathers(self) -> None:
        """Wait for the all-gathers in flight into this instance's full buffers."""
        for h in self._all_handles:
            if h.gathering is not None:
                h.gathering.work.wait()
                h.gathering = None
                h.has_full = True

    @torch.no_grad()
    def _rebuild_full_params(self, refresh: bool = False) -> None:
        """All-gather every flat parameter that is not already full (C: cast + all-gather); with
        `refresh`, see _start_gather."""
        self._start_gather(refresh)
        self._finish_gathers()

    def _use_full_params(self) -> None:
        """Point the module's parameter attributes, shared ones included, at views of the full buffers."""
        self._point_at_full()
        for t in self._ties:
            t.module._parameters.pop(t.attr, None)  # the owner's shard; restored after forward
            t.module.__dict__[t.attr] = t.full_view()

    def _point_at_full(self) -> None:
        """Point the attributes of this instance's own parameters at views of the full buffers."""
        for h in self._handles:
            if not self.flatten_parameters:
                slot = h.layout.slots[0]
                view = h.full[: slot.numel].view(slot.shape)
                for module, attr in h.places():
                    module._parameters.pop(attr, None)  # the shard; restored after forward
                    module.__dict__[attr] = view
                continue
            # One split, not a slice per parameter: its backward assembles the flat gradient with
            # a single concatenation, where per-parameter slices would each materialise (and then
            # sum) a zero-filled gradient of the whole flat buffer.
            # The attributes are plain (their Parameters were removed), so the instance dict is
            # set directly: nn.Module.__setattr__'s checks cost more than the view itself.
            pieces = h.full.split(h.split_sizes)
            for slot, piece in zip(h.layout.slots, pieces):
                view = piece.view(slot.shape)
                slot.module.__dict__[slot.attr] = view
                for shared in h.layout.shared:
                    if shared.src is slot:
                        shared.module.__dict__[shared.attr] = view

    @torch.no_grad()
    def _leave_shaped_views(self) -> None:
        """Outside forward and backward, the original names of a flat parameter whose full buffer
        is released hold a ReleasedParameter of its shape, dtype, device and requires_grad: the
        module still reprs and introspects like the original (``weight.device``), and reading the
        values raises instead of reading released memory (which a view of the released buffer,
        as autograd keeps between forward and backward, would do). The next forward points them
        at the full buffer again."""
        if not self.flatten_parameters:
            return
        for h in self._handles:
            if h.has_full or h.gathering is not None:
                continue
            key = (h.full.dtype, h.full.device, h.param.requires_grad)
            if h.released_key != key:  # made once: this runs after every resharding forward
                h.released_key = key
                h.released = [ReleasedParameter(s.shape, *key) for s in h.layout.slots]
            for slot, released in zip(h.layout.slots, h.released):
                slot.module.__dict__[slot.attr] = released
                for shared in h.layout.shared:
                    if shared.src is slot:
                        shared.module.__dict__[shared.attr] = released

    def _shows_released(self) -> bool:
        """Whether the flat parameters' names hold ReleasedParameters (_leave_shaped_views)."""
        return any(
            isinstance(h.layout.slots[0].module.__dict__.get(h.layout.slots[0].attr), ReleasedParameter)
            for h in self._handles
            if h.layout.slots
        )

    def _use_shard_params(self) -> None:
        """Register the shards under the original names again: unflattened instances' own
        parameters, and the parameters shared with other instances."""
        for t in self._ties:
            t.module.__dict__.pop(t.attr, None)
            t.module._parameters[t.attr] = t.handle.param
        if not self.flatten_parameters:
            for h in self._handles:
                for module, attr in h.places():
                    module.__dict__.pop(attr, None)
                    module._parameters[attr] = h.param
        self._restore_param_order()

    def _register_shards_under_views(self) -> None:
        """Register the shards again (``parameters()`` shows them) while the attributes still read
        the full views (an instance dict entry comes before nn.Module's ``_parameters``): after a
        gradient taken inside the forward, whose graph, recomputed by activation checkpointing in
        the training backward, reads the attributes. The next _use_shard_params drops the views."""
        for t in self._ties:
            t.module._parameters[t.attr] = t.handle.param
        if not self.flatten_parameters:
            for h in self._handles:
                for module, attr in h.places():
                    module._parameters[attr] = h.param
        self._restore_param_order()

    def _restore_param_order(self) -> None:
        for module, order in self._param_orders:
            params = module._parameters
            if list(params) != order:
                ordered = {k: params[k] for k in order if k in params}
                ordered.update(params)
                params.clear()
                params.update(ordered)

    def _free_full_params(self, in_forward: bool = False, keep_memory: bool = False) -> None:
        """Release the full buffers. At the end of a forward (`in_forward`), a buffer another
        instance's running forward also uses (a shared parameter, the instances nested) stays.
        `keep_memory`: while a graph of gradients (a create_graph=True backward) reads them, they
        only count as released, so that the next use gathers them again (an optimizer step may
        have changed the shards meanwhile) into the same memory."""
        self._finish_gathers()  # a prefetch nobody used: finished before its buffer is freed
        for h in self._all_handles:
            if in_forward and h.forward_users > 1:
                continue
            if h.has_full:
                if not keep_memory:
                    free_storage(h.full.detach())
                h.has_full = False
