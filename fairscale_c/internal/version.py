"""torch_version: torch's version as a tuple of ints, as FairScale's helper parses it."""

from __future__ import annotations

import logging
import re
from typing import Tuple

import torch

__all__ = ["torch_version"]

_VERSION = re.compile(r"^(\d+)\.(\d+)\.(\d+)([^+]*)(\+\S*)?$")


def torch_version(version: str = torch.__version__) -> Tuple[int, ...]:
    """(major, minor, patch) of a version string such as "2.13.0+cpu" or "1.8.0a0fb"; () when it
    does not parse. A pre-release suffix is logged as a warning and ignored."""
    found = _VERSION.search(version)
    if not found:
        return tuple()
    if found.group(4):
        logging.warning(f"Pytorch pre-release version {version} - assuming intent to test it")
    return tuple(int(found.group(i)) for i in (1, 2, 3))
