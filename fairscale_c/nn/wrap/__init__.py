"""Wrapping utilities, as ``fairscale.nn.wrap``: ``enable_wrap``, ``wrap``, ``auto_wrap`` and wrap policies."""

from .auto_wrap import (
    ConfigAutoWrap,
    auto_wrap,
    config_auto_wrap_policy,
    default_auto_wrap_policy,
    enable_wrap,
    transformer_auto_wrap_policy,
    wrap,
)

__all__: list[str] = [
    "ConfigAutoWrap",
    "auto_wrap",
    "config_auto_wrap_policy",
    "default_auto_wrap_policy",
    "enable_wrap",
    "transformer_auto_wrap_policy",
    "wrap",
]
