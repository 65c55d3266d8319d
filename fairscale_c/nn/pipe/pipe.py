"""Pipe: FairScale 0.4.13's GPipe module, in one process, over CPU and CUDA devices."""

from __future__ import annotations

import numbers
import operator
import sys
import weakref
from collections import OrderedDict
from typing import Any, Iterable, Iterator, List, Optional, Tuple, Union

import torch
from torch import nn

from . import microbatch
from .batchnorm import DeferredBatchNorm, begin_mini_batch
from .microbatch import TensorOrTensors
from .pipeline import Pipeline, PipeFunction
from .skip.layout import inspect_skip_layout
from .skip.skippable import verify_skippables

__all__ = ["Pipe", "BalanceError"]

Device = Union[torch.device, int, str]


class BalanceError(ValueError):
    pass


def _recommend_auto_balance(message: str) -> str:
    # Named as the caller imports it: under the fairscale alias, FairScale's name.
    compat = sys.modules.get("fairscale_c.compat")
    package = ("fairscale" if compat is not None and compat.is_installed() else "fairscale_c") + ".nn.pipe.balance"
    return (
        f"{message}\n\nTo find a balance automatically, profile the model with "
        f"{package}:\n\n"
        f"  from {package} import balance_by_time\n"
        "  balance = balance_by_time(partitions, model, sample, device='cpu')\n"
        "  model = Pipe(model, balance, devices=[...])\n"
    )


def _verify_module(module: nn.Sequential) -> None:
    if not isinstance(module, nn.Sequential):
        raise TypeError(f"module must be nn.Sequential to be partitioned, got {type(module).__name__}")
    if len(list(module.named_children())) != len(module):
        raise ValueError("module with duplicate children is not supported")


def _whole_number(value: Any) -> Optional[int]:
    """``value`` as an int when it is a whole number: an int or integer scalar (numpy's, a bool)
    or a float such as 2.0; else None."""
    try:
        return operator.index(value)
    except TypeError:
        return int(value) if isinstance(value, numbers.Real) and float(value).is_integer() else None


def _whole_numbers(balance: Iterable[Any]) -> List[int]:
    """``balance`` as ints. Like FairScale, any whole number counts: numpy integers (e.g. from
    np.array([1, 2])), bools, and floats such as 2.0. Another number is a BalanceError; a
    non-number a TypeError, the type FairScale's ``sum(balance)`` raises."""
    balance, out = list(balance), []
    for b in balance:
        n = _whole_number(b)
        if n is None and not isinstance(b, numbers.Number):
            raise TypeError(f"argument 'balance': expected a sequence of positive ints, got {b!r} in {balance}")
        if n is None:
            raise BalanceError(f"balance must be a list of positive integers (balance: {balance})")
        out.append(n)
    return out


def _chunks(value: Any) -> int:
    """``chunks`` as an int: a whole number, not a bool. Where FairScale's ``int(chunks)`` would
    truncate 2.5 or read "2" this raises, with FairScale's exception types (ValueError for a
    number or a string, TypeError for anything else)."""
    n = None if isinstance(value, bool) else _whole_number(value)
    if n is None:
        exc = ValueError if isinstance(value, (numbers.Real, str, bytes)) and not isinstance(value, bool) else TypeError
        raise exc(f"argument 'chunks': expected a positive int, got {value!r}")
    if n <= 0:
        raise ValueError(f"number of chunks must be positive integer, got {n}")
    return n


def _split_module(
    module: nn.Sequential, balance: Iterable[int], devices: List[torch.device]
) -> Tuple[nn.ModuleList, List[int], List[torch.device]]:
    balance = _whole_numbers(balance)
    if len(module) != sum(balance):
        raise BalanceError(
            f"module and sum of balance have different length (module: {len(module)}, sum of balance: {sum(balance)})"
        )
    if any(b <= 0 for b in balance):
        raise BalanceError(f"all balance numbers must be positive integer (balance: {balance})")
    if len(balance) > len(devices):
        raise IndexError(
            f"too few devices to hold given partitions (devices: {len(devices)}, partitions: {len(balance)})"
        )
    partitions = []
    children = list(module.named_children())
    start = 0
    for j, count in enumerate(balance):
        partition = nn.Sequential(OrderedDict(children[start : start + count]))
        partition.to(devices[j])
        partitions.append(partition)
        start += count
    return nn.ModuleList(partitions), balance, devices[: len(balance)]


def _verify_splitting(partitions: nn.ModuleList, devices: List[torch.device]) -> None:
    owner = {}
    for j, partition in enumerate(partitions):
        for p in partition.parameters():
            k = owner.setdefault(id(p), j)
            if k != j and devices[k] != devices[j]:
                raise ValueError("module with duplicate parameters on distinct devices is not supported")


def _sequence(value: Any, name: str, items: str) -> list:
    """list(value), or the TypeError FairScale raises (not iterable) with the argument named."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise TypeError(f"argument '{name}': expected a sequence of {items}, got {type(value).__name__}")
    return list(value)


def _device(d: Any) -> torch.device:
    try:
        return torch.device(d)
    except (RuntimeError, TypeError) as exc:  # torch.device's own types, with the argument named
        raise type(exc)(f"argument 'devices': {d!r} is not a device: {exc}") from None


def _moving_denied() -> TypeError:
    return TypeError("denied to move parameters and buffers, because Pipe should manage device placement")


class Pipe(nn.Module):
    """Wraps an ``nn.Sequential`` to train it with GPipe pipeline parallelism::

        model = nn.Sequential(a, b, c, d)
        model = Pipe(model, balance=[2, 2], devices=["cpu", "cpu"], chunks=8)
        output = model(input)

    The layers are split into partitions of ``balance[k]`` consecutive layers, partition k
    placed on ``devices[k]`` (default: every CUDA device, in order; "cpu" may repeat). The
    input batch is split into ``chunks`` micro-batches along dimension 0, which flow through
    the partitions on the GPipe schedule, partitions working concurrently.

    checkpoint: "always", "except_last" (every micro-batch but the last) or "never": which
    micro-batches keep only their partition inputs in forward and recompute the rest in
    backward (random numbers replayed). Off in eval mode (``partitions[0].training`` false).
    deferred_batch_norm: BatchNorm layers are replaced by DeferredBatchNorm, whose running
    statistics are those of the whole mini-batch.

    Raises TypeError (not an nn.Sequential; balance or devices not a sequence, or balance holding
    a non-number; chunks neither a number nor a string), ValueError (no balance, a balance that
    does not cover the module or has a zero or a fraction, chunks not a whole number >= 1, an
    unknown checkpoint mode), IndexError (fewer devices than partitions), RuntimeError (a device
    torch does not know).
    """

    balance: List[int] = []
    devices: List[torch.device] = []
    chunks: int = 1
    checkpoint: str = "except_last"

    def __init__(
        self,
        module: nn.Sequential,
        balance: Optional[Iterable[int]] = None,
        *,
        devices: Optional[Iterable[Device]] = None,
        chunks: int = chunks,
        checkpoint: str = checkpoint,
        deferred_batch_norm: bool = False,
    ) -> None:
        super().__init__()
        chunks = _chunks(chunks)
        if balance is None:
            raise ValueError(_recommend_auto_balance("balance is required"))
        mode = str(checkpoint)  # as FairScale: an object whose str() names a mode is taken
        if mode not in ("always", "except_last", "never"):
            raise ValueError(f"checkpoint is not one of 'always', 'except_last', or 'never' (got {checkpoint!r})")
        checkpoint = mode
        _verify_module(module)
        verify_skippables(module)
        self.chunks = chunks
        self.checkpoint = checkpoint
        if deferred_batch_norm:
            module = DeferredBatchNorm.convert_deferred_batch_norm(module, chunks)
        if devices is None:
            devices = range(torch.cuda.device_count())
        devices = [_device(d) for d in _sequence(devices, "devices", "devices (str, int or torch.device)")]
        balance = _sequence(balance, "balance", "positive ints")
        try:
            self.partitions, self.balance, self.devices = _split_module(module, balance, devices)
        except BalanceError as exc:
            raise ValueError(_recommend_auto_balance(str(exc))) from None
        _verify_splitting(self.partitions, self.devices)
        self._skip_layout = inspect_skip_layout(self.partitions)
        self._pipeline = Pipeline(self.partitions, self.devices, self._skip_layout, checkpoint)
        weakref.finalize(self, self._pipeline.close)

    @property
    def pipeline(self) -> Pipeline:
        """What runs the micro-batches (FairScale's attribute of the same name)."""
        return self._pipeline

    def __len__(self) -> int:
        """The number of layers of the underlying Sequential."""
        return sum(len(p) for p in self.partitions)

    def __getitem__(self, index: int) -> nn.Module:
        """A layer of the underlying Sequential (negative indices count from the end)."""
        layers = list(self)
        try:
            index = operator.index(index)  # numpy and 0-d tensor integers too, as nn.Sequential
        except TypeError:
            raise TypeError(f"Pipe indices must be integers, not {type(index).__name__}") from None
        if not -len(layers) <= index < len(layers):
            raise IndexError(f"Pipe index {index} out of range for {len(layers)} layers")
        return layers[index]

    def __iter__(self) -> Iterator[nn.Module]:
        """The layers of the underlying Sequential, in order."""
        for partition in self.partitions:
            yield from partition

    # Pipe places each partition on its device; moving the whole module is refused.
    def cuda(self, device: Optional[Device] = None) -> "Pipe":
        raise _moving_denied()

    def cpu(self) -> "Pipe":
        raise _moving_denied()

    def to(self, *args: Any, **kwargs: Any) -> "Pipe":
        """Allows ``to(dtype)`` only; a device or a tensor to follow is a TypeError."""
        if "device" in kwargs or "tensor" in kwargs:
            raise _moving_denied()
        if args and (isinstance(args[0], (torch.device, int, str)) or torch.is_tensor(args[0])):
            raise _moving_denied()
        return super().to(*args, **kwargs)

    def forward(self, input: TensorOrTensors) -> TensorOrTensors:  # type: ignore[override]
        """The Sequential's output for `input` (a Tensor or a tuple of Tensors, split along
        dimension 0); partitions' inputs and outputs must be Tensors or tuples of Tensors too."""
        microbatch.check(input)
        if not self.devices:
            return input  # an empty Sequential
        atomic = isinstance(input, torch.Tensor)
        inputs = microbatch.as_tuple(input)
        batches = microbatch.scatter(inputs, self.chunks)
        begin_mini_batch(self.partitions, len(batches))
        if self._pipeline.can_run_whole(len(batches), self.chunks):
            outputs, out_atomic = self._pipeline.forward_whole(batches[0], atomic)
            return microbatch.from_tuple(outputs, out_atomic)
        run = self._pipeline.forward(batches, atomic, self.chunks)
        if run.grad and self._needs_autograd(inputs):
            phony = torch.empty(0, requires_grad=True)
            split = [b[0].size(0) for b in batches]
            outputs = PipeFunction.apply(self._pipeline, run, split, phony, *inputs)
        else:  # nothing to differentiate: the tasks' graphs go now
            outputs = microbatch.gather(run.outputs)
            run.outputs = []
            run.tasks.clear()
            run.release()
        return microbatch.from_tuple(tuple(outputs), run.output_atomic)

    def _needs_autograd(self, inputs: Tuple[torch.Tensor, ...]) -> bool:
        if any(x.requires_grad for x in inputs):
            return True
        return any(p.requires_grad for p in self.partitions.parameters())
