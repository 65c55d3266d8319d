"""Random-number streams for model parallelism (fairscale.nn.model_parallel.random).

``model_parallel_cuda_manual_seed(seed)`` seeds two streams: the default generator with `seed`
(the same on the ranks of a model-parallel group: dropout outside model-parallel regions agrees
across them) and a tracked one, ``"model-parallel-rng"``, with ``seed + 2718 + model-parallel
rank`` (different across a model-parallel group, the same across data-parallel replicas: dropout
inside model-parallel regions). ``with get_cuda_rng_tracker().fork(): ...`` draws from the tracked
stream. ``checkpoint(function, *args)`` is activation checkpointing that replays the default
generators and the tracked streams, so dropout recomputes the same masks.

The streams are those of the CUDA generator where CUDA is available (FairScale's behaviour), and
of the CPU generator on a machine without CUDA, where FairScale's seeding does nothing.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Dict, Iterator, Set

import torch
import torch.distributed as dist
from torch.utils.checkpoint import detach_variable

from .initialize import get_data_parallel_rank, get_model_parallel_rank

__all__ = ["CudaRNGStatesTracker", "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed", "checkpoint"]

_MODEL_PARALLEL_RNG_TRACKER_NAME = "model-parallel-rng"
log = logging.getLogger(__name__)


def _get_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if torch.cuda.is_available() else torch.get_rng_state()


def _set_state(state: torch.Tensor) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _seed(seed: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class CudaRNGStatesTracker:
    """Named generator states: ``add(name, seed)`` creates one, ``fork(name)`` runs a block with it
    (and keeps where the block left it), leaving the device's generator as it was."""

    def __init__(self) -> None:
        self.states_: Dict[str, torch.Tensor] = {}
        self.seeds_: Set[int] = set()

    def reset(self) -> None:
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> Dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_:
            raise ValueError(f"CudaRNGStatesTracker.add: seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"CudaRNGStatesTracker.add: rng state {name!r} already exists")
        self.seeds_.add(seed)
        orig = _get_state()
        _seed(seed)
        self.states_[name] = _get_state()
        _set_state(orig)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        if name not in self.states_:
            raise ValueError(f"CudaRNGStatesTracker.fork: rng state {name!r} is not added")
        orig = _get_state()
        _set_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_state()
            _set_state(orig)


_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default stream with `seed` and the tracked model-parallel stream with
    ``seed + 2718 + model-parallel rank`` (after initialize_model_parallel)."""
    model_parallel_seed = seed + 2718 + get_model_parallel_rank()
    log.info(
        "model parallel seeds on global rank %d: model parallel rank %d, data parallel rank %d, model parallel "
        "seed %d, data parallel seed %d",
        dist.get_rank(),
        get_model_parallel_rank(),
        get_data_parallel_rank(),
        model_parallel_seed,
        seed,
    )
    _TRACKER.reset()
    _seed(seed)
    _TRACKER.add(_MODEL_PARALLEL_RNG_TRACKER_NAME, model_parallel_seed)


class CheckpointFunction(torch.autograd.Function):
    """torch.utils.checkpoint's reentrant checkpoint, replaying the CPU generator, the CUDA one
    (if any) and the tracked streams."""

    @staticmethod
    def forward(ctx: Any, run_function: Any, *args: Any) -> Any:  # type: ignore[override]
        ctx.run_function = run_function
        ctx.cpu_state = torch.get_rng_state()
        ctx.cuda_state = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
        ctx.tracker_states = _TRACKER.get_states()
        ctx.save_for_backward(*args)
        with torch.no_grad():
            return run_function(*args)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # type: ignore[override]
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError("checkpoint: not compatible with torch.autograd.grad(); use .backward()")
        inputs = ctx.saved_tensors
        cpu_state = torch.get_rng_state()
        cuda_state = torch.cuda.get_rng_state() if ctx.cuda_state is not None else None
        tracker_states = _TRACKER.get_states()
        torch.set_rng_state(ctx.cpu_state)
        if ctx.cuda_state is not None:
            torch.cuda.set_rng_state(ctx.cuda_state)
        _TRACKER.set_states(ctx.tracker_states)
        try:
            detached = detach_variable(inputs)
            with torch.enable_grad():
                outputs = ctx.run_function(*detached)
        finally:
            torch.set_rng_state(cpu_state)
            if cuda_state is not None:
                torch.cuda.set_rng_state(cuda_state)
            _TRACKER.set_states(tracker_states)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        torch.autograd.backward(outputs, grads)
        return (None,) + tuple(inp.grad for inp in detached)


def checkpoint(function: Any, *args: Any) -> Any:
    """Run `function(*args)` without keeping its activations; the backward recomputes them with
    the generators (and tracked streams) as they were."""
    return CheckpointFunction.apply(function, *args)
