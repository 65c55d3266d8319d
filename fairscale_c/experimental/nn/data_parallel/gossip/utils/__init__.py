"""Helpers of the gossip package: flattening, grouping by dtype, logging, process groups."""

from .helpers import (
    MultiProcessAdapter,
    as_flat,
    communicate,
    create_process_group,
    flatten_tensors,
    group_by_dtype,
    make_logger,
    unflatten_tensors,
)

__all__ = [
    "MultiProcessAdapter",
    "as_flat",
    "communicate",
    "create_process_group",
    "flatten_tensors",
    "group_by_dtype",
    "make_logger",
    "unflatten_tensors",
]
