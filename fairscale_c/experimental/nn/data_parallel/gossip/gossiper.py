"""Gossipers: one gossip step sends a rank's (weighted) message to its out-peers of the iteration
and sums what its in-peers sent.

Every step's sends and receives go to the engine in one point-to-point batch on the gossip group,
so a step cannot deadlock whatever the graph: there is no send-first / receive-first order to get
right (FairScale orders bipartite graphs' broadcasts by passive and active ranks for that)."""

from __future__ import annotations

import logging
from enum import Enum
from typing import Any, Iterator, List, Optional, Tuple

import torch

from .....distributed import P2POp, group_for
from .graph_manager import GraphManager
from .mixing_manager import MixingManager, UniformMixing


class dist_backend(str, Enum):
    UNDEFINED = "undefined"
    TCP = "tcp"
    MPI = "mpi"
    GLOO = "gloo"
    NCCL = "nccl"


class Gossiper:
    """Gossip averaging over a peer graph.

    Args:
        msg: a message like the ones to be mixed (1-D); sets the receive buffer's size and dtype.
        graph: the peer graph (a :class:`GraphManager`); its edges name ranks of ``group``.
        device: where the receive buffer lives (default: ``msg``'s device).
        mixing: the mixing weights (default: :class:`UniformMixing` over ``graph``).
        logger: where to log each step's peers (at DEBUG level), if given.
        rank, world_size: this process's rank and the number of processes (default: ``group``'s).
        group: keyword only, the torch process group (or engine group) the messages travel on
            (default: the default process group).
    """

    def __init__(
        self,
        msg: torch.Tensor,
        graph: GraphManager,
        device: Optional[torch.device] = None,
        mixing: Optional[MixingManager] = None,
        logger: Optional[logging.Logger] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        *,
        group: Any = None,
    ) -> None:
        name = type(self).__name__
        if not isinstance(msg, torch.Tensor) or msg.dim() != 1:
            raise ValueError(f"{name}: argument 'msg' must be a 1-D tensor, got {_describe(msg)}")
        if not isinstance(graph, GraphManager):
            raise TypeError(f"{name}: argument 'graph' must be a GraphManager, got {type(graph).__name__}")
        self._group = group if hasattr(group, "batch") else group_for(group, argument=f"{name}: argument 'group'")
        self.rank = self._group.rank if rank is None else int(rank)
        self.world_size = self._group.size if world_size is None else int(world_size)
        self.logger = logger
        self._graph_manager = graph
        self.device = torch.device(device) if device is not None else msg.device
        self.peers_per_itr_device = torch.tensor([graph.peers_per_itr], device=self.device, dtype=msg.dtype)
        self.passive = graph.is_passive()
        self.refresh_peers_(rotate=False)
        if mixing is None:
            mixing = UniformMixing(graph, self.device)
        if not isinstance(mixing, MixingManager):
            raise TypeError(f"{name}: argument 'mixing' must be a MixingManager, got {type(mixing).__name__}")
        self._mixing_manager = mixing
        self.refresh_mixing_weights_()
        self.regular = mixing.is_regular()  # then the push-sum weight need not travel
        self.out_msg_buffer: List[Tuple[Any, torch.Tensor]] = []
        self._ps_weight = torch.ones(1, dtype=msg.dtype, device=self.device)
        size = msg.numel() + (0 if self.regular else 1)
        self.in_msg_buffer = torch.empty(size, dtype=msg.dtype, device=self.device)
        self.in_msg_buffer[: msg.numel()].copy_(msg)
        if not self.regular:
            self.in_msg_buffer[-1:].copy_(self._ps_weight)
        self.placeholder = self.in_msg_buffer.clone()
        self._extra: List[torch.Tensor] = []  # receive buffers of in-edges after the first

    @property
    def ps_weight(self) -> torch.Tensor:
        return self._ps_weight

    @ps_weight.setter
    def ps_weight(self, v: Any) -> None:
        self._ps_weight.data[0] = v

    @property
    def peers_per_itr(self) -> int:
        return self._graph_manager.peers_per_itr

    @peers_per_itr.setter
    def peers_per_itr(self, v: int) -> None:
        self._graph_manager.peers_per_itr = v

    def refresh_peers_(self, rotate: Optional[bool] = None) -> None:
        """Take this iteration's in- and out-edges from the graph; ``rotate`` (default: whether the
        graph is dynamic) moves on to the next peers first."""
        dynamic = self._graph_manager.is_dynamic_graph()
        if rotate is None:
            rotate = dynamic
        if rotate and not dynamic:
            raise ValueError(f"{type(self).__name__}.refresh_peers_: a static graph's peers cannot rotate")
        self.out_edges, self.in_edges = self._graph_manager.get_edges(rotate)

    def refresh_mixing_weights_(self, residual_adjusted: bool = False) -> None:
        self.mixing_weights = self._mixing_manager.get_mixing_weights(residual_adjusted)

    def mix_out_msg_(self, out_msg: torch.Tensor, ps_weight: torch.Tensor) -> Iterator[torch.Tensor]:
        """The messages for this iteration's out-edges, in order: ``out_msg`` (with the push-sum
        weight appended where the mixing is not regular) scaled by each out-peer's weight; with
        uniform weights ``out_msg`` itself is scaled in place and sent to every out-peer."""
        self.refresh_mixing_weights_(residual_adjusted=True)
        self.ps_weight = ps_weight
        if not self.regular:
            out_msg = torch.cat([out_msg, self.ps_weight.to(out_msg.dtype)])
        if self._mixing_manager.is_uniform():
            weight = self.mixing_weights["uniform"]
            if weight.device.type != "cpu" or weight.item() != 1.0:  # times one changes no value
                out_msg *= weight.to(out_msg.dtype)
            for _ in self.out_edges:
                yield out_msg
        else:
            for edge in self.out_edges:
                yield out_msg.mul(self.mixing_weights[edge.dest].to(out_msg.dtype))

    def clean_msg_buffers_(self) -> None:
        """Wait for sends still in flight and drop their messages."""
        while self.out_msg_buffer:
            work, msg = self.out_msg_buffer.pop()
            if work is not None:
                work.wait()
            msg.set_()

    def parse_in_msg_buffer(self) -> Tuple[torch.Tensor, torch.Tensor]:
        """(sum of the received messages, their push-sum weight)."""
        msg = self.in_msg_buffer
        if not self.regular:
            return msg.narrow(0, 0, len(msg) - 1), msg[-1]
        return msg, self.ps_weight * self.peers_per_itr_device

    def mix(self, out_msg: torch.Tensor, ps_weight: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """One gossip step: returns (sum of the in-peers' messages, their push-sum weight)."""
        if not isinstance(out_msg, torch.Tensor) or out_msg.device.type != self.device.type:
            raise ValueError(
                f"{type(self).__name__}.mix: argument 'out_msg' must be a tensor on {self.device.type}, "
                f"got {_describe(out_msg)}"
            )
        if self.logger is not None:
            self.logger.debug("in/out -peers %s/%s", self.in_edges, self.out_edges)
        messages = self.mix_out_msg_(out_msg, ps_weight)
        ops = []
        for edge in self.out_edges:
            if edge.src != self.rank:
                raise ValueError(f"{type(self).__name__}.mix: out-edge {edge} does not start at rank {self.rank}")
            ops.append(P2POp("send", next(messages), edge.dest))
        receive = self._receive_buffers(len(self.in_edges))
        ops += [P2POp("recv", buf, edge.src) for buf, edge in zip(receive, self.in_edges)]
        if ops:
            self._group.batch(ops)
        if len(receive) != 1:
            self.in_msg_buffer.zero_()
            for buf in receive:
                self.in_msg_buffer.add_(buf)
        self.refresh_peers_()
        self.clean_msg_buffers_()
        return self.parse_in_msg_buffer()

    def _receive_buffers(self, count: int) -> List[torch.Tensor]:
        """One buffer per in-edge: the in-message buffer itself for a single in-edge, else the
        placeholder and extra buffers kept from step to step."""
        if count == 1:
            return [self.in_msg_buffer]
        while len(self._extra) < count - 1:
            self._extra.append(torch.empty_like(self.placeholder))
        return ([self.placeholder] + self._extra)[:count]


class PushSum(Gossiper):
    """Push-sum consensus averaging: each rank pushes its weighted message to its out-peers."""


class PushPull(Gossiper):
    """Doubly-stochastic averaging: each rank exchanges messages with its peers of the iteration."""


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dim()}-D {x.dtype} tensor on {x.device}"
    return type(x).__name__


__all__ = ["Gossiper", "PushSum", "PushPull", "dist_backend"]
