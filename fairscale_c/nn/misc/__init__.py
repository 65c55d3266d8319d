"""fairscale_c.nn.misc — the part of fairscale.nn.misc that is provided: the old import path of
checkpoint_wrapper (FlattenParamsWrapper, GradBucket and ParamBucket are not)."""

from ..checkpoint import checkpoint_wrapper

__all__ = ["checkpoint_wrapper"]
