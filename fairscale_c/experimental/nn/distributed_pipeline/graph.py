"""PipelineModulesGraph: RemoteModules and which model inputs or module outputs feed each.

Partitions are the graph cut into chains: a chain grows while its last module has one output
consumed by exactly one module, which takes that as its only input and lives on the same worker
and device; a chain of several modules runs as one MultiInputSequential on its worker."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Set, Tuple, Union

from torch import Tensor, nn
from torch.distributed import rpc
from torch.distributed.nn import RemoteModule

from .data import DataConsumer


class MultiInputSequential(nn.Module):
    """nn.Sequential whose first module takes several inputs."""

    def __init__(self, *modules: nn.Module) -> None:
        super().__init__()
        self.modules_list = nn.ModuleList(modules)

    def forward(self, *inputs: Tensor) -> Any:  # type: ignore[override]
        out = self.modules_list[0](*inputs)
        for module in self.modules_list[1:]:
            out = module(out)
        return out


def RemoteSequential(rref_list: List[rpc.RRef]) -> MultiInputSequential:
    """On the worker that owns them: the modules of ``rref_list`` in a MultiInputSequential."""
    return MultiInputSequential(*(r.local_value() for r in rref_list))


@dataclass
class DataSource:
    producer: Optional["Node"]  # None: a model input
    output_idx: int  # which output of the producer, or which model input


NodeDataConsumer = DataConsumer["Node"]


class Node:
    def __init__(self, module: RemoteModule) -> None:
        self.module = module
        self.num_outputs: Optional[int] = None
        self.inputs: List[DataSource] = []
        self.output_consumers: List[NodeDataConsumer] = []


class PipelineModulesGraph(nn.Module):
    """RemoteModules connected by the model inputs and module outputs each one takes (FairScale's
    API: ``add_layer``, ``add_sequence``). An input is given as an int (that model input), a
    RemoteModule (its output) or (RemoteModule, index) (that element of its tuple output); a
    module's inputs must come from model inputs or modules added before it."""

    DataSourceSpec = Union[int, RemoteModule, Tuple[RemoteModule, int]]

    def __init__(self) -> None:
        super().__init__()
        self.nodes: List[Node] = []

    def _find_node(self, module: RemoteModule) -> Node:
        for n in self.nodes:
            if n.module is module:
                return n
        raise ValueError(
            f"PipelineModulesGraph: an input names a RemoteModule (on {module.on}) that is not in the graph "
            "(add it before the modules it feeds)"
        )

    def _data_source_spec_to_data_source(self, spec: "PipelineModulesGraph.DataSourceSpec") -> DataSource:
        if isinstance(spec, bool) or not isinstance(spec, (int, RemoteModule, tuple)):
            raise TypeError(
                f"PipelineModulesGraph: an input must be an int, a RemoteModule or (RemoteModule, int), got {spec!r}"
            )
        if isinstance(spec, int):
            if spec < 0:
                raise ValueError(f"PipelineModulesGraph: a model input index must be >= 0, got {spec}")
            return DataSource(None, spec)
        if isinstance(spec, RemoteModule):
            return DataSource(self._find_node(spec), 0)
        module, index = spec
        return DataSource(self._find_node(module), int(index))

    def add_layer(
        self,
        module: RemoteModule,
        inputs: List["PipelineModulesGraph.DataSourceSpec"],
        num_outputs: Optional[int] = None,
    ) -> None:
        """Add ``module``, fed by ``inputs``; ``num_outputs``: the length of its tuple output
        (None for one tensor)."""
        if not isinstance(module, RemoteModule):
            raise TypeError(
                f"PipelineModulesGraph.add_layer: argument 'module' must be a RemoteModule, got {type(module).__name__}"
            )
        node = Node(module)
        node.inputs = [self._data_source_spec_to_data_source(spec) for spec in inputs]
        node.num_outputs = num_outputs
        self.nodes.append(node)

    def add_sequence(
        self,
        modules: List[RemoteModule],
        first_module_inputs: List["PipelineModulesGraph.DataSourceSpec"],
        last_module_num_outputs: Optional[int] = None,
    ) -> None:
        """Add ``modules`` one after another, each fed by the previous one's output and the first by
        ``first_module_inputs``."""
        next_input = first_module_inputs
        for i, module in enumerate(modules):
            self.add_layer(module, next_input, last_module_num_outputs if i == len(modules) - 1 else None)
            next_input = [module]

    def _compile(self) -> None:
        """model_input_consumers and each node's output_consumers."""
        self.model_input_consumers: List[NodeDataConsumer] = []
        for node in self.nodes:
            node.output_consumers = []
        for node in self.nodes:
            for input_index, source in enumerate(node.inputs):
                consumer = NodeDataConsumer(node, input_index, source.output_idx)
                if source.producer is not None:
                    source.producer.output_consumers.append(consumer)
                else:
                    self.model_input_consumers.append(consumer)

    def _trace_modules(self, node: Node) -> List[Node]:
        """The chain of modules that starts at ``node`` (see the module docstring)."""
        chain = [node]
        current = node
        while len(current.output_consumers) == 1 and current.num_outputs is None:
            nxt = current.output_consumers[0].consumer
            if len(nxt.inputs) != 1 or nxt.inputs[0].producer is not current or nxt.inputs[0].output_idx != 0:
                break
            if nxt.module.on != current.module.on or nxt.module.device != current.module.device:
                break
            chain.append(nxt)
            current = nxt
        return chain

    def partition_graph(self) -> List[Tuple[List[Node], rpc.RRef]]:
        """The chains, in graph order, each with an RRef to the module that runs it (the module
        itself for a chain of one)."""
        if not self.nodes:
            raise ValueError("PipelineModulesGraph: the graph has no modules")
        self._compile()
        used: Set[Node] = set()
        partitions = []
        for node in self.nodes:
            if node in used:
                continue
            chain = self._trace_modules(node)
            used.update(chain)
            if len(chain) == 1:
                module_rref = chain[0].module.get_module_rref()
            else:
                module_rref = rpc.remote(
                    chain[0].module.on, RemoteSequential, args=([n.module.get_module_rref() for n in chain],)
                )
            partitions.append((chain, module_rref))
        return partitions
