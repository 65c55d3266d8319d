"""fairscale_c.nn.pipe — mirrors fairscale.nn.pipe: Pipe (GPipe in one process), skip
connections (``.skip``) and balance helpers (``.balance``)."""

from ..checkpoint import is_checkpointing, is_recomputing
from .pipe import Pipe

__all__ = ["Pipe", "is_checkpointing", "is_recomputing"]
