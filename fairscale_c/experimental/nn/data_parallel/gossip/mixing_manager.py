"""Mixing weights for gossip: how much of its message a rank keeps ("lo") and how much it sends
to each out-peer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Dict, Optional, Union

import torch

from .graph_manager import GraphManager


class MixingManager(ABC):
    def __init__(self, graph: GraphManager, device: Optional[torch.device]) -> None:
        if not isinstance(graph, GraphManager):
            raise TypeError(
                f"{type(self).__name__}: argument 'graph' must be a GraphManager, got {type(graph).__name__}"
            )
        self.graph_manager = graph
        self.device = device

    def is_regular(self) -> bool:
        """Whether no bias builds up in a rank's own entry of the mixing matrix's stationary
        distribution (then the push-sum weight need not travel with the messages)."""
        return self.graph_manager.is_regular_graph() and self.is_uniform()

    @abstractmethod
    def is_uniform(self) -> bool:
        """Whether every out-peer gets the same weight."""

    @abstractmethod
    def get_mixing_weights(self, residual_adjusted: bool = True) -> Dict[Union[str, int], torch.Tensor]:
        """{"lo": own weight, "uniform": weight of every out-peer (uniform managers), out-peer
        rank: its weight}; with ``residual_adjusted`` the out-peers' weights are divided by "lo"."""


class UniformMixing(MixingManager):
    """Each of the k out-peers and the rank itself get 1 / (k + 1)."""

    def get_mixing_weights(self, residual_adjusted: bool = True) -> Dict[Union[str, int], torch.Tensor]:
        out_peers, _ = self.graph_manager.get_peers()
        lo = torch.tensor([1.0 / (len(out_peers) + 1.0)], device=self.device)
        each = lo / lo if residual_adjusted else lo
        weights: Dict[Union[str, int], torch.Tensor] = {"lo": lo.clone(), "uniform": each.clone()}
        for peer in out_peers:
            weights[peer] = each.clone()
        return weights

    def is_uniform(self) -> bool:
        return True
