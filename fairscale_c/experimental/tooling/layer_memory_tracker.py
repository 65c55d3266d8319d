"""Layer by layer memory traces of a forward and backward pass, FairScale's LayerwiseMemoryTracker.

Each leaf module's forward leaves a trace (the memory allocated and reserved after it, how much it
added, the bytes of the activations it produced, its parameter bytes, what FSDP all-gathered since
the previous trace); each one's backward leaves one too (memory, and the bytes of the gradients
of its outputs). From the forward traces, :func:`suggest_checkpoint_location` finds where
activation checkpoints split the activation memory best.

Memory: on CUDA, torch's caching allocator (``memory_allocated`` / ``memory_reserved`` of the
model's device); on CPU, the C library's heap (glibc ``mallinfo2``: bytes in use, and bytes taken
from the system, both including memory-mapped chunks), where torch's CPU tensors live.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import io
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum, auto
from functools import lru_cache
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Set, Tuple, Union

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ...nn import FullyShardedDataParallel
from ...internal.args import as_int


class TraceForwardEvent(NamedTuple):
    """What a leaf module's forward added: ``memory_diff`` (allocated after - before) and
    ``memory_activations`` (bytes of its outputs that are not views of its inputs)."""

    memory_diff: int
    memory_activations: int

    def to_dict(self) -> Dict[str, Any]:
        return {"memory_diff": self.memory_diff, "memory_activations": self.memory_activations}

    @classmethod
    def from_dict(cls, serialized: Dict[str, Any]) -> "TraceForwardEvent":
        return TraceForwardEvent(serialized["memory_diff"], serialized["memory_activations"])


class TraceBackwardEvent(NamedTuple):
    """``memory_activations``: bytes of the gradients of a module's outputs."""

    memory_activations: int

    def to_dict(self) -> Dict[str, Any]:
        return {"memory_activations": self.memory_activations}

    @classmethod
    def from_dict(cls, serialized: Dict[str, Any]) -> "TraceBackwardEvent":
        return TraceBackwardEvent(serialized["memory_activations"])


class LayerMemoryTrace(NamedTuple):
    """The memory at one point of the forward or backward pass.

    module_name, module_params (bytes of its parameters), allocated and reserved (bytes, right
    after the module ran), is_forward, all_gathered (bytes FSDP all-gathered since the previous
    trace), cumul_all_gathered (bytes gathered by the FSDP modules still running their forward),
    event (a TraceForwardEvent or TraceBackwardEvent)."""

    module_name: str
    module_params: int
    allocated: int
    reserved: int
    is_forward: bool
    all_gathered: int
    cumul_all_gathered: int
    event: Union[TraceForwardEvent, TraceBackwardEvent]

    def to_dict(self) -> Dict[str, Any]:
        out = {f: getattr(self, f) for f in self._fields if f != "event"}
        out["event"] = self.event.to_dict()
        return out

    @classmethod
    def from_dict(cls, serialized: Dict[str, Any]) -> "LayerMemoryTrace":
        event_cls = TraceForwardEvent if serialized["is_forward"] else TraceBackwardEvent
        fields = {f: serialized[f] for f in cls._fields if f != "event"}
        return LayerMemoryTrace(event=event_cls.from_dict(serialized["event"]), **fields)


@dataclass
class LayerwiseMemoryTrackerSummary:
    """The peak allocated and cached (reserved) memory, the sums of the forward traces' activation
    bytes and memory increases, and the layers that produced the most activations."""

    max_memory_allocated: int
    max_memory_cached: int
    total_activation_allocations: int
    total_forward_allocations: int
    top_forward_activation_producers: List[LayerMemoryTrace]


class ProcessGroupTrackingEvent(Enum):
    """What a ProcessGroupTracker reports: ``allgather``, an all-gather about to run."""

    allgather = auto()


class ProcessGroupTracker:
    """A process group that reports its all-gathers to ``listener(event, outputs, inputs)``.
    Give it to FullyShardedDataParallel as its ``process_group``; :meth:`LayerwiseMemoryTracker.monitor`
    then listens, and the traces carry the bytes each layer all-gathered::

        group = ProcessGroupTracker(group)
        model = FullyShardedDataParallel(model, process_group=group)
        tracker = LayerwiseMemoryTracker()
        tracker.monitor(model)

    Everything else is the wrapped group's (attributes pass through). FSDP reports each all-gather
    of its parameters; torch.distributed calls made with the tracker itself report theirs."""

    def __init__(self, group: Any, listener: Optional[Callable[..., Any]] = None) -> None:
        self.group = group
        self.listener = listener

    @property
    def traced_process_group(self) -> Any:
        return self.group

    def notify_all_gather(self, outputs: Any, inputs: Any) -> None:
        if self.listener is not None:
            self.listener(ProcessGroupTrackingEvent.allgather, outputs, inputs)

    def __getattr__(self, item: str) -> Any:
        if item in ("group", "listener"):  # not set yet (unpickling): no recursion through them
            raise AttributeError(item)
        attr = getattr(self.group, item)
        if item in ("allgather", "_allgather_base", "allgather_into_tensor_coalesced"):
            return self._build_wrapper(attr)
        return attr

    def _build_wrapper(self, fct: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(outputs: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            self.notify_all_gather(outputs, inputs)
            return fct(outputs, inputs, *args, **kwargs)

        return wrapper


class LayerwiseMemoryTracker:
    """Traces a model's memory layer by layer. FairScale's usage::

        tracker = LayerwiseMemoryTracker()
        tracker.monitor(model)
        criterion(model(x), y).backward()
        tracker.stop()
        print(tracker.summary); tracker.memory_traces; tracker.show_plots()

    Works on CUDA models (torch's allocator) and CPU models (the C library's heap: see the module
    docstring); with FSDP and a :class:`ProcessGroupTracker`, also the all-gathered bytes."""

    def __init__(self) -> None:
        self.memory_traces: List[LayerMemoryTrace] = []
        self._hooks: List[RemovableHandle] = []
        self._previous_module_name: Optional[str] = None
        self._last_all_gather_memory = 0
        self._cumul_all_gather_memory: List[int] = []
        self._memory_pre_forward = 0
        self._traced_module_names: Set[str] = set()
        self._device = torch.device("cpu")

    def monitor(self, model: nn.Module) -> None:
        """Install the hooks on every module of ``model`` (its first parameter's or buffer's device
        decides where memory is measured)."""
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"LayerwiseMemoryTracker.monitor: argument 'model' must be an nn.Module, got {type(model).__name__}"
            )
        first = next(iter(list(model.parameters()) + list(model.buffers())), None)
        self._device = first.device if first is not None else torch.device("cpu")
        if self._device.type == "cpu" and _heap() is None:
            raise RuntimeError(
                "LayerwiseMemoryTracker: measuring CPU memory needs the GNU C library's mallinfo2 (glibc >= 2.33)"
            )
        for name, m in model.named_modules():
            self._hooks.append(m.register_forward_pre_hook(self._create_pre_forward_hook(name)))
            self._hooks.append(m.register_forward_hook(self._create_post_forward_hook(name)))
            if isinstance(m, FullyShardedDataParallel) and isinstance(m.all_gather_tracker, ProcessGroupTracker):
                m.all_gather_tracker.listener = self._handle_process_group_call
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

    def clear_traces(self) -> None:
        """Forget the traces collected so far."""
        self.memory_traces.clear()

    def stop(self) -> None:
        """Remove the hooks: nothing more is traced."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._previous_module_name = None
        self._memory_pre_forward = 0
        self._last_all_gather_memory = 0
        self._cumul_all_gather_memory.clear()

    @property
    def forward_traces(self) -> List[LayerMemoryTrace]:
        return [t for t in self.memory_traces if t.is_forward]

    @property
    def backward_traces(self) -> List[LayerMemoryTrace]:
        return [t for t in self.memory_traces if not t.is_forward]

    @property
    def max_memory_allocated(self) -> int:
        return max(t.allocated for t in self.memory_traces)

    @property
    def max_memory_cached(self) -> int:
        return max(t.reserved for t in self.memory_traces)

    @property
    def summary(self) -> LayerwiseMemoryTrackerSummary:
        forward = self.forward_traces
        return LayerwiseMemoryTrackerSummary(
            max_memory_allocated=self.max_memory_allocated,
            max_memory_cached=self.max_memory_cached,
            total_activation_allocations=sum(t.event.memory_activations for t in forward),
            total_forward_allocations=sum(_forward_event(t).memory_diff for t in forward),
            top_forward_activation_producers=self.top_forward_activation_producers(top=10),
        )

    def top_forward_activation_producers(self, top: int = 10) -> List[LayerMemoryTrace]:
        """The ``top`` forward traces with the most activation bytes, most first."""
        return sorted(self.forward_traces, key=lambda t: t.event.memory_activations, reverse=True)[:top]

    def show_plots(self, figsize: Tuple[int, int] = (16, 20), capture: bool = False) -> Optional[Any]:
        """Plot the traces (matplotlib); ``capture=True`` returns the figure as an RGB PIL image."""
        return compare_memory_traces_in_plot({"run": self.memory_traces}, figsize=figsize, capture=capture)

    def save_traces(self, path: str) -> None:
        """The traces as JSON at ``path``."""
        import json

        with open(path, "w") as f:
            json.dump({"traces": [t.to_dict() for t in self.memory_traces]}, f)

    @classmethod
    def load(cls, path: str) -> "LayerwiseMemoryTracker":
        """A tracker holding the traces saved at ``path``."""
        import json

        out = cls()
        with open(path) as f:
            out.memory_traces = [LayerMemoryTrace.from_dict(t) for t in json.load(f)["traces"]]
        return out

    # ------------------------------------------------------------------ hooks
    def _create_pre_forward_hook(self, name: str) -> Callable[..., None]:
        def _pre_forward_hook(module: nn.Module, inputs: Any) -> None:
            allocated, _ = self._capture_memory()
            self._previous_module_name = name
            self._memory_pre_forward = allocated
            if isinstance(module, FullyShardedDataParallel):
                self._cumul_all_gather_memory.append(0)

        return _pre_forward_hook

    def _handle_process_group_call(self, event: ProcessGroupTrackingEvent, *args: Any) -> None:
        if event == ProcessGroupTrackingEvent.allgather:
            outputs, _ = args
            size = self._get_module_output_size(outputs)
            self._last_all_gather_memory += size
            if self._cumul_all_gather_memory:
                self._cumul_all_gather_memory[-1] += size

    def _create_post_forward_hook(self, name: str) -> Callable[..., None]:
        def _post_forward_hook(module: nn.Module, inputs: Any, outputs: Any) -> None:
            if isinstance(module, FullyShardedDataParallel) and self._cumul_all_gather_memory:
                self._cumul_all_gather_memory.pop()
            if name == self._previous_module_name:  # a leaf: no submodule ran in between
                self._traced_module_names.add(name)
                before = self._memory_pre_forward
                activations = self._new_bytes(inputs, outputs)
                self._record(
                    name, module, True, sum(self._cumul_all_gather_memory),
                    lambda allocated: TraceForwardEvent(allocated - before, activations),
                )  # fmt: skip
                self._watch_backward(name, module, outputs)
            self._previous_module_name = None
            self._memory_pre_forward = 0

        return _post_forward_hook

    def _watch_backward(self, name: str, module: nn.Module, outputs: Any) -> None:
        """Trace the backward of the autograd node that made the module's first output, once it
        has run (FairScale's module backward hook sits on the same node)."""
        tensors = self._collect_tensors(outputs)
        node = tensors[0].grad_fn if tensors else None
        if node is not None:
            node.register_hook(self._create_backward_hook(name, module))

    def _create_backward_hook(self, name: str, module: nn.Module) -> Callable[..., None]:
        def _backward_hook(
            grad_input: Sequence[Optional[torch.Tensor]], grad_output: Sequence[Optional[torch.Tensor]]
        ) -> None:
            memory = self._new_bytes(grad_input, grad_output)
            self._record(name, module, False, 0, lambda allocated: TraceBackwardEvent(memory))

        return _backward_hook

    def _record(self, name: str, module: nn.Module, forward: bool, cumul: int, event: Callable[[int], Any]) -> None:
        """Append a trace of ``module`` with the memory now and ``event(allocated)``; the bytes
        gathered since the previous trace go with it."""
        allocated, reserved = self._capture_memory()
        self.memory_traces.append(
            LayerMemoryTrace(
                module_name=name,
                module_params=self._get_parameter_size(module),
                allocated=allocated,
                reserved=reserved,
                is_forward=forward,
                all_gathered=self._last_all_gather_memory,
                cumul_all_gathered=cumul,
                event=event(allocated),
            )
        )
        self._last_all_gather_memory = 0

    @classmethod
    def _new_bytes(cls, inputs: Any, outputs: Any) -> int:
        """Bytes of the outputs that do not share storage with an input."""
        return sum(cls._get_module_output_size(y) for y in cls._filter_allocated_output(inputs, outputs))

    # ------------------------------------------------------------------ measuring
    def _capture_memory(self) -> Tuple[int, int]:
        """(allocated, reserved) bytes on the monitored model's device."""
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)
            return torch.cuda.memory_allocated(self._device), torch.cuda.memory_reserved(self._device)
        heap = _heap()
        if heap is None:
            raise RuntimeError("LayerwiseMemoryTracker: no way to measure CPU memory here (glibc mallinfo2)")
        return heap()

    @classmethod
    def _get_parameter_size(cls, module: nn.Module) -> int:
        return sum(p.numel() * p.element_size() for p in module.parameters())

    @classmethod
    def _get_module_output_size(cls, xs: Any) -> int:
        """Bytes the tensors in ``xs`` (a tensor, or nested lists / tuples / dicts) need at least."""
        return sum(t.numel() * t.element_size() for t in cls._collect_tensors(xs))

    @classmethod
    def _get_dtype_size(cls, x: torch.Tensor) -> int:
        return x.element_size()

    @classmethod
    def _filter_allocated_output(cls, inputs: Any, outputs: Any) -> List[torch.Tensor]:
        """The outputs that are not views of (or in the storage of) one of the inputs."""
        xs = cls._collect_tensors(inputs)
        return [y for y in cls._collect_tensors(outputs) if not any(cls._is_same_storage(x, y) for x in xs)]

    @staticmethod
    def _is_same_storage(x: torch.Tensor, y: torch.Tensor) -> bool:
        return x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()

    @staticmethod
    def _collect_tensors(module_io_tensors: Any) -> List[torch.Tensor]:
        """The tensors in a module's inputs or outputs (nested lists, tuples and dicts), in order."""
        tensors: List[torch.Tensor] = []
        stack = [module_io_tensors]
        while stack:
            x = stack.pop()
            if isinstance(x, torch.Tensor):
                tensors.append(x)
            elif isinstance(x, (list, tuple)):
                stack.extend(reversed(x))
            elif isinstance(x, dict):
                stack.extend(reversed(list(x.values())))
        return tensors


def _forward_event(trace: LayerMemoryTrace) -> TraceForwardEvent:
    return trace.event  # type: ignore[return-value]


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


@lru_cache(maxsize=None)
def _heap() -> Optional[Callable[[], Tuple[int, int]]]:
    """(bytes in use, bytes taken from the system) of the C library's heap, memory-mapped chunks
    included; None where the C library has no mallinfo2."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallinfo2 = libc.mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    mallinfo2.argtypes = []

    def heap() -> Tuple[int, int]:
        m = mallinfo2()
        return m.uordblks + m.hblkhd, m.arena + m.hblkhd

    return heap


def find_best_reset_points(activation_sizes: List[int], num_checkpoints: int) -> Tuple[int, List[int]]:
    """Cut the layers' activation sizes into at most ``num_checkpoints`` + 1 consecutive chunks so
    that the largest chunk's sum is smallest. Returns (that sum, the start indices of the chunks
    after the first), as FairScale's: with the model, its gradients and optimizer state taken as
    constant, where checkpoints reset the activation memory best."""
    n = len(activation_sizes)
    if as_int(num_checkpoints) is None or num_checkpoints < 0:
        raise ValueError(
            f"find_best_reset_points: argument 'num_checkpoints' must be an int >= 0, got {num_checkpoints!r}"
        )
    num_checkpoints = as_int(num_checkpoints)
    suffix = [0] * (n + 1)
    for i in range(n - 1, -1, -1):
        suffix[i] = suffix[i + 1] + activation_sizes[i]

    @lru_cache(maxsize=None)
    def visit(pos: int, remaining: int) -> Tuple[float, Tuple[int, ...]]:
        if pos == n:
            return 0, ()
        if remaining == 0:
            return suffix[pos], ()
        best: Tuple[float, Tuple[int, ...]] = (float("inf"), ())
        chunk = 0
        for end in range(pos, n):
            chunk += activation_sizes[end]
            rest, cuts = visit(end + 1, remaining - 1)
            score = max(chunk, rest)
            if score < best[0]:
                best = (score, (end + 1,) + cuts)
        return best

    score, cuts = visit(0, num_checkpoints)
    return int(score), list(cuts)


@dataclass
class SuggestedCheckpoints:
    """The activation memory left at peak, the modules where checkpointed chunks should start,
    and every traced module in order."""

    max_memory: int
    split_modules: List[str]
    all_modules: List[str]


def suggest_checkpoint_location(
    traces: List[LayerMemoryTrace], num_checkpoints: int, num_skipped_layers: int = 0
) -> SuggestedCheckpoints:
    """From a model's traces (with or without checkpointing), the best ``num_checkpoints``
    places to reset activation memory: the names of the modules where checkpoint_wrapper'd chunks
    should begin. ``num_skipped_layers``: leave the first layers out."""
    seen: Set[str] = set()
    modules: List[str] = []
    allocations: List[int] = []
    for t in traces:
        if t.is_forward and t.module_name not in seen:
            seen.add(t.module_name)
            modules.append(t.module_name)
            allocations.append(t.event.memory_activations)
    modules, allocations = modules[num_skipped_layers:], allocations[num_skipped_layers:]
    max_memory, resets = find_best_reset_points(allocations, num_checkpoints=num_checkpoints)
    # a reset after the last module splits nothing (FairScale's indexes past the list there)
    split = [modules[i] for i in resets if i < len(modules)]
    return SuggestedCheckpoints(max_memory=max_memory, split_modules=split, all_modules=modules)


def _assert_visualisation_library_installed() -> None:
    try:
        import matplotlib  # noqa: F401
        import PIL  # noqa: F401
    except ImportError:
        raise ImportError(
            "Visualizing memory plots requires matplotlib and Pillow installed: "
            "pip install matplotlib, pip install Pillow"
        ) from None


def compare_memory_traces_in_plot(
    memory_traces_by_job: Dict[str, List[LayerMemoryTrace]], figsize: Tuple[int, int] = (16, 20), capture: bool = False
) -> Optional[Any]:
    """Six plots of one or more jobs' traces (allocated, reserved, activation allocations,
    cumulative forward activations, all-gathered memory, parameter memory), forward and backward
    as separate curves; shown, or with ``capture`` returned as an RGB PIL image."""
    _assert_visualisation_library_installed()
    import matplotlib.pyplot as plt

    from ._memory_plots import MemoryGraphCreator

    fig, ax = plt.subplots(figsize=figsize, ncols=2, nrows=3)
    creator = MemoryGraphCreator()
    panels = [
        (ax[0, 0], "memory allocated", creator.allocated_memory_curve),
        (ax[0, 1], "memory reserved", creator.reserved_memory_curve),
        (ax[1, 0], "activation allocations", creator.activation_allocations),
        (ax[1, 1], "cumulative forward activations", creator.cumulative_activations),
        (ax[2, 0], "all gathered memory", creator.all_gathered_memory),
        (ax[2, 1], "parameter memory", creator.module_parameters),
    ]
    for axis, title, draw in panels:
        axis.set_title(title)
        for job, traces in memory_traces_by_job.items():
            draw(axis, job, traces)
        if len(memory_traces_by_job) > 1:
            axis.legend()
    if not capture:
        plt.show()
        return None
    image = matplotlib_figure_to_image(fig)
    plt.close(fig)
    return image


@contextmanager
def null_context() -> Iterator[None]:
    yield


def matplotlib_figure_to_image(fig: Any) -> Any:
    """A matplotlib figure as an RGB PIL image."""
    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf)
    buf.seek(0)
    return Image.open(buf).convert("RGB")
