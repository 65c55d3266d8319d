"""Adam and Precision: fairscale.optim.Adam, FairScale's fused Adam (the fairseq/apex kernel), on
CPU and CUDA tensors (docs/migration.md). FairScale defines it only where its CUDA extension is
built; here one C kernel steps CPU parameters and its CUDA twin (csrc/cuda/fs_adam.cu) CUDA
ones, with the same bits.

Its update is not torch.optim.Adam's: eps is added to sqrt(v) (``eps_inside_sqrt``: to v under
the root) without bias correction, the bias corrections fold into one step size
``lr * sqrt(1 - beta2^t) / (1 - beta1^t)``, and ``weight_decay * p`` joins the update that step
size multiplies. The precision modes:

- ``FULL_PRECISION``: float32 parameters and state.
- ``MIXED_PRECISION``: half-precision parameters, a float32 master copy of each inside the
  optimizer (``fp32_param_groups``) that is stepped and copied back, float32 state.
- ``MEMORY_EFFICIENT_MIXED_PRECISION``: half-precision parameters stepped in float32 arithmetic,
  float32 state, no master copy.
- ``PURE_FP16``: float16 parameters and float16 state that holds the moments times an optimizer
  scale (2**16 at first). A moment that overflows float16 halves the scale and zeroes every
  state tensor (the step's parameter update is kept); 2000 steps without one double it, up to
  2**16. A scale below 1 raises RuntimeError.

Differences from FairScale's class: half-precision parameters may be bfloat16 as well as float16
for MIXED_PRECISION and MEMORY_EFFICIENT_MIXED_PRECISION (FairScale asserts float16; PURE_FP16
keeps that rule); each parameter group gets its own float32 master group, also one added later
with ``add_param_group`` (FairScale builds one, so a second group fails with IndexError); the
PURE_FP16 scale is updated once per step (FairScale updates it once per parameter group); the
state dict also carries the master weights; bad arguments raise ValueError or TypeError naming
them.
"""

from __future__ import annotations

import math
from enum import Enum, auto
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .. import _C

__all__ = ["Adam", "Precision"]


class Precision(Enum):
    FULL_PRECISION = auto()
    MIXED_PRECISION = auto()
    MEMORY_EFFICIENT_MIXED_PRECISION = auto()
    PURE_FP16 = auto()


_HALF = (torch.float16, torch.bfloat16)


def _check_hparams(lr: Any, betas: Any, eps: Any, weight_decay: Any) -> None:
    def number(name: str, v: Any) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise TypeError(f"Adam: argument '{name}' must be a finite number, got {v!r}")
        return float(v)

    if number("lr", lr) < 0:
        raise ValueError(f"Adam: argument 'lr' must be >= 0, got {lr}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise TypeError(f"Adam: argument 'betas' must be a pair of numbers, got {betas!r}")
    for i, b in enumerate(betas):
        if not 0.0 <= number(f"betas[{i}]", b) < 1.0:
            raise ValueError(f"Adam: argument 'betas[{i}]' must be in [0, 1), got {b}")
    if number("eps", eps) < 0:
        raise ValueError(f"Adam: argument 'eps' must be >= 0, got {eps}")
    if number("weight_decay", weight_decay) < 0:
        raise ValueError(f"Adam: argument 'weight_decay' must be >= 0, got {weight_decay}")


def _written_copy(t: torch.Tensor, copy_back: List[Tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """A contiguous copy of ``t`` (the kernels take contiguous tensors) for the step to write,
    listed in ``copy_back`` as (``t``, copy)."""
    c = t.contiguous()
    copy_back.append((t, c))
    return c


class Adam(torch.optim.Optimizer):
    """``Adam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
    eps_inside_sqrt=False, weight_decay=0.0, max_grad_norm=0.0, amsgrad=False, precision=None)``:
    fairscale.optim.Adam. ``precision=None`` infers FULL_PRECISION from float32 parameters and
    MIXED_PRECISION from half ones. ``max_grad_norm`` is kept in the groups and, as in FairScale,
    not used; ``amsgrad=True`` raises RuntimeError."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        bias_correction: bool = True,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        eps_inside_sqrt: bool = False,
        weight_decay: float = 0.0,
        max_grad_norm: float = 0.0,
        amsgrad: bool = False,
        precision: Optional[Precision] = None,
    ) -> None:
        # groups' "params" as lists: a generator would be used up by the dtype check below
        parameters: List[Any] = [
            {**p, "params": [p["params"]] if isinstance(p["params"], torch.Tensor) else list(p["params"])}
            if isinstance(p, dict)
            else p
            for p in params
        ]
        if not parameters:
            raise ValueError("Adam: argument 'params' is empty; expected parameters or parameter groups")
        _check_hparams(lr, betas, eps, weight_decay)
        if amsgrad:
            raise RuntimeError("FusedAdam does not support the AMSGrad variant.")
        first = parameters[0]["params"][0] if isinstance(parameters[0], dict) else parameters[0]
        if precision is None:
            precision = Precision.FULL_PRECISION if first.dtype == torch.float32 else Precision.MIXED_PRECISION
        if not isinstance(precision, Precision):
            raise TypeError(f"Adam: argument 'precision' must be a Precision or None, got {precision!r}")
        allowed = (torch.float16,) if precision is Precision.PURE_FP16 else _HALF
        if precision is not Precision.FULL_PRECISION and first.dtype not in allowed:
            raise TypeError(
                f"Adam: precision={precision.name} takes {' or '.join(map(str, allowed))} parameters, got {first.dtype}"
            )
        self.precision = precision
        self.optim_type = torch.float16 if precision is Precision.PURE_FP16 else torch.float32
        self._optim_scale = float(2**16) if precision is Precision.PURE_FP16 else 1.0
        self._steps_since_optim_scale_change = 0
        self._optim_scale_update_freq = 2000  # as torch's GradScaler's growth interval
        defaults = {
            "lr": lr,
            "bias_correction": bias_correction,
            "betas": betas,
            "eps": eps,
            "weight_decay": weight_decay,
            "max_grad_norm": max_grad_norm,
        }
        super().__init__(parameters, defaults)
        self.eps_mode = 0 if eps_inside_sqrt else 1
        self._flags: Dict[torch.device, torch.Tensor] = {}  # found_inf per device, kept between steps
        self.fp32_param_groups: List[Dict[str, Any]] = []
        if self.mixed_precision:
            self._build_fp32_params()

    def _build_fp32_params(self) -> None:
        """A float32 master copy of every parameter, one master group per parameter group."""
        for group in self.param_groups:
            self._add_master_group(group)

    def _add_master_group(self, group: Dict[str, Any]) -> None:
        masters = []
        for p in group["params"]:
            p32 = torch.nn.Parameter(p.detach().float().contiguous())
            p32.grad = torch.zeros_like(p32)
            masters.append(p32)
        self.fp32_param_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": masters})

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        """torch's add_param_group; with MIXED_PRECISION the new group gets its master copies too."""
        super().add_param_group(param_group)
        if self.mixed_precision and getattr(self, "fp32_param_groups", None) is not None:
            self._add_master_group(self.param_groups[-1])

    @property
    def supports_memory_efficient_fp16(self) -> bool:
        return True

    @property
    def _step_supports_amp_scaling(self) -> bool:
        return False

    @property
    def mixed_precision(self) -> bool:
        return self.precision is Precision.MIXED_PRECISION

    def state_dict(self) -> Dict[str, Any]:
        """torch's optimizer state dict plus ``optim_scale`` (as FairScale's) and, with
        MIXED_PRECISION, ``fp32_params``: the master weights per group (FairScale's state dict
        lacks them, so a reload restarts from the half-precision weights)."""
        d = super().state_dict()
        d["optim_scale"] = self._optim_scale
        if self.mixed_precision:
            d["fp32_params"] = [[p.detach().clone() for p in g["params"]] for g in self.fp32_param_groups]
        return d

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Loads what ``state_dict()`` gave (or FairScale's Adam's). The moments keep their saved
        values in the state dtype (torch's loader casts them to the parameter's dtype first, which
        FairScale's then casts back, losing precision)."""
        if "optim_scale" not in state_dict:
            raise ValueError("Adam.load_state_dict: argument 'state_dict' lacks 'optim_scale' (not an Adam state dict)")
        masters = state_dict.get("fp32_params")
        if masters is not None and self.mixed_precision:
            shapes = [[tuple(p.shape) for p in g["params"]] for g in self.fp32_param_groups]
            if [[tuple(t.shape) for t in g] for g in masters] != shapes:
                raise ValueError(
                    "Adam.load_state_dict: argument 'state_dict' holds master weights of other shapes than this "
                    "optimizer's parameters"
                )
        super().load_state_dict(state_dict)
        self._optim_scale = state_dict["optim_scale"]
        saved_ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for sid, p in zip(saved_ids, params):
            saved = state_dict["state"].get(sid, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in saved:
                    self.state[p][key] = saved[key].to(device=p.device, dtype=self.optim_type, copy=True)
        if self.mixed_precision:
            # without saved master weights (FairScale's state dicts, OSS's), they restart from the
            # parameters as they are now, not as they were when this optimizer was built
            for group, p_group, saved_group in zip(
                self.fp32_param_groups, self.param_groups, masters or [None] * len(self.param_groups)
            ):
                for p32, t in zip(group["params"], saved_group or p_group["params"]):
                    p32.data.copy_(t.detach())

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        """One step for every parameter with a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.precision is Precision.PURE_FP16:  # only its float16 moments set the flags
            for flag in self._flags.values():
                flag.zero_()
        stepped = set()
        for i, group in enumerate(self.param_groups):
            beta1, beta2 = group["betas"]
            # per device, the group's parameters stepped by one C call: param, grad, exp_avg,
            # exp_avg_sq, half copy, step count; a non-contiguous tensor goes in as a contiguous
            # copy that is copied back after the call
            batches: Dict[torch.device, List[List[Any]]] = {}
            copy_back: List[Tuple[torch.Tensor, torch.Tensor]] = []
            for j, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError(
                        "FusedAdam does not support sparse gradients, please consider SparseAdam instead"
                    )
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    self._zero_moments(p)
                state["step"] += 1
                param, copy = p, None
                if self.mixed_precision:
                    param, copy = self.fp32_param_groups[i]["params"][j], p
                if p.device not in self._flags:
                    self._flags[p.device] = torch.zeros(1, device=p.device)
                stepped.add(p.device)
                lists = batches.get(p.device)
                if lists is None:
                    lists = batches[p.device] = [[], [], [], [], [], []]
                # the binding takes no tensor that requires grad: the parameters' detached views
                param, grad = param.detach(), p.grad.detach() if p.grad.requires_grad else p.grad
                lists[0].append(param if param.is_contiguous() else _written_copy(param, copy_back))
                lists[1].append(grad if grad.is_contiguous() else grad.contiguous())
                lists[2].append(state["exp_avg"])
                lists[3].append(state["exp_avg_sq"])
                if copy is not None:
                    copy = copy.detach()
                    copy = copy if copy.is_contiguous() else _written_copy(copy, copy_back)
                lists[4].append(copy)
                lists[5].append(state["step"])
            for device, (params, grads, exp_avgs, exp_avg_sqs, copies, steps) in batches.items():
                kwargs = dict(
                    params=params,
                    grads=grads,
                    exp_avgs=exp_avgs,
                    exp_avg_sqs=exp_avg_sqs,
                    param_copies=copies if self.mixed_precision else None,
                    steps=steps,
                    found_inf=self._flags[device],
                    lr=group["lr"],
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    bias_correction=bool(group["bias_correction"]),
                    eps_inside_sqrt=self.eps_mode == 0,
                    grad_scale=1.0,
                    optim_scale=self._optim_scale,
                )
                if device.type == "cuda":
                    _C.cuda_fs_adam_multi(**kwargs, stream=torch.cuda.current_stream(device).cuda_stream)
                else:
                    _C.cpu_fs_adam_multi(**kwargs, threads=torch.get_num_threads())
            for dst, src in copy_back:
                dst.copy_(src)
        if self.precision is Precision.PURE_FP16 and stepped:
            self._update_optim_scale(any(bool(self._flags[d].item()) for d in stepped))
        return loss

    def _zero_moments(self, p: torch.Tensor) -> None:
        """Zeroed moments for ``p``, contiguous (as the kernels take them) whatever ``p``'s layout."""
        for key in ("exp_avg", "exp_avg_sq"):
            self.state[p][key] = torch.zeros_like(p, dtype=self.optim_type, memory_format=torch.contiguous_format)

    def _update_optim_scale(self, overflow: bool) -> None:
        if overflow:
            self._steps_since_optim_scale_change = 0
            self._optim_scale /= 2
            if self._optim_scale < 1.0:
                raise RuntimeError("Optimizer state scale < 1. This may mean that gradients are exploding")
            for group in self.param_groups:
                for p in group["params"]:
                    if "exp_avg" in self.state[p]:
                        self._zero_moments(p)
        else:
            self._steps_since_optim_scale_change += 1
        if self._steps_since_optim_scale_change == self._optim_scale_update_freq:
            self._steps_since_optim_scale_change = 0
            if self._optim_scale < 2**16:
                self._optim_scale *= 2
