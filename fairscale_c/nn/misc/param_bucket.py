"""ParamBucket and GradBucket with FairScale 0.4.13's API: one flat buffer whose slices are the
data (ParamBucket) or the gradients (GradBucket) of the tensors checked in, so that a single
collective or copy moves all of them.

::

    bucket = GradBucket(size=2**20, dtype=torch.float32, device=device, destination=0)
    for p in small_params:
        if bucket.can_add_grad_view(p):
            bucket.add_grad(p)          # p.grad is now a view of bucket.buffer
    dist.reduce(bucket.buffer, dst=bucket.destination)

ShardedDataParallel and OSS here bucket in their own way; these classes are for code written
against FairScale's. Misuse that FairScale asserts on (a full bucket, a tensor checked in twice,
a dtype or device that differs from the buffer's) raises AssertionError here too, with a message
naming the argument and what was expected.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, List, Optional, Union

import torch
from torch import Tensor

__all__ = ["Bucket", "ParamBucket", "GradBucket"]


def _require(ok: bool, message: str) -> None:
    # FairScale asserts on these; code written against it may catch AssertionError. Raised
    # explicitly so that they hold under `python -O` too.
    if not ok:
        raise AssertionError(message)


class Bucket:
    """A flat buffer of `size` elements of `dtype` on `device`, and the tensors that live in it."""

    def __init__(self, size: int, dtype: torch.dtype, device: Union[str, int, torch.device]) -> None:
        try:
            numel = -1 if isinstance(size, bool) else operator.index(size)
        except TypeError:
            numel = -1
        if numel < 0:
            raise ValueError(f"{type(self).__name__}: argument 'size' must be an int >= 0, got {size!r}")
        self._params: List[Tensor] = []
        self._param_ids: List[int] = []
        self._fill = 0
        self.buffer: Tensor = torch.zeros(numel, dtype=dtype, device=device)

    def to(
        self,
        device: Optional[Union[int, str, torch.device]],
        dtype: Optional[torch.dtype] = None,
        non_blocking: bool = False,
        keep_param_alignment: bool = True,
    ) -> None:
        """Move (and/or cast) the buffer. The subclasses then point their tensors at it again."""
        _require(self.buffer is not None, f"{type(self).__name__}.to: the bucket has no buffer")
        self.buffer = self.buffer.to(device, dtype, non_blocking)

    def _next_slice(self, tensor: Tensor, what: str, argname: str) -> slice:
        """The buffer slice `tensor` occupies if checked in now, after checking it fits."""
        name = type(self).__name__
        _require(
            tensor.dtype == self.buffer.dtype,
            f"{name}.{what}: argument '{argname}' has dtype {tensor.dtype}, the bucket holds {self.buffer.dtype}",
        )
        _require(
            tensor.device == self.buffer.device,
            f"{name}.{what}: argument '{argname}' is on {tensor.device}, the bucket on {self.buffer.device}",
        )
        end = self._fill + tensor.numel()
        _require(
            end <= self.buffer.numel(),
            f"{name}.{what}: argument '{argname}' has {tensor.numel()} elements, the bucket has room for "
            f"{self.buffer.numel() - self._fill} of its {self.buffer.numel()}",
        )
        return slice(self._fill, end)

    def _check_new(self, tensor: Tensor, what: str, argname: str) -> None:
        if not isinstance(tensor, Tensor):
            raise TypeError(
                f"{type(self).__name__}.{what}: argument '{argname}' must be a Tensor, got {type(tensor).__name__}"
            )
        _require(
            id(tensor) not in self._param_ids,
            f"{type(self).__name__}.{what}: argument '{argname}' is already in this bucket",
        )

    def _register(self, tensor: Tensor) -> None:
        self._params.append(tensor)
        self._param_ids.append(id(tensor))


class ParamBucket(Bucket):
    """A bucket of parameters: each one checked in keeps its value, and its `.data` becomes a
    view of the buffer."""

    def __init__(self, size: int, dtype: torch.dtype, device: Union[str, int, torch.device]) -> None:
        super().__init__(size, dtype, device)

    def to(
        self,
        device: Optional[Union[int, str, torch.device]],
        dtype: Optional[torch.dtype] = None,
        non_blocking: bool = False,
        keep_param_alignment: bool = True,
    ) -> None:
        """Move (and/or cast) the buffer; with `keep_param_alignment`, the parameters become views
        of the moved buffer again (cast to its dtype), keeping their values."""
        super().to(device, dtype, non_blocking)
        if keep_param_alignment:
            self._reattach_params()

    @torch.no_grad()
    def add_param(self, param: Tensor) -> None:
        """Check `param` in: its value is copied into the next free slice of the buffer and its
        `.data` becomes a view of that slice."""
        self._check_new(param, "add_param", "param")
        self._add_param_as_view(param)
        self._register(param)

    @torch.no_grad()
    def _add_param_as_view(self, param: Tensor, keep_existing_value: bool = True) -> None:
        part = self._next_slice(param, "add_param", "param")
        view = self.buffer[part]
        if keep_existing_value:
            view.copy_(param.data.reshape(-1))
        param.data = view.view_as(param.data)
        self._fill = part.stop

    @torch.no_grad()
    def _reattach_params(self) -> None:
        _require(len(self._params) > 0, "ParamBucket: no parameter has been checked in")
        self._fill = 0
        for p in self._params:
            if p.dtype != self.buffer.dtype:
                p.data = p.data.to(self.buffer.dtype)
            self._add_param_as_view(p, keep_existing_value=False)


class GradBucket(Bucket):
    """A bucket of gradients bound for rank `destination`: each parameter checked in keeps its
    gradient (zeros if it had none), and its `.grad` becomes a view of the buffer.

    `params_checked_in`, `sent` and `callback` are the caller's bookkeeping, as in FairScale:
    count gradients as they become ready, and send the bucket when `all_checked_in`."""

    def __init__(self, size: int, dtype: torch.dtype, device: Union[str, int, torch.device], destination: int) -> None:
        super().__init__(size, dtype, device)
        self._max_size = self.buffer.numel()
        self._is_collapsed = False
        self.params_checked_in = 0
        self.destination = destination
        self.sent = True
        self.callback: Optional[Callable[[Any], None]] = None

    def reset_checked_in(self) -> None:
        """Start counting check-ins again, and mark the bucket as not sent."""
        self.params_checked_in = 0
        self.sent = False

    @property
    def all_checked_in(self) -> bool:
        """Whether every gradient of the bucket has been checked in since the last reset."""
        return len(self._params) == self.params_checked_in

    def can_add_grad_view(self, param: Tensor) -> bool:
        """Whether `param` is not in the bucket yet and its gradient fits with room to spare. As in
        FairScale the comparison is strict: a gradient that would fill the bucket exactly is refused
        here (add_grad itself accepts it)."""
        return self._fill + param.numel() < self._max_size and id(param) not in self._param_ids

    def to(
        self,
        device: Optional[Union[int, str, torch.device]],
        dtype: Optional[torch.dtype] = None,
        non_blocking: bool = False,
        keep_param_alignment: bool = True,
    ) -> None:
        """Move (and/or cast) the buffer, rebuilding a collapsed bucket first; with
        `keep_param_alignment`, the gradients become views of the moved buffer again."""
        if self._is_collapsed:
            self.rebuild()
        super().to(device, dtype, non_blocking)
        if keep_param_alignment:
            self._reattach_grads()

    def zero(self) -> None:
        """Set every gradient of the bucket to zero."""
        self.buffer.fill_(0.0)

    @torch.no_grad()
    def add_grad(self, param: Tensor) -> None:
        """Check `param`'s gradient in: it is copied into the next free slice of the buffer (zeros
        when `param.grad` is None) and `param.grad` becomes a view of that slice."""
        self._check_new(param, "add_grad", "param")
        _require(not self._is_collapsed, "GradBucket.add_grad: the bucket is collapsed; call rebuild() first")
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        self._add_grad_as_view(param)
        self._register(param)

    @torch.no_grad()
    def collapse(self) -> None:
        """Free the buffer: every gradient of the bucket becomes None. `rebuild()` (or `to()`)
        allocates it again, zeroed."""
        if self._is_collapsed:
            return
        for p in self._params:
            if p.grad is not None:
                p.grad.detach_()
                p.grad = None
        self.buffer = torch.zeros(0, dtype=self.buffer.dtype, device=self.buffer.device)
        self._fill = 0
        self.params_checked_in = 0
        self._is_collapsed = True

    @torch.no_grad()
    def rebuild(self) -> None:
        """Allocate a collapsed bucket's buffer again (zeros) and make the gradients views of it."""
        _require(len(self._params) > 0, "GradBucket.rebuild: no gradient has been checked in")
        if not self._is_collapsed:
            return
        first = self._params[0]
        self.buffer = torch.zeros(self._max_size, dtype=first.dtype, device=first.device)
        for p in self._params:
            self._add_grad_as_view(p)
        self._is_collapsed = False

    @torch.no_grad()
    def shrink(self) -> None:
        """Reallocate the buffer at the size of the gradients checked in, keeping their values, and
        make that the bucket's size."""
        _require(not self._is_collapsed, "GradBucket.shrink: the bucket is collapsed; call rebuild() first")
        self.buffer = self.buffer[: self._fill].clone()
        self._fill = 0
        for p in self._params:
            self._add_grad_as_view(p)
        self._max_size = self._fill

    @torch.no_grad()
    def _reattach_grads(self) -> None:
        _require(len(self._params) > 0, "GradBucket: no gradient has been checked in")
        self._fill = 0
        for p in self._params:
            self._add_grad_as_view(p, keep_existing_value=False)

    @torch.no_grad()
    def _add_grad_as_view(self, param: Tensor, keep_existing_value: bool = True) -> None:
        part = self._next_slice(param, "add_grad", "param")
        view = self.buffer[part].view_as(param.data)
        if param.grad is not None:
            if keep_existing_value:
                view.copy_(param.grad.data)
            param.grad.data = view
        else:
            param.grad = view
        self._fill = part.stop
