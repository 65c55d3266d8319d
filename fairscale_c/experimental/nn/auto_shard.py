"""shard_model: cut any traceable model into consecutive pieces of about equal parameter counts, as
fairscale.experimental.nn.auto_shard.shard_model (docs/experimental.md).

The model is traced with torch.fx; a submodule that cannot be traced on its own (data-dependent
control flow, say) is kept whole, as one call. The graph is then cut, in its order, only where a
single value crosses: the output of the node before the cut is the one thing the rest of the graph
needs from what came before it (parameters and buffers read with get_attr are no values: each piece
reads its own). Walking the nodes, a piece ends at the first such point once its parameters exceed
total / shard_count. So a piece's input is the previous piece's output, and running the pieces in
order computes what the model does.
"""

from __future__ import annotations

from typing import Any, Dict, List, Set

import torch
import torch.fx
from torch import nn
from ...internal.args import as_int


class _LeafTracer(torch.fx.Tracer):
    """torch.fx's tracer that also keeps the given submodules whole."""

    def __init__(self, leaves: Set[nn.Module]) -> None:
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, qualified_name: str) -> bool:
        return m in self.leaves or super().is_leaf_module(m, qualified_name)


def _trace(model: nn.Module) -> torch.fx.GraphModule:
    """The model's graph, with every submodule that fails to trace on its own as a leaf."""
    leaves: Set[nn.Module] = set()
    inside_leaves: Set[nn.Module] = set()  # parts of a leaf: never traced on their own
    for _, module in model.named_modules():
        tracer = _LeafTracer(leaves)
        if module is model or module in inside_leaves or tracer.is_leaf_module(module, ""):
            continue
        try:
            tracer.trace(module)
        except Exception:  # noqa: BLE001 - whatever stops tracing makes it a leaf
            leaves.add(module)
            inside_leaves.update(module.modules())
    return torch.fx.GraphModule(model, _LeafTracer(leaves).trace(model))


def _param_counts(gm: torch.fx.GraphModule, nodes: List[torch.fx.Node]) -> List[int]:
    """Parameters each node brings in, each parameter counted at its first use only."""
    seen: Set[int] = set()
    counts = []
    for node in nodes:
        params: List[torch.Tensor] = []
        if node.op == "call_module":
            params = list(gm.get_submodule(node.target).parameters())
        elif node.op == "get_attr":
            value = gm
            for part in str(node.target).split("."):
                value = getattr(value, part)
            params = [value] if isinstance(value, nn.Parameter) else []
        fresh = [p for p in params if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        counts.append(sum(p.numel() for p in fresh))
    return counts


def _cut_points(nodes: List[torch.fx.Node], counts: List[int], shard_count: int) -> List[int]:
    """Indices i after which to cut: one value crosses there, and the piece so far holds more than
    its share of the parameters. At most shard_count - 1, never after the last computing node."""
    position = {node: i for i, node in enumerate(nodes)}
    last_use = {}
    for node in nodes:
        if node.op != "get_attr":
            last_use[node] = max((position[u] for u in node.users), default=position[node])
    computing = {i for i, n in enumerate(nodes) if n.op not in ("placeholder", "get_attr", "output")}
    if not computing:
        return []
    last_computing = max(computing)
    budget = sum(counts) // shard_count
    cuts: List[int] = []
    held, open_values = 0, set()  # values defined so far that later nodes still read
    for i, node in enumerate(nodes):
        if node.op == "output":
            break
        held += counts[i]
        if node.op != "get_attr":
            open_values.add(node)
        open_values = {v for v in open_values if last_use[v] > i}
        crossing = open_values - {node}
        if held > budget and not crossing and i in computing and i < last_computing and len(cuts) < shard_count - 1:
            cuts.append(i)
            held = 0
    return cuts


def _build(gm: torch.fx.GraphModule, nodes: List[torch.fx.Node], start: int, stop: int, first: bool) -> Any:
    """The piece of nodes[start:stop] as a GraphModule over the original model's submodules."""
    graph = torch.fx.Graph()
    env: Dict[torch.fx.Node, torch.fx.Node] = {}
    if not first:
        env[nodes[start - 1]] = graph.placeholder("input")

    def lookup(n: torch.fx.Node) -> torch.fx.Node:
        if n not in env and n.op == "get_attr":  # each piece reads its parameters and buffers itself
            env[n] = graph.node_copy(n, lookup)
        return env[n]

    for node in nodes[start:stop]:
        if node.op == "placeholder" and not first:
            continue
        if node.op == "output":
            graph.output(torch.fx.map_arg(node.args[0], lookup))
            break
        env[node] = graph.node_copy(node, lookup)
    else:
        graph.output(env[nodes[stop - 1]])
    return torch.fx.GraphModule(gm, graph)


def shard_model(model: nn.Module, shard_count: int = 3) -> List[torch.fx.GraphModule]:
    """``model`` cut into at most ``shard_count`` consecutive pieces (torch.fx GraphModules sharing
    the model's parameters) of about ``total / shard_count`` parameters each, for pipeline stages:
    the first piece takes the model's inputs, each next one the previous one's output, and the last
    returns what the model returns. Where no value crosses alone (a skip connection spanning
    layers), there is no cut, so there may be fewer pieces."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"shard_model: argument 'model' must be an nn.Module, got {type(model).__name__}")
    if as_int(shard_count) is None or shard_count < 1:
        raise ValueError(f"shard_model: argument 'shard_count' must be an int >= 1, got {shard_count!r}")
    shard_count = as_int(shard_count)
    gm = _trace(model)
    nodes = list(gm.graph.nodes)
    cuts = _cut_points(nodes, _param_counts(gm, nodes), shard_count)
    bounds = [0] + [c + 1 for c in cuts] + [len(nodes)]
    return [_build(gm, nodes, a, b, a == 0) for a, b in zip(bounds, bounds[1:])]


__all__ = ["shard_model"]
