"""SlowMoDistributedDataParallel's construction: its ranks and process groups (FairScale's
attributes and their engine groups), and the settings of its base algorithm and slow momentum."""

from __future__ import annotations

import logging
from typing import Any, Dict, List, Optional, Tuple, cast

import torch
import torch.distributed as dist

from .....distributed import group_for
from .utils import MultiProcessAdapter
from .....internal.args import as_int

_NAME = "SlowMoDistributedDataParallel"


class _SetupMixin:
    """The parts of SlowMoDistributedDataParallel.__init__ that set up its groups and settings."""

    nprocs_per_node: int
    master_group: Any
    logical_world_size: int
    process_rank: int
    process_world_size: int
    logger: logging.Logger

    def _init_groups(
        self,
        process_rank: Optional[int],
        process_world_size: Optional[int],
        verbose: bool,
        global_group: Optional[Any],
        master_group: Optional[Any],
        local_node_group: Optional[Any],
    ) -> None:
        """This process's rank and world, the logger, and the process groups (after
        ``nprocs_per_node`` is set)."""
        self.process_rank, self.process_world_size = _ranks(process_rank, process_world_size)
        if self.process_world_size % self.nprocs_per_node:
            raise ValueError(
                f"{_NAME}: the world size ({self.process_world_size}) must be a multiple of argument "
                f"'nprocs_per_node' ({self.nprocs_per_node})"
            )
        self._initialize_logger(verbose, self.process_rank)
        self.logical_rank, self.logical_world_size = self._maybe_create_process_groups(
            self.process_rank,
            self.process_world_size,
            self.nprocs_per_node,
            global_group,
            master_group,
            local_node_group,
        )

    def _init_algorithm(
        self,
        localsgd: bool,
        sgp: bool,
        slowmo_lr: float,
        slowmo_momentum: float,
        slowmo_frequency: int,
        slowmo_sgp_average_params: bool,
        localsgd_frequency: int,
        slowmo_memory_efficient: bool,
        slowmo_num_shards: int,
    ) -> None:
        """The base algorithm's and slow momentum's settings (after the process groups exist)."""
        # slow momentum off is slowmo_lr 1 and slowmo_momentum 0
        self.slowmo = slowmo_lr != 1 or slowmo_momentum != 0
        self.slowmo_lr = float(slowmo_lr) if self.slowmo else 1.0
        self.slowmo_momentum = float(slowmo_momentum) if self.slowmo else 0.0
        self.slowmo_frequency = _int_arg("slowmo_frequency", slowmo_frequency, 1)
        self.slowmo_sgp_average_params = slowmo_sgp_average_params
        self.localsgd, self.sgp = localsgd, sgp
        self.localsgd_frequency = _int_arg("localsgd_frequency", localsgd_frequency, 1)
        self.ef1: Optional[List[torch.Tensor]] = None
        self.global_momentum_buffers_initialized = False
        # the parameters every rank held at its first training forward, until the slow momentum's
        # state is made from them (its first perform_slowmo comes after a local step)
        self._slowmo_start: Optional[Dict[int, torch.Tensor]] = None
        self.overlap = False

        if self.master_group is None or self.logical_world_size == 1:
            self.localsgd = self.sgp = False
            self.logger.warning("Disabling LocalSGD and SGP since a local allreduce will suffice")
        if self.slowmo and not self.localsgd and not self.sgp:
            self.logger.warning("SlowMo is being used without LocalSGD and SGP")

        self.slowmo_memory_efficient = bool(slowmo_memory_efficient)
        shards = _int_arg("slowmo_num_shards", slowmo_num_shards, 1)
        self.slowmo_num_shards = min(self.process_world_size, shards) if self.slowmo_memory_efficient else 1
        self.is_current_node_a_slowmo_shard = (
            self.process_rank < self.slowmo_num_shards if self.slowmo_memory_efficient else True
        )

    # ------------------------------------------------------------------ set-up
    def _initialize_logger(self, verbose: bool, process_rank: int) -> None:
        self.logger = logging.getLogger(__name__)
        if verbose:
            self.logger.setLevel(logging.DEBUG)
        if self.logger.isEnabledFor(logging.DEBUG):
            self.logger = cast(logging.Logger, MultiProcessAdapter(self.logger, {"process_num": process_rank}))

    def _maybe_create_process_groups(
        self,
        process_rank: int,
        process_world_size: int,
        nprocs_per_node: int,
        global_group: Optional[Any],
        master_group: Optional[Any],
        local_node_group: Optional[Any],
    ) -> Tuple[int, int]:
        """The torch groups (FairScale's attributes: global_group, process_group, local_node_group,
        master_group; every rank builds the missing ones in the same order) and their engine
        groups. Returns (logical rank, logical world size)."""
        self.local_rank = process_rank % nprocs_per_node
        logical_world_size = process_world_size // nprocs_per_node
        logical_rank = process_rank // nprocs_per_node
        distributed = dist.is_available() and dist.is_initialized()

        self.global_group = global_group if global_group is not None else (dist.group.WORLD if distributed else None)
        self.process_group = self.global_group
        self._global_comm = group_for(self.global_group, argument=f"{_NAME}: argument 'global_group'")

        self._local_comm = None
        self._local_root = 0
        if nprocs_per_node == 1:
            self.local_node_group = None
        elif local_node_group is not None:
            self.local_node_group = local_node_group
        else:
            self.local_node_group = None
            for node in range(logical_world_size):
                ranks = list(range(node * nprocs_per_node, (node + 1) * nprocs_per_node))
                pg = dist.new_group(ranks)
                if process_rank in ranks:
                    self.local_node_group = pg
        if self.local_node_group is not None:
            self._local_comm = group_for(self.local_node_group, argument=f"{_NAME}: argument 'local_node_group'")
            master = logical_rank * nprocs_per_node
            self._local_root = dist.get_group_rank(self.local_node_group, master) if distributed else 0

        self._master_comm = None
        if master_group is not None:
            self.master_group = master_group
        elif nprocs_per_node > 1:
            masters = [r for r in range(process_world_size) if r % nprocs_per_node == 0]
            self.master_group = dist.new_group(masters) if len(masters) > 1 else None
        else:
            self.master_group = self.global_group
        if self.master_group is not None and self.master_group is self.global_group:
            self._master_comm = self._global_comm
        elif self.master_group is not None and _member(self.master_group):
            self._master_comm = group_for(self.master_group)
        return logical_rank, logical_world_size


def _int_arg(name: str, value: Any, low: int) -> int:
    if as_int(value) is None or value < low:
        raise ValueError(f"{_NAME}: argument '{name}' must be an int >= {low}, got {value!r}")
    return as_int(value)


def _ranks(rank: Optional[int], world: Optional[int]) -> Tuple[int, int]:
    distributed = dist.is_available() and dist.is_initialized()
    if rank is None or world is None:
        if not distributed:
            raise RuntimeError(
                f"{_NAME}: torch.distributed is not initialised; initialise it (or pass process_rank and "
                "process_world_size for a single process)"
            )
        return dist.get_rank(), dist.get_world_size()
    world = _int_arg("process_world_size", world, 1)
    rank = _int_arg("process_rank", rank, 0)
    if rank >= world:
        raise ValueError(f"{_NAME}: argument 'process_rank' ({rank}) must be < process_world_size ({world})")
    if world > 1 and not distributed:
        raise RuntimeError(f"{_NAME}: process_world_size is {world} but torch.distributed is not initialised")
    return rank, world


def _member(pg: Any) -> bool:
    """Whether this process belongs to torch group ``pg`` (new_group gives non-members a marker)."""
    if not (dist.is_available() and dist.is_initialized()) or not isinstance(pg, dist.ProcessGroup):
        return False
    return dist.get_rank() in dist.get_process_group_ranks(pg)
