"""Stochastic gradient push for SlowMoDistributedDataParallel: the push-sum weight, the
parameters as push-sum numerators or de-biased estimates, and one gossip step (send this rank's
numerators to its peers of the iteration, add theirs).

With regular mixing (the default graphs and uniform weights) the mixing is lazy: the received
numerators are added and the sum scaled by the rank's own weight on arrival, and the parameters
never need scaling by the push-sum weight, which stays 1."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import nn

from .gossiper import Gossiper, PushPull, PushSum
from .graph_manager import GraphManager
from .graph_manager import NPeerDynamicDirectedExponentialGraph as NPDDEGraph
from .mixing_manager import MixingManager, UniformMixing
from .utils import as_flat, flatten_tensors, make_logger, unflatten_tensors

_NAME = "SlowMoDistributedDataParallel"


class SGPMixin:
    """SlowMoDistributedDataParallel's SGP methods (FairScale's names). The class using it sets
    module, logger, dist_config, process_rank, nprocs_per_node, logical_rank,
    logical_world_size and _global_comm before calling :meth:`_sgp_init`."""

    module: nn.Module
    logger: Any
    dist_config: Dict[str, Any]
    process_rank: int
    nprocs_per_node: int
    logical_rank: int
    logical_world_size: int
    local_rank: int
    _global_comm: Any

    def _param_buffers(self) -> List[List[torch.Tensor]]:
        raise NotImplementedError  # SlowMoDistributedDataParallel's: the parameters, per dtype

    def _sgp_init(
        self,
        module: nn.Module,
        first_param_dtype: torch.dtype,
        comm_device: torch.device,
        graph: Optional[GraphManager],
        mixing: Optional[MixingManager],
        push_sum: bool,
        synch_freq: int,
    ) -> None:
        if graph is None:
            graph = NPDDEGraph(self.logical_rank, self.logical_world_size, self.nprocs_per_node, self.local_rank)
        elif not isinstance(graph, GraphManager):
            raise TypeError(f"{_NAME}: argument 'graph' must be a GraphManager, got {type(graph).__name__}")
        if mixing is None:
            mixing = UniformMixing(graph, comm_device)
        elif not isinstance(mixing, MixingManager):
            raise TypeError(f"{_NAME}: argument 'mixing' must be a MixingManager, got {type(mixing).__name__}")
        self.dist_config.update({"graph": graph, "mixing": mixing, "push_sum": push_sum})
        self.synch_freq = synch_freq
        self.asynch = self.synch_freq > 0
        self.ps_weight = torch.ones(1, device=comm_device, dtype=first_param_dtype)
        self.is_sgp_ps_numerator = False
        self.gossip_enable = True
        self.gossiping = False
        self.params_mixed = True
        self.gossip_ps_factor = torch.zeros(1, device=comm_device, dtype=first_param_dtype)
        self.gossip_ps_weight = self.ps_weight.clone()
        self._gossipers: Dict[torch.dtype, Gossiper] = {}
        self._received: List[Tuple[List[torch.Tensor], torch.Tensor]] = []
        if self.process_rank % self.nprocs_per_node == 0:
            cls = PushSum if push_sum else PushPull
            logger = make_logger(self.logical_rank, self.dist_config["verbose"])
            for params in self._param_buffers():
                self._gossipers[params[0].dtype] = cls(
                    flatten_tensors(params).to(comm_device),
                    graph,
                    device=comm_device,
                    mixing=mixing,
                    logger=logger,
                    rank=self.process_rank,
                    world_size=self.logical_world_size,
                    group=self._global_comm,
                )
            self.gossip_ps_factor.copy_(next(iter(self._gossipers.values())).mixing_weights["lo"])
        self.dist_config["gossipers"] = self._gossipers
        self.lazy_mixing = not self.asynch and mixing.is_regular()  # mix on arrival, not on sending
        self.lazy_ps_factor = self.gossip_ps_factor.clone()
        self.logger.debug("lazy mixing: %r", self.lazy_mixing)

    def _sgp_ps_numerator(self) -> None:
        """The parameters become push-sum numerators (times the push-sum weight)."""
        if not self.is_sgp_ps_numerator:
            if not self.lazy_mixing:
                self._scale_params(self.ps_weight, divide=False)
            self.is_sgp_ps_numerator = True

    def _sgp_unbias(self) -> None:
        """The parameters become the de-biased estimate (divided by the push-sum weight)."""
        if self.is_sgp_ps_numerator:
            if not self.lazy_mixing:
                self._scale_params(self.ps_weight, divide=True)
            self.is_sgp_ps_numerator = False

    def _scale_params(self, factor: torch.Tensor, divide: bool) -> None:
        with torch.no_grad():
            for params in self._param_buffers():
                f = _scalar(factor, params[0])
                if divide:
                    torch._foreach_div_(params, f)
                else:
                    torch._foreach_mul_(params, f)

    def _sgp_transfer_params(self, mix: bool = True) -> bool:
        """Send this rank's push-sum numerators to its peers of the iteration and receive theirs
        (the node master only); the result is applied by :meth:`_sgp_query_gossip_queue`."""
        if not self.gossip_enable or self.process_rank % self.nprocs_per_node != 0:
            return False
        if not self.params_mixed:
            self.logger.warning("params not mixed")
            return False
        mix = mix and not self.lazy_mixing
        self._sgp_ps_numerator()
        if mix:
            self.ps_weight *= self.gossip_ps_factor
            self._scale_params(self.gossip_ps_factor, divide=False)
        self.gossip_ps_weight.copy_(self.ps_weight)
        comm_device = self.dist_config["comm_device"]
        received: List[Tuple[List[torch.Tensor], torch.Tensor]] = []
        with torch.no_grad():
            uniform = isinstance(self.dist_config["mixing"], UniformMixing)  # never scales the message in place
            for params in self._param_buffers():
                gossiper = self._gossipers[params[0].dtype]
                out_msg, copied = as_flat(params)
                if not copied and not uniform:
                    out_msg = out_msg.clone()
                in_msg, ps_weight = gossiper.mix(out_msg.to(comm_device), self.gossip_ps_weight)
                received.append((params, in_msg))
                ps_factor = gossiper.mixing_weights["lo"]
            self.gossip_ps_weight.copy_(ps_weight)
            self.gossip_ps_factor.copy_(ps_factor)
        self._received = received
        self.params_mixed = False
        self.gossiping = True
        return True

    def _sgp_query_gossip_queue(self, non_blocking: bool = False) -> bool:
        """Add the received numerators and weight to this rank's (mixing them where lazy)."""
        if not self.gossip_enable:
            return False
        if not self.gossiping:
            if self.process_rank % self.nprocs_per_node == 0:
                self.logger.warning("not gossiping right now")
            return False
        self.lazy_ps_factor.copy_(self.gossip_ps_factor)
        self._sgp_ps_numerator()
        self.ps_weight += self.gossip_ps_weight
        if self.lazy_mixing:
            self.ps_weight *= self.lazy_ps_factor
        with torch.no_grad():
            for params, in_msg in self._received:
                views = unflatten_tensors(in_msg.to(params[0].device), params)
                torch._foreach_add_(params, views)
                if self.lazy_mixing:
                    torch._foreach_mul_(params, _scalar(self.lazy_ps_factor, params[0]))
        self._received = []
        self.params_mixed = True
        self.gossiping = False
        return True


def _scalar(factor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A one-element factor as a 0-dim tensor of ``like``'s dtype and device (FairScale rounds the
    factor to the parameters' dtype before multiplying)."""
    return factor.to(device=like.device, dtype=like.dtype).reshape(())
