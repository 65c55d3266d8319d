"""``@skippable`` modules: long skip connections that ``yield stash(...)`` and ``yield pop(...)``.

A skippable module's forward is a generator: ``yield stash(name, tensor)`` hands a tensor to the
skip connection, ``tensor = yield pop(name)`` receives one stashed earlier; the generator's
return value is the module's output. Each name is declared up front, and every name must be
stashed by exactly one layer and popped by exactly one later layer (``verify_skippables``).
Works without a Pipe too; inside one, a skip tensor may cross partitions (and devices).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, Callable, ClassVar, Dict, FrozenSet, Iterable, Iterator, List, Optional, Set, Tuple, Type

from torch import Tensor, nn

from .namespace import Namespace
from .tracker import current_skip_tracker

Key = Tuple[Namespace, str]


class stash:  # noqa: N801  (FairScale's name)
    """The command ``yield stash(name, tensor)``: put `tensor` (or None) into the skip connection."""

    __slots__ = ("name", "tensor")

    def __init__(self, name: str, tensor: Optional[Tensor]) -> None:
        self.name = name
        self.tensor = tensor


class pop:  # noqa: N801
    """The command ``tensor = yield pop(name)``: take the tensor stashed under `name`."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name


class Skippable(nn.Module):
    """Base class of the classes ``@skippable`` makes; the user's module is ``self.module``."""

    module_cls: ClassVar[Type[nn.Module]]
    stashable_names: ClassVar[FrozenSet[str]]
    poppable_names: ClassVar[FrozenSet[str]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.module = self.module_cls(*args, **kwargs)
        self.namespaces: Dict[str, Namespace] = {}

    def __repr__(self) -> str:
        return f"@skippable({self.module})"

    def namespaced(self, name: str) -> Key:
        return (self.namespaces.get(name), name)

    def stashable(self) -> Iterator[Key]:
        for name in sorted(self.stashable_names):
            yield self.namespaced(name)

    def poppable(self) -> Iterator[Key]:
        for name in sorted(self.poppable_names):
            yield self.namespaced(name)

    def isolate(self, ns: Namespace, *, only: Optional[Iterable[str]] = None) -> "Skippable":
        """Put this module's skip names (or those in `only`) into namespace `ns`; returns self."""
        names = (self.stashable_names | self.poppable_names) if only is None else set(only)
        for name in names:
            self.namespaces[name] = ns
        return self

    def _run(self, input: Any, on_stash: Callable[[str, Optional[Tensor]], None], on_pop: Callable[[str], Any]) -> Any:
        gen = self.module(input)
        if not isinstance(gen, Generator):
            return gen
        reply: Any = None
        try:
            while True:
                op = gen.send(reply)
                if isinstance(op, stash):
                    on_stash(op.name, op.tensor)
                    reply = None
                elif isinstance(op, pop):
                    reply = on_pop(op.name)
                else:
                    raise TypeError(f"{op!r} is not a command from @skippable (yield stash(...) or pop(...))")
        except StopIteration as stop:
            return stop.value

    def forward(self, input: Any) -> Any:  # type: ignore[override]
        tracker = current_skip_tracker()
        poppable: Dict[str, Optional[Tensor]] = {}
        for ns, name in self.poppable():
            try:
                poppable[name] = tracker.load(ns, name)
            except KeyError:
                raise RuntimeError(f"'{name}' has not been stashed") from None
        stashed: Dict[str, Optional[Tensor]] = {}

        def on_stash(name: str, tensor: Optional[Tensor]) -> None:
            if name not in self.stashable_names:
                raise RuntimeError(f"'{name}' has not been declared as stashable")
            stashed[name] = tensor

        def on_pop(name: str) -> Optional[Tensor]:
            if name not in self.poppable_names:
                raise RuntimeError(f"'{name}' has not been declared as poppable")
            return poppable.pop(name)

        output = self._run(input, on_stash, on_pop)
        missing = sorted(self.stashable_names - stashed.keys())
        if missing:
            raise RuntimeError(", ".join(f"'{n}'" for n in missing) + " must be stashed but have not")
        if poppable:
            raise RuntimeError(", ".join(f"'{n}'" for n in sorted(poppable)) + " must be popped but have not")
        for ns, name in self.stashable():
            tracker.save(ns, name, stashed[name])
        return output


def skippable(stash: Iterable[str] = (), pop: Iterable[str] = ()) -> Callable[[Type[nn.Module]], Type[Skippable]]:
    """Class decorator: the module may ``yield stash(name, t)`` for names in `stash` and
    ``t = yield pop(name)`` for names in `pop`."""
    stashable_names = frozenset(stash)
    poppable_names = frozenset(pop)

    def make(module_cls: Type[nn.Module]) -> Type[Skippable]:
        attrs = {"module_cls": module_cls, "stashable_names": stashable_names, "poppable_names": poppable_names}
        return type(module_cls.__name__, (Skippable,), attrs)

    return make


def verify_skippables(module: nn.Sequential) -> None:
    """TypeError listing every skip name that is not stashed once and popped once, later."""
    stashed: Set[Key] = set()
    popped: Set[Key] = set()
    problems: List[str] = []
    for layer_name, layer in module.named_children():
        if not isinstance(layer, Skippable):
            continue
        for name in sorted(layer.stashable_names & layer.poppable_names):
            problems.append(f"'{layer_name}' declared '{name}' both as stashable and as poppable")
        for key in layer.stashable():
            if key[1] in layer.poppable_names:
                continue
            if key in stashed:
                problems.append(f"'{layer_name}' redeclared '{key[1]}' as stashable but not isolated by namespace")
                continue
            stashed.add(key)
        for key in layer.poppable():
            if key[1] in layer.stashable_names:
                continue
            if key in popped:
                problems.append(f"'{layer_name}' redeclared '{key[1]}' as poppable but not isolated by namespace")
            elif key not in stashed:
                problems.append(f"'{layer_name}' declared '{key[1]}' as poppable but it was not stashed")
            else:
                popped.add(key)
    for _, name in sorted(stashed - popped, key=lambda k: k[1]):
        problems.append(f"no module declared '{name}' as poppable but stashed")
    if problems:
        raise TypeError("one or more pairs of stash and pop do not match:\n\n" + "\n".join(f"* {p}" for p in problems))
