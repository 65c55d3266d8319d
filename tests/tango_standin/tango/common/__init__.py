"""Tango's Registrable, FromParams and Lazy, reduced to what the engine contract uses."""

from typing import Any, Callable, Dict, Generic, TypeVar

T = TypeVar("T")


class FromParams:
    pass


class Registrable(FromParams):
    _registry: Dict[type, Dict[str, Any]] = {}
    default_implementation = None

    @classmethod
    def register(cls, name: str) -> Callable:
        def add(thing: Any) -> Any:
            Registrable._registry.setdefault(cls, {})[name] = thing
            return thing

        return add

    @classmethod
    def by_name(cls, name: str) -> Any:
        return Registrable._registry[cls][name]


class Lazy(Generic[T]):
    def __init__(self, constructor: Callable, **kwargs: Any) -> None:
        self.constructor, self.kwargs = constructor, kwargs

    def construct(self, **kwargs: Any) -> Any:
        return self.constructor(**{**self.kwargs, **kwargs})
