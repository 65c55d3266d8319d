"""State-dict helpers of fairscale.internal.state_dict."""

from __future__ import annotations

from typing import Dict, List, Tuple, Type

from torch import Tensor, nn

__all__ = ["find_module_instances", "replace_by_prefix_"]


def find_module_instances(module: nn.Module, search_class: Type[nn.Module]) -> List[Tuple[str, nn.Module]]:
    """(state-dict prefix, module) of every instance of `search_class` in `module`, itself included
    (prefix ""), in depth-first order: e.g. [("1.ln.", LayerNorm(...)), ("2.", LayerNorm(...))]."""
    found: List[Tuple[str, nn.Module]] = []

    def visit(m: nn.Module, prefix: str) -> None:
        if isinstance(m, search_class):
            found.append((prefix, m))
        for name, child in m.named_children():
            visit(child, prefix + name + ".")

    visit(module, "")
    return found


def replace_by_prefix_(state_dict: Dict[str, Tensor], old_prefix: str, new_prefix: str) -> None:
    """In place: every key starting with `old_prefix` starts with `new_prefix` instead (moved to the
    end of the dict's order)."""
    if old_prefix == new_prefix:
        raise ValueError("old_prefix and new_prefix must be distinct")
    for key in [k for k in state_dict if k.startswith(old_prefix)]:
        state_dict[new_prefix + key[len(old_prefix) :]] = state_dict.pop(key)
