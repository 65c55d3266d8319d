"""SlowMoDistributedDataParallel: data parallelism that averages parameters every few steps
(LocalSGD) or mixes them with a few peers every step (stochastic gradient push, SGP), with a slow
momentum step every ``slowmo_frequency`` steps (https://arxiv.org/abs/1910.00643); FairScale's
API and update rules.

Every collective goes through fairscale_c.distributed: CPU ranks on the shared-memory engine,
CUDA ranks on NCCL. Where FairScale runs the gossip on a helper thread that the training step then
waits for, the step here runs it in place (FairScale's overlapping mode, the thread's only use,
is disabled there too); the gossip's sends and receives are one point-to-point batch."""

from __future__ import annotations

from enum import Enum
from typing import Any, Dict, Iterable, List, Optional, Tuple, cast

import torch
from torch import nn

from .....distributed import group_for
from . import _slow_momentum as sm
from ._flat import FlatParams, flatten_module
from ._setup import _NAME, _int_arg, _SetupMixin
from ._sgp import SGPMixin
from .graph_manager import GraphManager
from .mixing_manager import MixingManager
from .utils import communicate, group_by_dtype
from .utils.cuda_metering import EventRecorder, create_event_recorder

HEARTBEAT_TIMEOUT = 300  # FairScale's limit on a gossip wait; the engine's timeout bounds every wait here
BROADCAST_BUCKET_SIZE = 10 * 1024 * 1024


class SlowMoBaseAlgorithm(str, Enum):
    LOCALSGD = "localsgd"
    SGP = "sgp"


class SlowMoDistributedDataParallel(SGPMixin, _SetupMixin, nn.Module):
    """Wraps ``module`` for data-parallel training with SlowMo; FairScale's arguments, in order:

    module, nprocs_per_node (processes per node; the processes of a node average their gradients
    every step and count as one "logical" rank for LocalSGD / SGP), broadcast_buffers (rank 0's
    buffers at every forward), slowmo_base_algorithm (``SlowMoBaseAlgorithm.LOCALSGD`` or
    ``.SGP``), slowmo_momentum, slowmo_memory_efficient (shard the slow momentum state over
    ``slowmo_num_shards`` ranks), slowmo_frequency, slowmo_lr, slowmo_num_shards,
    localsgd_frequency, graph (a GraphManager; default NPeerDynamicDirectedExponentialGraph),
    mixing (a MixingManager; default UniformMixing), push_sum (PushSum, else PushPull), overlap
    (must be False, as in FairScale), synch_freq, use_streams (no effect: the gossip runs in
    place), slowmo_sgp_average_params, verbose, profile_mode, process_rank, process_world_size,
    global_group, master_group, local_node_group, comm_device (where the gossip's messages live;
    default: the device of the module's first parameter).

    Usage, as in FairScale::

        model = SlowMoDistributedDataParallel(module, nprocs_per_node=1)
        loss_fn(model(x), y).backward()
        optimizer.step()
        model.perform_slowmo(optimizer)
    """

    def __init__(
        self,
        module: nn.Module,
        nprocs_per_node: int,
        broadcast_buffers: bool = True,
        slowmo_base_algorithm: SlowMoBaseAlgorithm = SlowMoBaseAlgorithm.LOCALSGD,
        slowmo_momentum: float = 0.5,
        slowmo_memory_efficient: bool = True,
        slowmo_frequency: int = 48,
        slowmo_lr: float = 1.0,
        slowmo_num_shards: int = 32,
        localsgd_frequency: int = 3,
        graph: Optional[GraphManager] = None,
        mixing: Optional[MixingManager] = None,
        push_sum: bool = True,
        overlap: bool = False,
        synch_freq: int = 0,
        use_streams: bool = True,
        slowmo_sgp_average_params: bool = False,
        verbose: bool = False,
        profile_mode: bool = False,
        process_rank: Optional[int] = None,
        process_world_size: Optional[int] = None,
        global_group: Optional[Any] = None,
        master_group: Optional[Any] = None,
        local_node_group: Optional[Any] = None,
        comm_device: Optional[torch.device] = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"{_NAME}: argument 'module' must be a torch.nn.Module, got {type(module).__name__}")
        first = next(module.parameters(), None)
        if first is None:
            raise ValueError(f"{_NAME}: argument 'module' has no parameters")
        self.nprocs_per_node = _int_arg("nprocs_per_node", nprocs_per_node, 1)
        algorithm = _algorithm(slowmo_base_algorithm)
        if overlap:
            raise ValueError(
                f"{_NAME}: argument 'overlap' must be False (overlapping SGP is disabled, as in FairScale)"
            )
        self._init_groups(process_rank, process_world_size, verbose, global_group, master_group, local_node_group)

        self.module = module
        self.broadcast_buffers = bool(broadcast_buffers)
        self.broadcast_bucket_size = BROADCAST_BUCKET_SIZE
        self.module_buffers = list(module.buffers())
        comm_device = torch.device(comm_device) if comm_device is not None else first.device
        self._cpu_comm = comm_device.type == "cpu"
        self.dist_config: Dict[str, Any] = {
            "verbose": verbose,
            "comm_device": comm_device,
            "logical_rank": self.logical_rank,
            "process_rank": self.process_rank,
            "logical_world_size": self.logical_world_size,
            "cpu_comm": self._cpu_comm,
        }
        self.profile_mode = profile_mode
        self.num_updates = 0
        self.portion_start: Optional[int] = None

        self._init_algorithm(
            algorithm == SlowMoBaseAlgorithm.LOCALSGD,
            algorithm == SlowMoBaseAlgorithm.SGP,
            slowmo_lr,
            slowmo_momentum,
            slowmo_frequency,
            slowmo_sgp_average_params,
            localsgd_frequency,
            slowmo_memory_efficient,
            slowmo_num_shards,
        )
        self.nprocs_per_node_device = torch.tensor([self.nprocs_per_node], device=comm_device, dtype=first.dtype)
        self._shard: Optional[sm.Shard] = None
        # the parameters move into one buffer per dtype (padded to whole slow momentum portions)
        params = list(module.parameters())
        f32 = sum(p.numel() for p in params if p.dtype == torch.float32)
        portion = -(-f32 // self.slowmo_num_shards)
        self._flats: Optional[List[FlatParams]] = flatten_module(
            params, self._global_comm, {torch.float32: portion * self.slowmo_num_shards}
        )

        if self.sgp:
            self._sgp_init(
                module, first.dtype, comm_device, graph, mixing, push_sum, _int_arg("synch_freq", synch_freq, 0)
            )
        self._callback_queued = False
        self._hook_backward = self.local_node_group is not None or self.sgp
        self.logger.debug("Initialization of SlowMoDistributedDataParallel complete")

    # ------------------------------------------------------------------ forward / backward
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self.slowmo and not self.global_momentum_buffers_initialized and self._slowmo_start is None:
            if self.is_current_node_a_slowmo_shard and self.training and torch.is_grad_enabled():
                self._slowmo_start = {id(p): p.detach().clone() for p in self.module.parameters()}
        self._sync_buffers()
        if self.sgp:
            self._sgp_unbias()
        output = self.module(*inputs, **kwargs)
        if self._hook_backward and torch.is_grad_enabled():
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(self._on_output_grad)
        return output

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._after_backward)

    def _after_backward(self) -> None:
        """At the end of a backward pass: the node's processes average their gradients; SGP
        turns the parameters into push-sum numerators."""
        self._callback_queued = False
        if self._local_comm is not None:
            grads = [p.grad for p in self.module.parameters() if p.requires_grad and p.grad is not None]
            if grads:
                torch._foreach_div_(grads, self.nprocs_per_node)
                self._communicate(grads, lambda flat: self._local_comm.all_reduce(flat, op="sum"))
            self.logger.debug("Gradient sync during backward pass in local_group complete")
        if self.sgp:
            self._sgp_ps_numerator()

    def _param_buffers(self) -> List[List[torch.Tensor]]:
        """Per dtype, tensors whose concatenation is the module's parameters of that dtype: the
        one buffer they live in, or the parameters themselves once something moved them out."""
        if self._flats is not None:
            if all(f.intact() for f in self._flats):
                return [[f.used] for f in self._flats]
            self.logger.warning("the parameters left their flat buffers (moved or cast): flattening copies from now on")
            self._flats = None
        return list(group_by_dtype([p.detach() for p in self.module.parameters()]).values())

    def _communicate(self, tensors: Optional[List[torch.Tensor]], op: Any) -> None:
        """op(flat) on each dtype's tensors (None: the module's parameters, in their buffers) as
        one flat tensor, copied in and back only where they are not one already."""
        with torch.no_grad():
            if tensors is not None:
                communicate(tensors, lambda tensor: op(tensor))
                return
            for same in self._param_buffers():
                communicate(same, lambda tensor: op(tensor))

    def _flat_for(self, params: List[torch.Tensor], length: int) -> Optional[torch.Tensor]:
        """The buffer of at least ``length`` elements that ``params`` (in order) live in, if any."""
        for f in self._flats or []:
            if len(f.params) == len(params) and all(a is b for a, b in zip(f.params, params)):
                if f.intact() and f.flat.numel() >= length:
                    return f.flat[:length]
        return None

    def _sync_params(self) -> None:
        """The node master's parameters to the other processes of its node."""
        if self._local_comm is None:
            return
        self._communicate(None, lambda flat: self._local_comm.broadcast(flat, root=self._local_root))
        self.logger.debug("Intra-node param sync complete")

    def _sync_buffers(self) -> None:
        """Rank 0's buffers to every rank (``broadcast_buffers``)."""
        if self.broadcast_buffers and self.module_buffers and self._global_comm.size > 1:
            self._distributed_broadcast_coalesced(self.process_group, self.module_buffers, self.broadcast_bucket_size)

    def _distributed_broadcast_coalesced(
        self, process_group: Any, tensors: List[torch.Tensor], buffer_size: int
    ) -> None:
        comm = self._global_comm if process_group is self.process_group else group_for(process_group)
        self._communicate([t.detach() for t in tensors], lambda flat: comm.broadcast(flat, root=0))

    def _create_event_recorder(self, event_name: str) -> EventRecorder:
        return create_event_recorder(event_name, dummy=not self.profile_mode)

    # ------------------------------------------------------------------ the SlowMo step
    def _fp16_fp32_iterator(
        self, optimizer: torch.optim.Optimizer, fp32_params: Optional[Any]
    ) -> Iterable[Tuple[torch.Tensor, torch.Tensor]]:
        """(low-precision parameter, its float32 copy) pairs: apex's amp stash, or fairseq-style
        ``fp32_params`` (one flat tensor, a list, or a dict holding one of them)."""
        stash = getattr(optimizer, "_amp_stash", None)
        if stash is not None and hasattr(stash, "fp16_groups"):
            for g16, g32 in zip(stash.fp16_groups, stash.fp32_from_fp16_groups):
                yield from zip(g16, g32)
        elif fp32_params is not None:
            if isinstance(fp32_params, dict):
                values = list(fp32_params.values())
                if len(values) != 1:
                    raise ValueError(f"{_NAME}.perform_slowmo: argument 'fp32_params' as a dict must hold one entry")
                fp32_params = values[0]
            if isinstance(fp32_params, (list, tuple)):
                for p, p32 in zip(self.parameters(), fp32_params):
                    yield p.view(-1), p32
            else:
                offset = 0
                for p in self.parameters():
                    yield p.view(-1), fp32_params[offset : offset + p.numel()]
                    offset += p.numel()

    def _should_perform_slowmo(self) -> bool:
        return self.slowmo and (self.num_updates + 1) % self.slowmo_frequency == 0

    def _should_perform_localsgd(self) -> bool:
        return self.localsgd and (self.num_updates + 1) % self.localsgd_frequency == 0

    def _skip_averaging_memory_efficient_slowmo(self) -> bool:
        return self.slowmo_memory_efficient and self._should_perform_slowmo()

    def _should_perform_sgp_common(self) -> bool:
        return self.sgp and not self.overlap and not self._skip_averaging_memory_efficient_slowmo()

    def _should_perform_sgp(self) -> bool:
        return self._should_perform_sgp_common() and not self.overlap

    def _should_perform_sgp_overlap(self) -> bool:
        return self._should_perform_sgp_common() and self.overlap

    def _should_use_error_feedback(self, fp16_fp32_list: List[Tuple[torch.Tensor, torch.Tensor]]) -> bool:
        return bool(fp16_fp32_list) and (self._should_perform_sgp() or self._should_allreduce_params())

    def _should_allreduce_params(self) -> bool:
        # A memory-efficient slow momentum step averages as it goes: the LocalSGD average is
        # skipped on its steps (no error feedback then: that step communicates in float32).
        return (self.sgp and self._should_perform_slowmo() and self.slowmo_sgp_average_params) or (
            self._should_perform_localsgd() and not self._skip_averaging_memory_efficient_slowmo()
        )

    def _maybe_pre_communicate_error_feedback(self, pairs: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        rec = self._create_event_recorder("Error feedback")
        if self._should_use_error_feedback(pairs):
            p16s, p32s = [p for p, _ in pairs], [p for _, p in pairs]
            with torch.no_grad():
                if self._should_allreduce_params():
                    # lose now the bits the division before the all-reduce will lose, so that
                    # the error feedback keeps them
                    torch._foreach_div_(p16s, self.logical_world_size)
                    torch._foreach_mul_(p16s, self.logical_world_size)
                torch._foreach_sub_(p32s, [p.float() for p in p16s])
        rec.stop()

    def _maybe_post_communicate_error_feedback(self, pairs: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        rec = self._create_event_recorder("Sync and error feedback unroll rec")
        if self._should_use_error_feedback(pairs):
            with torch.no_grad():
                torch._foreach_add_([p for _, p in pairs], [p.float() for p, _ in pairs])
        rec.stop()

    def _maybe_perform_sgp(self) -> None:
        rec = self._create_event_recorder("SGP")
        if self._should_perform_sgp() and not self._should_allreduce_params():
            self._sgp_transfer_params()
            self._sgp_query_gossip_queue()
            self.logger.debug("SGP completed")
        rec.stop()

    def _maybe_allreduce(self) -> None:
        rec = self._create_event_recorder("Localsgd communication time")
        if self._should_allreduce_params():
            comm, world = self._master_comm, self.logical_world_size
            if comm is not None:  # the other processes of a node get the result from their master

                def average(flat: torch.Tensor) -> None:
                    flat.div_(world)
                    comm.all_reduce(flat, op="sum")

                self._communicate(None, average)
            self.logger.debug("Allreduce completed")
        rec.stop()

    def _maybe_sync_locally(self) -> None:
        if self._should_perform_sgp() or self._should_allreduce_params():
            self._sync_params()

    def _maybe_perform_slowmo(self, optimizer: torch.optim.Optimizer) -> None:
        rec = self._create_event_recorder("Slowmo")
        if self._should_perform_slowmo():
            self._global_momentum_step(optimizer)
        rec.stop()

    def _maybe_copy_back_fp32_parameters(self, pairs: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        rec = self._create_event_recorder("Error feedback copy back")
        busy = self._should_perform_sgp() or self._should_allreduce_params() or self._should_perform_slowmo()
        if busy and pairs:
            with torch.no_grad():
                torch._foreach_copy_([p for p, _ in pairs], [p for _, p in pairs])
        rec.stop()

    def perform_slowmo(self, optimizer: torch.optim.Optimizer, fp32_params: Optional[Any] = None) -> None:
        """Call after ``optimizer.step()``: the step's averaging (LocalSGD every
        ``localsgd_frequency`` steps, or a gossip step) and, every ``slowmo_frequency`` steps, the
        slow momentum step. ``fp32_params``: the float32 master copy of float16 parameters
        (fairseq-style), so that the averaging's rounding is fed back into it."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"{_NAME}.perform_slowmo: argument 'optimizer' must be a torch.optim.Optimizer")
        if not self.global_momentum_buffers_initialized:
            self._init_global_momentum_buffers(optimizer)
        pairs = list(self._fp16_fp32_iterator(optimizer, fp32_params))
        if (
            self.num_updates == 0
            and fp32_params is None
            and not hasattr(optimizer, "_amp_stash")
            and any(p.dtype == torch.float16 for p in self.parameters())
        ):
            self.logger.warning("WARNING: please set fp32_params in perform_slowmo() in order to avoid accuracy loss")
        self._maybe_pre_communicate_error_feedback(pairs)
        self._maybe_perform_sgp()
        self._maybe_allreduce()
        self._maybe_sync_locally()
        self._maybe_post_communicate_error_feedback(pairs)
        self._maybe_perform_slowmo(optimizer)
        self._maybe_copy_back_fp32_parameters(pairs)
        self.num_updates += 1

    def _init_global_momentum_buffers(self, optimizer: torch.optim.Optimizer) -> None:
        """The slow momentum state: this rank's portion of the optimizer's parameters and a zero
        momentum. The parameters are those of the first training forward when one ran before (the
        first perform_slowmo follows a local step, after which the ranks' parameters differ;
        FairScale takes them as they are then, so its ranks start from different points), else
        the parameters as they are now."""
        self.global_momentum_buffers_initialized = True
        start, self._slowmo_start = self._slowmo_start or {}, None
        if not self.slowmo:
            return
        params, _ = sm.optimizer_params(optimizer)
        params = [start.get(id(p), p) for p in params]
        total = sum(p.numel() for p in params)
        length = -(-total // self.slowmo_num_shards)
        self.world_portion_length = length
        if not self.is_current_node_a_slowmo_shard:
            return
        start = self.process_rank * length if self.slowmo_memory_efficient else 0
        end = min(start + length, total)
        self.portion_start, self.portion_end = start, end
        flat = sm.flat_copy(params, max(total, start + length))
        old = flat[start : start + length].clone()
        self._shard = sm.Shard(start, end, old, torch.zeros_like(old))

    @property
    def old_params(self) -> torch.Tensor:
        if self._shard is None:
            raise AttributeError(f"{_NAME}: no slow momentum state on this rank")
        return self._shard.old_params

    @property
    def global_momentum_buffer(self) -> torch.Tensor:
        if self._shard is None:
            raise AttributeError(f"{_NAME}: no slow momentum state on this rank")
        return self._shard.momentum

    def _global_momentum_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self.slowmo:
            return
        if not self.global_momentum_buffers_initialized:
            self._init_global_momentum_buffers(optimizer)
        params, ranges = sm.optimizer_params(optimizer)
        length, shards = self.world_portion_length, self.slowmo_num_shards
        size = shards * length if self.slowmo_memory_efficient else length
        flat = self._flat_for(params, size)
        in_place = flat is not None
        with torch.no_grad():
            if flat is None:
                flat = sm.flat_copy(params, size)
            if self.slowmo_memory_efficient:
                world = self.process_world_size
                mine = sm.average_into_owners(self._global_comm, flat, self.process_rank, world, shards, length)
                if self._shard is not None:
                    sm.step_portion(self._shard, mine, ranges, self.slowmo_momentum, self.slowmo_lr)
                sm.send_back_from_owners(self._global_comm, flat, mine, world, shards, length)
            else:
                sm.step_portion(cast(sm.Shard, self._shard), flat, ranges, self.slowmo_momentum, self.slowmo_lr)
            if not in_place:
                sm.copy_back(params, flat)

    # ------------------------------------------------------------------ module protocol
    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The module's state; with SGP also ``ps_weight`` and ``is_sgp_ps_numerator``."""
        state = super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        if self.sgp:
            state[prefix + "ps_weight"] = self.ps_weight.cpu()
            state[prefix + "is_sgp_ps_numerator"] = self.is_sgp_ps_numerator
        return state

    def _load_from_state_dict(
        self,
        state_dict: Dict[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing: Any,
        unexpected: Any,
        errors: Any,
    ) -> None:
        if self.sgp:
            for key in ("ps_weight", "is_sgp_ps_numerator"):
                if prefix + key not in state_dict:
                    missing.append(prefix + key)
            if prefix + "ps_weight" in state_dict:
                self.ps_weight = (
                    torch.as_tensor(state_dict.pop(prefix + "ps_weight"))
                    .to(device=self.dist_config["comm_device"], dtype=self.ps_weight.dtype)
                    .reshape(1)
                )
            if prefix + "is_sgp_ps_numerator" in state_dict:
                self.is_sgp_ps_numerator = bool(state_dict.pop(prefix + "is_sgp_ps_numerator"))
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing, unexpected, errors)

    def train(self, mode: bool = True) -> "SlowMoDistributedDataParallel":
        super().train(mode)
        if self.sgp:
            self.gossip_enable = True
        return self

    def eval(self) -> "SlowMoDistributedDataParallel":
        super().eval()
        if self.sgp:
            self.gossip_enable = False
            self._sgp_query_gossip_queue(non_blocking=self.asynch)
        return self


def _algorithm(value: Any) -> SlowMoBaseAlgorithm:
    try:
        return SlowMoBaseAlgorithm(value)
    except ValueError:
        raise ValueError(
            f"{_NAME}: argument 'slowmo_base_algorithm' must be SlowMoBaseAlgorithm.LOCALSGD or .SGP "
            f"('localsgd' or 'sgp'), got {value!r}"
        ) from None


def _tensors(output: Any) -> Iterable[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (list, tuple)):
        for o in output:
            yield from _tensors(o)
    elif isinstance(output, dict):
        for o in output.values():
            yield from _tensors(o)


__all__ = ["SlowMoBaseAlgorithm", "SlowMoDistributedDataParallel", "HEARTBEAT_TIMEOUT", "BROADCAST_BUCKET_SIZE"]
