"""FSDPConfig: Tango's FSDP options plus ``compute_dtype`` and ``buffer_dtype``."""

from dataclasses import asdict, dataclass
from typing import Any, Dict, Optional

import torch
from tango.common import FromParams

from fairscale_c.nn.data_parallel import FullyShardedDataParallel as FSDP

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


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
      file writes it); with ``mixed_precision`` and no ``compute_dtype``, the engine uses its AMP
      dtype (bfloat16 on CPU), so bf16 autocast and FSDP's mixed precision agree;
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
        kwargs["compute_dtype"] = _dtype("compute_dtype", self.compute_dtype)
        kwargs["buffer_dtype"] = _dtype("buffer_dtype", self.buffer_dtype)
        return kwargs

    def wrap(self, module: torch.nn.Module) -> FSDP:
        """``module`` in a FullyShardedDataParallel built with these options."""
        return FSDP(module, **self.as_kwargs())
