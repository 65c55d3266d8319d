"""FSDPConfig: Tango's FSDP options plus ``compute_dtype`` and ``buffer_dtype``."""

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterator, Optional

import torch
from tango.common import FromParams

from fairscale_c.nn.data_parallel import FullyShardedDataParallel as FSDP

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# The AMP dtype of the engine constructing the model: the compute dtype of FSDP instances built
# meanwhile with mixed_precision and no compute_dtype (inner instances of with_wrapped_modules).
_ENGINE_AMP_DTYPE: ContextVar[Optional[str]] = ContextVar("fairscale_c_tango_amp_dtype", default=None)


@contextmanager
def amp_dtype_while_constructing(name: Optional[str]) -> Iterator[None]:
    """While the engine constructs the model: FSDPConfig.wrap() with ``mixed_precision`` and no
    ``compute_dtype`` computes in ``name`` (the engine's AMP dtype; None: FSDP's default)."""
    token = _ENGINE_AMP_DTYPE.set(name)
    try:
        yield
    finally:
        _ENGINE_AMP_DTYPE.reset(token)


def _dtype(name: str, value: Optional[str]) -> Optional[torch.dtype]:
    if value is None:
        return None
    if not isinstance(value, str) or value not in _DTYPES:
        raise ValueError(f"FSDPConfig: '{name}' must be one of {sorted(_DTYPES)} or null, got {value!r}")
    return _DTYPES[value]


@dataclass
class FSDPConfig(FromParams):
    """The options of :class:`~fairscale_c.nn.FullyShardedDataParallel` a Tango config sets.

    Tango's ``tango.integrations.fairscale.FSDPConfig`` fields, with the same defaults, plus:

    - ``compute_dtype``: ``"float32"``, ``"float16"`` or ``"bfloat16"`` (a string, as a config
      file writes it); with ``mixed_precision`` and no ``compute_dtype``, FSDP computes in the AMP
      dtype of the ``"fairscale_c"`` engine with ``amp`` (bfloat16 on CPU), so bf16 autocast and
      FSDP's mixed precision agree: the engine's own instance, and the inner ones that
      ``fairscale_c::with_wrapped_modules`` builds while the engine constructs the model;
      otherwise in float16, FairScale's default;
    - ``buffer_dtype``: as FairScale's (default: the compute dtype).
    """

    reshard_after_forward: bool = True
    move_params_to_cpu: bool = False
    move_grads_to_cpu: Optional[bool] = None
    mixed_precision: bool = False
    compute_dtype: Optional[str] = None
    buffer_dtype: Optional[str] = None

    def __post_init__(self) -> None:
        _dtype("compute_dtype", self.compute_dtype)
        _dtype("buffer_dtype", self.buffer_dtype)

    def as_kwargs(self) -> Dict[str, Any]:
        """The keyword arguments of FullyShardedDataParallel, dtypes as torch dtypes."""
        kwargs = asdict(self)
        compute = self.compute_dtype
        if compute is None and self.mixed_precision:
            compute = _ENGINE_AMP_DTYPE.get()
        kwargs["compute_dtype"] = _dtype("compute_dtype", compute)
        kwargs["buffer_dtype"] = _dtype("buffer_dtype", self.buffer_dtype)
        return kwargs

    def wrap(self, module: torch.nn.Module) -> FSDP:
        """``module`` in a FullyShardedDataParallel built with these options."""
        return FSDP(module, **self.as_kwargs())
