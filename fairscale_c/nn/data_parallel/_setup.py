"""FSDP's construction: the engine groups, the flat layouts sharded into registered shards, the
parameters tied to other instances, and the state between steps (a mixin of
FullyShardedDataParallel, whose instance attributes it uses)."""

import functools
import warnings
import weakref
from typing import Any, List, Optional

import torch
from torch import nn

from fairscale_c import distributed as fdist
from fairscale_c.distributed import local_copy as _copy  # copies/casts that keep autograd's version counters
from fairscale_c.internal.hooks import weak_hook
from fairscale_c.internal.parallel import ProcessGroupName

from . import _state_dict
from ._full_params import note_instance
from ._handle import Handle, Tie, TrainingState, free_storage
from .flat_param import FlatLayout, ForeignParam, collect_params


def is_managed(p: torch.Tensor) -> bool:
    """Whether `p` is a shard an FSDP instance registered (not a parameter of the wrapped module)."""
    return getattr(p, "_fsc_fsdp_managed", False)


@functools.lru_cache(maxsize=None)
def _warn_shared_gpu() -> None:
    """Once per process: why the reduce-scatters share the all-gathers' group."""
    warnings.warn(
        "FullyShardedDataParallel: ranks of process_group share a GPU (their current CUDA devices are "
        "one GPU, or LOCAL_WORLD_SIZE > torch.cuda.device_count()), so reduce-scatters use process_group "
        "instead of a group of their own: with ranks sharing a GPU, a second NCCL communicator per rank "
        "deadlocked under MPS. Pass a torch process group as process_group_reduce_scatter to have a "
        "separate one anyway.",
        stacklevel=3,
    )


class _RefusePartialStateDict:
    """A state-dict hook on the wrapped module and on each module between it and a parameter the
    instance holds: their state_dict() outside the instance's own (and outside summon_full_params)
    would miss those parameters (flat) or hold 1-D shards of them (unflattened), without a word.
    A copy of the module (deepcopy, pickle: e.g. taken inside summon_full_params) is a plain
    module again: the copy's hook does nothing."""

    def __init__(self, owner: Any = None) -> None:
        self.owner = weakref.ref(owner) if owner is not None else None

    def __call__(self, module: nn.Module, state_dict: Any, prefix: str, local_metadata: Any) -> None:
        owner = self.owner() if self.owner is not None else None
        if owner is None or not owner._return_full_state_dict:
            return
        if owner.training_state is TrainingState.SUMMON_FULL_PARAMS:
            return
        raise RuntimeError(
            "state_dict() of a module inside FullyShardedDataParallel lacks the parameters the instance holds "
            "(flattened or sharded): call state_dict() on the FullyShardedDataParallel instance (the keys are the "
            "module's), or this one inside summon_full_params()"
        )

    def __deepcopy__(self, memo: Any) -> "_RefusePartialStateDict":
        return _RefusePartialStateDict()

    def __reduce__(self) -> Any:
        return (_RefusePartialStateDict, ())


class Setup:
    """The construction of one FSDP instance."""

    def _init_groups(self, process_group: Optional[Any], process_group_reduce_scatter: Any) -> None:
        """The engine groups for all-gathers (`process_group`'s; None: the default group) and for
        reduce-scatters (see _reduce_scatter_comm), and this rank's place in them."""
        if process_group is None and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            fdist.require_initialised_world("FullyShardedDataParallel(process_group=None)")
        self.comm = fdist.group_for(process_group, argument="FullyShardedDataParallel: argument 'process_group'")
        self.process_group = self.comm.process_group
        # a ProcessGroupTracker (layer_memory_tracker) given as process_group hears of each all-gather
        self.all_gather_tracker = process_group if hasattr(process_group, "notify_all_gather") else None
        self.comm_rs = self._reduce_scatter_comm(process_group_reduce_scatter)
        self.process_group_reduce_scatter = self.comm_rs.process_group
        self.rank, self.world_size = self.comm.rank, self.comm.size

    def _refuse_partial_state_dicts(self, module: nn.Module) -> None:
        """_RefusePartialStateDict on `module` and every module between it and a parameter this
        instance holds (its own, or one it shares)."""
        holders = {id(s.module) for h in self._handles for s in list(h.layout.slots) + list(h.layout.shared)}
        holders.update(id(t.module) for t in self._ties)
        if not holders:
            return
        parents: dict = {}
        for _, sub in module.named_modules(remove_duplicate=False):
            for child in sub.children():
                parents.setdefault(id(child), sub)
        hooked: set = set()
        for sub in module.modules():
            node = sub if id(sub) in holders else None
            while node is not None and id(node) not in hooked:
                hooked.add(id(node))
                node._register_state_dict_hook(_RefusePartialStateDict(self))
                node = parents.get(id(node)) if node is not module else None

    def _init_shards(self, module: nn.Module, state_dict_device: Optional[torch.device]) -> None:
        """Lay out the parameters this instance owns (not those of nested instances) in flat buffers,
        keep this rank's shard of each as a registered Parameter, and leave shaped views of the
        (freed) full buffers under the original names."""
        self.state_dict_device = torch.device(state_dict_device) if state_dict_device else self.compute_device
        shard_device = torch.device("cpu") if self.move_params_to_cpu else self.compute_device
        orders = {id(m): list(m._parameters) for m in module.modules()}
        layouts, self._shared_pairs, foreign = collect_params(module, is_managed, self.flatten_parameters)
        self._check_dtypes(layouts)
        for f in foreign:
            self._check_share(f)
        self._fsdp_wrapped_module = module
        # Every shard first (collectives that find the ranks' layouts differ), and only then the
        # module's parameters replaced: such a refusal leaves them as they were.
        for layout in layouts:
            layout.world_size, layout.rank = self.world_size, self.rank
        shards = [self._make_shard(layout, shard_device) for layout in layouts]
        self._handles: List[Handle] = [self._install(i, *pair) for i, pair in enumerate(zip(layouts, shards))]
        self._ties: List[Tie] = [self._tie(f) for f in foreign]
        # what this instance gathers and frees: its own flat parameters, then those it shares
        self._all_handles: List[Handle] = self._handles + [t.handle for t in self._ties]
        self._refuse_partial_state_dicts(module)
        # Modules whose parameters leave and rejoin _parameters at every forward (unflattened
        # shards, shared parameters) and their original order, which parameters() keeps.
        moved = [t.module for t in self._ties]
        if not self.flatten_parameters:
            moved += [module for h in self._handles for module, _ in h.places()]
        self._param_orders = [(m, orders[id(m)]) for m in {id(m): m for m in moved}.values()]
        self._restore_param_order()
        self.numel_padded_per_param = [h.layout.padding for h in self._handles]
        with torch.no_grad():
            if self.flatten_parameters:
                self._point_at_full()  # shaped views while the buffers still have storage
        for h in self._handles:
            free_storage(h.full.detach())

    def _install(self, i: int, layout: FlatLayout, shard: torch.Tensor) -> Handle:
        """Put the `i`-th layout's shard in place of its original parameters: as
        ``flat_param_<i>``, or, as in FairScale, under the original name when not flattening."""
        param = nn.Parameter(shard, requires_grad=layout.requires_grad)
        param._fsc_fsdp_managed = True
        note_instance()  # optimizer steps are counted on the shards from now on
        param._is_sharded = self.world_size > 1  # FairScale's marker, read by some user code
        handle = Handle(layout, param, self.compute_dtype, self.compute_device)
        for slot in layout.slots:
            # an instance built later that still reaches the original (a tie) shares it from here
            slot.param._fsc_fsdp_sharded = (weakref.ref(self), handle, slot)
            delattr(slot.module, slot.attr)
            slot.param = None
        for shared in layout.shared:
            delattr(shared.module, shared.attr)
        if self.flatten_parameters:
            handle.backing_name = f"flat_param_{i}"
            self.register_parameter(handle.backing_name, param)
        else:
            handle.backing_name = layout.slots[0].name
            for module, attr in handle.places():
                module.register_parameter(attr, param)
        self._hook_full(handle)
        return handle

    def _check_share(self, f: ForeignParam) -> None:
        """Before anything is sharded: a parameter another instance has sharded can be shared
        only while that instance lives, over the same process group."""
        owner = f.param._fsc_fsdp_sharded[0]()
        same_group = owner is not None and (owner.comm is self.comm or owner.world_size == self.world_size == 1)
        if not same_group:
            why = "no longer exists" if owner is None else "shards over another process group"
            raise ValueError(
                f"FullyShardedDataParallel: parameter '{f.name}' is the same tensor as a parameter of another "
                f"FullyShardedDataParallel instance, which {why}; instances can share (tie) a parameter only "
                f"over the same process group"
            )

    def _tie(self, f: ForeignParam) -> Tie:
        """Share a parameter another instance has sharded (checked by _check_share): its attribute
        here holds the owner's shard from now on (one Parameter, as a tie in the unwrapped model is
        one tensor)."""
        owner_ref, handle, slot = f.param._fsc_fsdp_sharded
        f.module._parameters[f.attr] = handle.param
        return Tie(f.module, f.attr, f.name, owner_ref, handle, slot)

    def _init_state(self) -> None:
        """The state between steps, until the first forward finds the root, and the state-dict hooks."""
        self._is_root: Optional[bool] = None
        self._fsdp_instances: List[nn.Module] = []  # the root: every instance in its tree (FSDP)
        self._require_backward_grad_sync = True
        self._return_full_state_dict = True
        self._pre_backward_hook_has_run = False
        self._warned_opaque: set = set()  # output types _scan_outputs has warned about
        self._inner_backwards: List[Any] = []  # root: _backward_inside_forward's ends, run by its forward
        self.training_state = TrainingState.IDLE
        self._register_state_dict_hook(_state_dict.post_state_dict_hook)
        self._register_load_state_dict_pre_hook(functools.partial(_state_dict.pre_load_state_dict_hook, self))

    def _hook_full(self, h: Handle) -> None:
        """Reduce-scatter the full buffer's gradient once autograd has accumulated all of it
        (registered once the buffer requires grad: torch refuses a hook on one that does not)."""
        if h.full.requires_grad and not h.grad_hooked:
            h.full.register_post_accumulate_grad_hook(weak_hook(self._post_backward_hook, h))
            h.grad_hooked = True

    def _sync_requires_grad(self) -> None:
        """Give the full buffers the shards' current ``requires_grad``: a flat parameter frozen or
        unfrozen after wrapping (``p.requires_grad_()``) gets no gradient, or gets one, from the
        next forward on, as in FairScale, which reads it at every step."""
        for h in self._handles:
            self._sync_handle(h)
        for t in self._ties:  # a shared parameter's gradient hook is its owner's
            owner = t.owner()
            if owner is not None:
                owner._sync_handle(t.handle)

    def _sync_handle(self, h: Handle) -> None:
        want = h.param.requires_grad
        if h.full.requires_grad != want:
            h.full.requires_grad_(want)
            self._hook_full(h)

    def _check_dtypes(self, layouts: List[FlatLayout]) -> None:
        pure_fp16 = self.compute_dtype is torch.float16 and not self.mixed_precision
        want = torch.float16 if pure_fp16 else torch.float32
        for layout in layouts:
            for slot in layout.slots:
                if slot.param.dtype is not want:
                    mode = "pure fp16" if pure_fp16 else ("mixed precision" if self.mixed_precision else "fp32")
                    raise ValueError(
                        f"FullyShardedDataParallel: parameter '{slot.name}' is {slot.param.dtype}; "
                        f"{mode} mode expects every parameter to be {want}"
                    )

    def _reduce_scatter_comm(self, pg: Any) -> Any:
        """FairScale's rule: ProcessGroupName.reduce_scatter (the default) gives reduce-scatters a
        group of their own over the same ranks, ProcessGroupName.default or None reuses
        process_group, and a group whose ranks differ from process_group's falls back to it.
        Beyond FairScale: where this instance computes on CUDA and ranks share a GPU
        (fdist.ranks_share_gpus(self.comm)) the default reuses process_group too, with a warning:
        two NCCL communicators per rank can deadlock there."""
        import torch.distributed as dist

        if isinstance(pg, str) and not isinstance(pg, ProcessGroupName):
            pg = ProcessGroupName(pg)  # check_fsdp_args admitted only its values
        if pg is None or pg == ProcessGroupName.default or self.comm.size == 1:
            return self.comm
        if pg == ProcessGroupName.reduce_scatter:
            if self.compute_device.type == "cuda" and fdist.ranks_share_gpus(self.comm):
                _warn_shared_gpu()
                return self.comm
            return fdist.group_for(self.process_group, role="reduce_scatter")
        if pg is dist.GroupMember.NON_GROUP_MEMBER:
            return self.comm
        if not isinstance(pg, dist.ProcessGroup):  # a stand-in with rank() and size(): FairScale compares sizes
            return fdist.group_for(pg) if pg.size() == self.comm.size else self.comm
        if dist.get_process_group_ranks(pg) != dist.get_process_group_ranks(self.process_group):
            return self.comm
        return fdist.group_for(pg)

    @torch.no_grad()
    def _make_shard(self, layout: FlatLayout, device: torch.device) -> torch.Tensor:
        """Copy this rank's slice of the flattened parameters into a fresh padded shard (in C)."""
        dtype = layout.slots[0].param.dtype
        # On CPU with peers on this host a shared tensor (every rank maps the shards of this flat
        # parameter), so all-gathers that read it copy the peers' shards straight from their memory.
        shard = fdist.shared_zeros(layout.shard_numel, dtype=dtype, device=device, group=self.comm)
        lo, hi = layout.shard_range(self.rank)
        for slot in layout.slots:
            a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
            if a < b:
                src = slot.param.detach().reshape(-1)[a - slot.offset : b - slot.offset]
                _copy(shard[a - lo : b - lo], src)
        return shard
