"""fairscale_c.nn.misc — mirrors fairscale.nn.misc: FlattenParamsWrapper, the parameter and
gradient buckets, and the old import path of checkpoint_wrapper."""

from ..checkpoint import checkpoint_wrapper
from .flatten_params_wrapper import FlatParameter, FlattenParamsWrapper
from .param_bucket import GradBucket, ParamBucket

__all__ = ["checkpoint_wrapper", "FlatParameter", "FlattenParamsWrapper", "GradBucket", "ParamBucket"]
