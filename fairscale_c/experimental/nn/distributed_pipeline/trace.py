"""make_graph: a PipelineModulesGraph from a module whose forward only calls RemoteModules (and
indexes their tuple outputs), traced by torch.fx with RemoteModules as leaves."""

from __future__ import annotations

import inspect
import operator
from typing import Any, Dict, List, Optional, Tuple

import torch.fx
from torch import nn
from torch.distributed.nn import RemoteModule

from .graph import PipelineModulesGraph


class RemoteModuleTracer(torch.fx.Tracer):
    """Treats every RemoteModule as a leaf (a call, not traced into)."""

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return isinstance(m, RemoteModule)


def _trace(tracer: RemoteModuleTracer, module: nn.Module) -> torch.fx.Graph:
    # torch.fx walks named_modules / named_children, which RemoteModule refuses: use nn.Module's
    saved = RemoteModule.named_modules, RemoteModule.named_children
    RemoteModule.named_modules = nn.Module.named_modules  # type: ignore[method-assign]
    RemoteModule.named_children = nn.Module.named_children  # type: ignore[method-assign]
    try:
        return tracer.trace(module)
    finally:
        RemoteModule.named_modules, RemoteModule.named_children = saved  # type: ignore[method-assign]


def make_graph(module: nn.Module) -> PipelineModulesGraph:
    """The graph of ``module``'s forward: each RemoteModule call a layer, fed by forward's
    arguments (by position) and other calls' outputs (``out[i]`` picks an element of a tuple
    output). Anything else in forward is a ValueError naming it."""
    tracer = RemoteModuleTracer()
    fx_graph = _trace(tracer, module)
    arg_names = list(inspect.signature(module.forward).parameters)
    data: Dict[torch.fx.Node, Any] = {}
    calls: List[Tuple[torch.fx.Node, RemoteModule]] = []
    for node in fx_graph.nodes:
        if node.op == "call_module":
            target: Any = tracer.root
            for part in str(node.target).split("."):
                target = getattr(target, part)
            data[node] = target
            calls.append((node, target))
        elif (
            node.op == "call_function"
            and node.target is operator.getitem
            and isinstance(data.get(node.args[0]), RemoteModule)
        ):
            data[node] = (data[node.args[0]], node.args[1])
        elif node.op == "placeholder":
            data[node] = arg_names.index(str(node.target))
        elif node.op != "output":
            raise ValueError(
                f"make_graph: forward may only call RemoteModules and index their outputs, found {node.op} "
                f"{node.target}"
            )
    num_outputs: Dict[int, Optional[int]] = {}  # id(module) -> None (one tensor) or the tuple's length seen
    for node, _ in calls:
        for arg in node.args:
            source = data[arg]
            if isinstance(source, RemoteModule):
                num_outputs[id(source)] = None
            elif isinstance(source, tuple):
                producer, index = source
                num_outputs[id(producer)] = max(num_outputs.get(id(producer)) or 0, index + 1)
    graph = PipelineModulesGraph()
    for node, remote in calls:
        graph.add_layer(remote, [data[arg] for arg in node.args], num_outputs.get(id(remote)))
    return graph
