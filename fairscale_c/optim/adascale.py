"""AdaScale: large-batch learning-rate scaling, with FairScale 0.4.13's API.

AdaScale (Johnson et al., "AdaScale SGD", ICML 2020) wraps an optimizer and, at every step,
multiplies each parameter group's learning rate by a *gain* r in [1, scale] estimated from the
gradients themselves::

    gain = (var + sqr) / (var / scale + sqr)

where ``sqr`` estimates |E[g]|^2 (the squared norm of the true gradient) and ``var`` estimates the
trace of the gradient covariance at the baseline batch size; both are exponential moving averages
of per-step estimates. A step's estimates come from the cN = world_size * num_gradients_to_accumulate
micro-batch gradients g_1..g_cN that make up the step (one per rank and accumulation pass) and
their mean g (the gradient the optimizer sees):

    var_t = (scale / cN) * sum_i |g_i - g|^2 / (cN - 1)
    sqr_t = |g|^2 - var_t / scale

computed as FairScale does from two numbers per parameter group: sum_i |g_i|^2 (a backward hook
adds each micro-batch gradient's squared norm; one all_reduce over the ranks at the end of the
last backward pass) and |g|^2 (from ``param.grad`` once data parallelism has averaged it).

The collective goes through :mod:`fairscale_c.distributed` (``group_for(process_group)``); a
world of one (gradient accumulation only) needs no torch.distributed.

Differences from FairScale 0.4.13, all where FairScale would crash, hang or silently misbehave:

* Misuse raises a clear exception (``RuntimeError`` for calls in the wrong phase, ``ValueError`` /
  ``TypeError`` for bad arguments) instead of an ``assert`` that ``python -O`` removes.
* ``world_size`` > 1 must equal the size of the process group the statistics are reduced over
  (FairScale would all-reduce over the default group and divide by the wrong count).
* ``step()`` restores the learning rates even when the inner step raises, and does not modify a
  tensor learning rate in place.
* ``state_dict()`` / ``load_state_dict()`` copy AdaScale's statistics rather than aliasing live
  arrays, and a state dict without them (a plain optimizer's) starts the statistics afresh.
* Parameters without a gradient count as zero instead of raising ``AttributeError``.
* :class:`AdaScaleWrapper` passes ``debias_ewma`` by keyword (see its docstring).
* An extra keyword-only ``process_group`` (default: torch's default group) says which ranks
  contribute gradients.

Use it with DistributedDataParallel (every rank holds the averaged gradient) or alone with
gradient accumulation; ``AdaScale(OSS(...))`` under DDP trains like ``AdaScale(SGD(...))``. Under
ShardedDataParallel a rank keeps only the gradients it owns, so |g|^2 would cover those only
(FairScale's has the same limit): not supported.

The statistics are stored, as in FairScale, as numpy arrays under the key ``"adascale"`` of the
wrapped optimizer's ``state``, so checkpoints interchange with FairScale's (loading one with
``torch.load`` needs ``weights_only=False``, as FairScale's do). So AdaScale needs numpy, which
the rest of fairscale_c does not: ``pip install fairscale_c[adascale]``.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, Iterable, List, Optional, Type

import torch
from torch.optim import SGD, Optimizer

from .. import distributed as fdist
from ..internal.args import as_int

try:  # only AdaScale needs numpy (its statistics are numpy arrays, as FairScale's): optim imports without it
    import numpy as np
except ImportError:  # pragma: no cover - numpy is installed wherever the tests run
    np = None

__all__ = ["AdaScale", "AdaScaleWrapper"]

_STATE_KEY = "adascale"
# The variance estimate is clamped to at least this (FairScale's floor), the squared norm to >= 0.
_MIN_VAR = 1e-6


def _check_int(name: str, value: Any, minimum: int) -> int:
    if as_int(value) is None:
        raise TypeError(f"AdaScale: argument '{name}' must be an int >= {minimum}, got {type(value).__name__}")
    value = as_int(value)
    if value < minimum:
        raise ValueError(f"AdaScale: argument '{name}' must be an int >= {minimum}, got {value}")
    return value


def _check_real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
        raise TypeError(f"AdaScale: argument '{name}' must be a real number, got {type(value).__name__}")
    value = float(value)
    if not np.isfinite(value):
        raise ValueError(f"AdaScale: argument '{name}' must be finite, got {value}")
    return value


def _queue_engine_callback(fn: Callable[[], None]) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(fn)


class AdaScale(Optimizer):
    """Wraps ``optimizer`` and scales its learning rates by :meth:`gain` at every :meth:`step`.

    Args:
        optimizer: the optimizer to wrap (for example ``SGD``, or an ``OSS``).
        world_size: how many ranks contribute a gradient each step; None: the size of
            ``process_group`` (1 without torch.distributed).
        scale: batch-size scale relative to the baseline; None: ``world_size *
            num_gradients_to_accumulate``. At least 1.
        smoothing: EWMA factor in [0, 1); None: ``max(1 - world_size * num_gradients_to_accumulate
            / 1000, 0)``.
        num_gradients_to_accumulate: backward passes per step (gradient accumulation).
        is_scaled_loss: True if each accumulation pass's loss is divided by
            ``num_gradients_to_accumulate`` (so ``param.grad`` holds the mean); False if not (then
            call :meth:`scale_grad_by_num_grads_to_accum` before ``step``).
        debias_ewma: debiased moving averages (True), or the paper's Appendix B.3 scheme (False).
        process_group: keyword only, not in FairScale: the torch process group whose ranks
            contribute gradients (default: torch's default group).

    Raises ``RuntimeError`` when ``world_size * num_gradients_to_accumulate <= 1`` (one gradient
    per step gives no variance estimate), as FairScale does.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        world_size: Optional[int] = None,
        scale: Optional[float] = None,
        smoothing: Optional[float] = None,
        num_gradients_to_accumulate: int = 1,
        is_scaled_loss: bool = True,
        debias_ewma: bool = True,
        *,
        process_group: Any = None,
    ) -> None:
        if np is None:
            raise ImportError("AdaScale needs numpy (pip install numpy): it keeps its statistics as numpy arrays")
        self._hook_handles: List[Any] = []
        self._local_grad_sqr: Optional[torch.Tensor] = None
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                "AdaScale: argument 'optimizer' must be a torch.optim.Optimizer instance, "
                f"got {type(optimizer).__name__}"
            )
        num_gradients_to_accumulate = _check_int("num_gradients_to_accumulate", num_gradients_to_accumulate, 1)
        if world_size is not None:
            world_size = _check_int("world_size", world_size, 1)
        self._optimizer = optimizer
        self._group: Any = None
        if world_size != 1:
            self._group = fdist.group_for(process_group, argument="AdaScale: argument 'process_group'")
            if world_size is None:
                world_size = self._group.size
            elif world_size != self._group.size:
                raise ValueError(
                    f"AdaScale: argument 'world_size' ({world_size}) must equal the size of the process group "
                    f"the gradient statistics are reduced over ({self._group.size}), or be 1 or None"
                )
        self._world_size: int = world_size
        self._is_scaled_loss = bool(is_scaled_loss)
        self._debias_ewma = bool(debias_ewma)
        self._num_backward_calls = 0
        self._last_final_backward_call = 0
        self._callback_task: Optional[int] = None  # the autograd graph task our callback is queued on

        self._num_grads_to_accum = num_gradients_to_accumulate
        self._smoothing = self._default_smoothing()
        if smoothing is not None:
            self._smoothing = self._check_smoothing(smoothing)
        if self._world_size * self._num_grads_to_accum <= 1:
            raise RuntimeError(
                "AdaScale does not support a single worker without grad accumulation: world_size * "
                f"num_gradients_to_accumulate must be > 1, got {self._world_size} * {self._num_grads_to_accum}"
            )
        optimizer.state.setdefault(_STATE_KEY, self._fresh_state())
        self._check_state(self._state)
        # The statistics start at zero variance, so there is nothing to rescale here (FairScale
        # rescales whatever state the optimizer already held).
        self._scale = self._check_scale(self._world_size * self._num_grads_to_accum if scale is None else scale)
        self._hook()

    # ------------------------------------------------------------ state

    def _fresh_state(self) -> Dict[str, np.ndarray]:
        n = len(self._optimizer.param_groups)
        return {"grad_sqr_avg": np.ones(n), "grad_var_avg": np.zeros(n)}

    @property
    def _state(self) -> Dict[str, np.ndarray]:
        return self._optimizer.state[_STATE_KEY]

    def _check_state(self, state: Any) -> None:
        n = len(self._optimizer.param_groups)
        if not isinstance(state, dict) or "grad_sqr_avg" not in state or "grad_var_avg" not in state:
            raise ValueError(
                f"AdaScale: the optimizer state's '{_STATE_KEY}' entry must be a dict with 'grad_sqr_avg' and "
                f"'grad_var_avg', got {type(state).__name__}"
            )
        for name, value in state.items():
            expected = (1,) if name.endswith("_count") else (n,)
            if np.shape(value) != expected:
                raise ValueError(
                    f"AdaScale: the optimizer state's '{_STATE_KEY}' entry '{name}' has shape {np.shape(value)}; "
                    f"expected {expected} ({n} parameter group(s))"
                )

    def _require_outside_backward(self, what: str) -> None:
        if self._local_grad_sqr is not None:
            raise RuntimeError(
                f"AdaScale.{what}: not allowed while gradients are being accumulated (after a backward pass, "
                f"before the last of the {self._num_grads_to_accum} passes of this step has finished)"
            )

    def _default_smoothing(self) -> float:
        return max(1 - self._world_size * self._num_grads_to_accum / 1000, 0)

    @staticmethod
    def _check_smoothing(smoothing: Any) -> float:
        value = _check_real("smoothing", smoothing)
        if not 0.0 <= value < 1.0:
            raise ValueError(f"AdaScale: argument 'smoothing' must be in [0, 1), got {value}")
        return value

    @staticmethod
    def _check_scale(scale: Any) -> float:
        value = _check_real("scale", scale)
        if value < 1:
            raise ValueError(f"AdaScale: argument 'scale' must be at least 1, got {value}")
        return value

    # ------------------------------------------------------------ public properties

    @property
    def scale(self) -> float:
        """The batch-size scale relative to the baseline (for logging; not the gain)."""
        return self._scale

    @property
    def smoothing(self) -> float:
        """The EWMA smoothing factor of the gradient statistics."""
        return self._smoothing

    def set_scale(self, scale: float, update_estimate: bool = True) -> None:
        """Change the batch-size scale. With ``update_estimate`` the variance estimate (which is
        expressed at the current scale) is rescaled to the new one."""
        self._require_outside_backward("set_scale")
        scale = self._check_scale(scale)
        if update_estimate:
            ratio = self._scale / scale
            for name in ("grad_var_avg_biased" if self._debias_ewma else "grad_var_avg_total", "grad_var_avg"):
                if name in self._state:
                    self._state[name] = self._state[name] * ratio
        self._scale = scale

    def set_num_gradients_to_accumulate(self, num_gradients_to_accumulate: int, update_smoothing: bool = True) -> None:
        """Change the number of backward passes per step; with ``update_smoothing`` the smoothing
        factor is reset to its default for the new count. Call :meth:`set_scale` too, as a rule."""
        self._require_outside_backward("set_num_gradients_to_accumulate")
        self._num_grads_to_accum = _check_int("num_gradients_to_accumulate", num_gradients_to_accumulate, 1)
        if update_smoothing:
            self._smoothing = self._default_smoothing()

    def gain(self, pg_idx: Optional[int] = None) -> float:
        """The current gain ratio r_t of parameter group ``pg_idx``, or of all groups together
        (their statistics summed) when None."""
        if pg_idx is None:
            var, sqr = float(np.sum(self._state["grad_var_avg"])), float(np.sum(self._state["grad_sqr_avg"]))
        else:
            n = len(self._optimizer.param_groups)
            if isinstance(pg_idx, bool) or not isinstance(pg_idx, (int, np.integer)) or not -n <= pg_idx < n:
                raise IndexError(
                    f"AdaScale.gain: argument 'pg_idx' must be None or a group index in [0, {n}), got {pg_idx!r}"
                )
            var, sqr = float(self._state["grad_var_avg"][pg_idx]), float(self._state["grad_sqr_avg"][pg_idx])
        return (var + sqr) / (var / self._scale + sqr)

    # ------------------------------------------------------------ hooks

    def _hook(self) -> None:
        if self._hook_handles:
            raise RuntimeError("AdaScale: hooks are already registered; call unhook() first")
        for idx, group in enumerate(self._optimizer.param_groups):
            for p in group["params"]:
                if p.requires_grad:
                    self._hook_handles.append(p.register_hook(self._make_grad_hook(idx)))

    def _make_grad_hook(self, pg_idx: int) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self._on_grad(pg_idx, grad)

        return hook

    def unhook(self) -> None:
        """Remove the gradient hooks (they keep the parameters and this object alive); AdaScale
        then no longer updates its statistics."""
        for h in getattr(self, "_hook_handles", ()):
            h.remove()
        self._hook_handles = []

    def __del__(self) -> None:
        self.unhook()

    def _on_grad(self, pg_idx: int, grad: torch.Tensor) -> None:
        """A micro-batch gradient of one parameter arrived (before accumulation into .grad)."""
        if self._local_grad_sqr is None:
            self._local_grad_sqr = torch.zeros(len(self._optimizer.param_groups), device=grad.device)
        g = grad.to_dense() if grad.is_sparse else grad
        with torch.no_grad():  # a backward with create_graph=True must not record this
            self._local_grad_sqr[pg_idx] += torch.linalg.vector_norm(g, dtype=torch.float32).square()
        task = torch._C._current_graph_task_id()
        if task != self._callback_task:
            self._callback_task = task
            # Queued from a callback, the final one runs after every callback queued during the
            # backward pass, such as DistributedDataParallel's, which completes .grad.
            _queue_engine_callback(lambda: _queue_engine_callback(self._end_of_backward))

    def _end_of_backward(self) -> None:
        self._callback_task = None
        if self._local_grad_sqr is None:  # unhooked or reset meanwhile
            return
        self._num_backward_calls += 1
        if (self._num_backward_calls - self._last_final_backward_call) % self._num_grads_to_accum != 0:
            return  # more accumulation passes to come
        self._update_statistics(self._local_grad_sqr)
        self._last_final_backward_call = self._num_backward_calls
        self._local_grad_sqr = None

    def _update_statistics(self, local_sqr: torch.Tensor) -> None:
        work = None
        if self._world_size > 1:
            work = self._group.all_reduce(local_sqr, op="sum", async_op=True)
        total = self._total_grad_sqr()
        if work is not None:
            work.wait()
        sum_micro = local_sqr.cpu().numpy()  # sum over micro-batches of |g_i|^2, float32 as FairScale
        accum = self._num_grads_to_accum
        if accum > 1:
            if self._is_scaled_loss:
                sum_micro = sum_micro * accum**2  # each pass's gradient was divided by accum
            else:
                total = total / accum**2  # .grad holds the sum of the passes, not their mean
        s, cn = self._scale, self._world_size * accum
        var = sum_micro * (s / cn) / (cn - 1) - total * s / (cn - 1)
        sqr = total - var / s
        self._update_avg("grad_sqr_avg", np.maximum(sqr, 0.0))
        self._update_avg("grad_var_avg", np.maximum(var, _MIN_VAR))

    def _total_grad_sqr(self) -> np.ndarray:
        """|param.grad|^2 summed per parameter group (float64), a bounded number of torch calls."""
        out = np.zeros(len(self._optimizer.param_groups))
        for idx, group in enumerate(self._optimizer.param_groups):
            grads = [p.grad.to_dense() if p.grad.is_sparse else p.grad for p in group["params"] if p.grad is not None]
            if grads:
                norms = torch._foreach_norm(grads)
                out[idx] = torch.stack(norms).double().square().sum().item()
        return out

    def _update_avg(self, name: str, value: np.ndarray) -> None:
        f, state = self._smoothing, self._state
        if self._debias_ewma:
            biased = f * state.get(name + "_biased", np.zeros(value.shape[0])) + (1.0 - f) * value
            unbias = f * state.get(name + "_unbias", np.zeros(value.shape[0])) + (1.0 - f)
            state[name + "_biased"], state[name + "_unbias"] = biased, unbias
            state[name] = biased / unbias
            return
        # Appendix B.3: a plain mean over the first 1 / (1 - f) steps, an EWMA afterwards.
        count = state.get(name + "_count", np.zeros(1)) + 1
        state[name + "_count"] = count
        if count[0] < 1 / (1 - f):
            total = state.get(name + "_total")
            total = value.copy() if total is None else total + value
            state[name + "_total"] = total
            state[name] = total / count
        else:
            state[name] = f * state[name] + (1.0 - f) * value

    # ------------------------------------------------------------ optimizer API

    def step(self, *args: Any, **kwargs: Any) -> Any:
        """The wrapped optimizer's step with each group's learning rate multiplied by its gain
        (restored afterwards). Arguments go to the wrapped ``step``."""
        self._require_outside_backward("step")
        groups = self._optimizer.param_groups
        original = [g["lr"] for g in groups]
        try:
            for idx, g in enumerate(groups):
                g["lr"] = g["lr"] * self.gain(idx)
            return self._optimizer.step(*args, **kwargs)
        finally:
            for lr, g in zip(original, groups):
                g["lr"] = lr

    @property
    def param_groups(self) -> List[Dict[str, Any]]:
        """The wrapped optimizer's groups, for LR schedulers; read through, so they stay the live
        list after ``load_state_dict`` (which gives the wrapped optimizer a new one)."""
        return self._optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: List[Dict[str, Any]]) -> None:
        self._optimizer.param_groups = groups

    def add_param_group(self, pg: Dict[str, Any]) -> None:
        """Add a group to the wrapped optimizer; its statistics start fresh (gain 1)."""
        self._require_outside_backward("add_param_group")
        self._optimizer.add_param_group(pg)
        self.unhook()
        self._hook()
        state = self._state
        for name in list(state):
            if not name.endswith("_count"):
                state[name] = np.append(state[name], 1.0 if name == "grad_sqr_avg" else 0.0)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``."""
        self._require_outside_backward("zero_grad")
        self._optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> Dict[str, Any]:
        """The wrapped optimizer's state dict; AdaScale's statistics are in ``state["adascale"]``
        (a copy). Not during gradient accumulation: the partial sums are not saved."""
        self._require_outside_backward("state_dict")
        sd = self._optimizer.state_dict()
        if _STATE_KEY in sd.get("state", {}):
            sd["state"] = dict(sd["state"])
            sd["state"][_STATE_KEY] = copy.deepcopy(sd["state"][_STATE_KEY])
        return sd

    def load_state_dict(self, data: Dict[str, Any]) -> None:
        """Load into the wrapped optimizer; statistics in the state dict are copied in, and a
        state dict without them (a plain optimizer's) starts them afresh."""
        self._require_outside_backward("load_state_dict")
        saved = data.get("state", {}).get(_STATE_KEY) if isinstance(data, dict) else None
        if saved is not None:
            saved = {k: np.array(v, dtype=np.float64) for k, v in dict(saved).items()}
            n = len(data.get("param_groups", ()))
            if n != len(self._optimizer.param_groups):
                raise ValueError(
                    f"AdaScale.load_state_dict: the state dict has {n} parameter group(s), this optimizer "
                    f"{len(self._optimizer.param_groups)}"
                )
        self._optimizer.load_state_dict(data)
        self._optimizer.state[_STATE_KEY] = saved if saved is not None else self._fresh_state()
        self._check_state(self._state)

    def scale_grad_by_num_grads_to_accum(self) -> None:
        """Divide every gradient by ``num_gradients_to_accumulate``: with ``is_scaled_loss=False``,
        after the last accumulation pass and before ``step``."""
        self._require_outside_backward("scale_grad_by_num_grads_to_accum")
        if self._num_grads_to_accum <= 1:
            raise RuntimeError("AdaScale.scale_grad_by_num_grads_to_accum: needs num_gradients_to_accumulate > 1")
        if self._is_scaled_loss:
            raise RuntimeError(
                "AdaScale.scale_grad_by_num_grads_to_accum: only for is_scaled_loss=False (the loss was "
                "already divided by num_gradients_to_accumulate)"
            )
        grads = [p.grad for g in self._optimizer.param_groups for p in g["params"] if p.grad is not None]
        if grads:
            torch._foreach_div_(grads, self._num_grads_to_accum)

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes AdaScale lacks: forward them to the wrapped optimizer.
        if name == "_optimizer":
            raise AttributeError(name)
        return getattr(self._optimizer, name)

    def __repr__(self) -> str:
        return f"AdaScale(scale={self._scale}, world_size={self._world_size}, optimizer={self._optimizer!r})"


class AdaScaleWrapper(AdaScale):
    """AdaScale built from parameters, like a plain optimizer (so OSS can take it as ``optim``):
    ``optim_cls(params, **optim_args)`` wrapped in :class:`AdaScale`.

    FairScale 0.4.13's version passes its arguments to ``AdaScale.__init__`` positionally and
    skips ``is_scaled_loss``, so ``debias_ewma`` lands in the ``is_scaled_loss`` slot: there,
    ``debias_ewma=False`` gives ``is_scaled_loss=False`` (gradients are taken to be sums, the
    statistics are off by ``num_gradients_to_accumulate**2``) while ``debias_ewma`` stays True.
    Here every argument goes by keyword, and ``is_scaled_loss`` (keyword only) can be given.
    With the default arguments both behave alike.
    """

    def __init__(
        self,
        params: Iterable[Any],
        world_size: Optional[int] = None,
        scale: Optional[float] = None,
        smoothing: Optional[float] = None,
        num_gradients_to_accumulate: int = 1,
        debias_ewma: bool = True,
        optim_cls: Type[Optimizer] = SGD,
        *,
        is_scaled_loss: bool = True,
        process_group: Any = None,
        **optim_args: Any,
    ) -> None:
        if not (isinstance(optim_cls, type) and issubclass(optim_cls, Optimizer)):
            raise TypeError(
                f"AdaScaleWrapper: argument 'optim_cls' must be a torch.optim.Optimizer subclass, got {optim_cls!r}"
            )
        super().__init__(
            optim_cls(params, **optim_args),
            world_size=world_size,
            scale=scale,
            smoothing=smoothing,
            num_gradients_to_accumulate=num_gradients_to_accumulate,
            is_scaled_loss=is_scaled_loss,
            debias_ewma=debias_ewma,
            process_group=process_group,
        )
