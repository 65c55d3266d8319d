"""fairscale_c.nn.misc — the part of fairscale.nn.misc that is provided: FlattenParamsWrapper and
the old import path of checkpoint_wrapper (GradBucket and ParamBucket are not)."""

from ..checkpoint import checkpoint_wrapper
from .flatten_params_wrapper import FlatParameter, FlattenParamsWrapper

__all__ = ["checkpoint_wrapper", "FlatParameter", "FlattenParamsWrapper"]
