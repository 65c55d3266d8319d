"""Namespaces that keep skip tensors of the same name apart."""

from __future__ import annotations

import abc
import uuid
from functools import total_ordering
from typing import Any


@total_ordering
class Namespace(metaclass=abc.ABCMeta):  # noqa: B024 (abstract only to register None)
    """A namespace for :meth:`Skippable.isolate`; ``None`` is the default namespace."""

    __slots__ = ("id",)

    def __init__(self) -> None:
        self.id = uuid.uuid4()

    def __repr__(self) -> str:
        return f"<Namespace '{self.id}'>"

    def __hash__(self) -> int:
        return hash(self.id)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Namespace) and self.id == other.id

    def __lt__(self, other: Any) -> bool:
        return isinstance(other, Namespace) and self.id < other.id


# Layouts sort (namespace, name) keys, so the default namespace must compare with Namespace objects.
Namespace.register(type(None))
