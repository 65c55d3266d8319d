"""FSDP's backward: the hooks that re-gather the full parameters before an instance's backward,
hand each complete flat gradient to the reduce-scatter buckets, and at the end of backward set
the averaged gradient shards (a mixin of FullyShardedDataParallel, whose instance attributes it
uses)."""

import threading
import warnings
from typing import Any, Tuple

import torch

from fairscale_c.distributed import local_copy as _copy  # copies/casts that keep autograd's version counters

from ._handle import Handle, TrainingState, free_storage
from ._tensors import map_tensors, scan_outputs


def _graph_task() -> int:
    """The id of the backward running now (a reentrant checkpoint's nested backward has its own)."""
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current() if current is not None else -1


_MARK = torch.zeros((), requires_grad=True)


def sequence_mark() -> int:
    """The sequence number autograd gives the next node it records on this thread: nodes of an
    instance's forward have this number or higher."""
    return _MARK.view(()).grad_fn._sequence_nr()


def outer_graph_uses_full(outputs: Any, start: int) -> bool:
    """Whether autograd's record of a forward that began at `start` (sequence_mark()) may use the
    instance's full parameters: False only when each output is made by one node whose inputs all
    come from before the forward (or are leaves), i.e. a reentrant checkpoint took the whole
    computation (its first pass ran without autograd; its recomputation is backpropagated in a
    nested backward)."""
    tensors: list = []
    map_tensors(lambda t: tensors.append(t) or t, outputs)
    for t in tensors:
        node = t.grad_fn if t.requires_grad else None
        if node is None or node._sequence_nr() < start:
            continue  # not recorded, or an input passed through
        for parent, _ in node.next_functions:
            # a node of this forward (the parameters are reached through views, never as
            # leaves: a leaf's AccumulateGrad, such as FairScale's checkpoint's dummy, is not one)
            if parent is not None and not hasattr(parent, "variable") and parent._sequence_nr() >= start:
                return True
    return False


class BackwardHooks:
    """The backward of one FSDP instance."""

    _backward_task = -1  # root: the graph task of the backward its pre-backward hook saw
    _outer_uses_full = True  # whether autograd's record of its last forward uses the full params
    _grads_shown = False  # root: some instance shows no_sync()'s full gradients on .grad
    _backward_open = False  # root: a backward queued its end (_wait_for_post_backward), not run yet
    _loop_thread = None  # root: the thread that ran its last forward (the training loop's)
    # root: the running backward records a graph of its gradients (create_graph=True, a gradient
    # penalty); that graph reads the full parameters, whose memory then stays (_free_full_params)
    _creates_graph = False
    # root: such a graph may still be backpropagated (until a backward without create_graph ends):
    # forwards meanwhile keep the full parameters' memory too
    _grads_graph_pending = False
    _outer_forward_running = False  # root: its forward runs, outside any backward
    _released_in_forward = False  # its last forward (not a recompute) released the full parameters
    # its last forward's outputs hold no tensor that requires grad (None, ints, detached): no
    # pre-backward hook, so a backward reaching its parameters comes through something else (a
    # result kept in an attribute), and no backward prefetch is started for it
    _unreachable_outputs = False

    def _backward_inside_forward(self) -> None:
        """The pre-backward hook of a gradient taken inside the root's forward (physics-informed
        style: torch.autograd.grad of an inner instance's output with respect to the input). Its
        graph, and the training backward that later runs through it, read this instance's full
        parameters: they are gathered again and stay. Meanwhile the names point at them (for a
        recompute inside the instance); when that inner backward ends, the instance is as its
        forward left it, its shards registered again (a penalty over ``parameters()`` sees them),
        and the training backward's hook runs as usual."""
        entry = self.training_state
        self.training_state = TrainingState.BACKWARD_PRE
        self._pre_backward_hook_has_run = True
        self._rebuild_full_params()
        # held from now on, gathered here: the training backward may reach them through this
        # gradient's graph alone (a loss of the derivative only), without the outputs' hook
        self._released_in_forward = False
        if not self.flatten_parameters or self._ties or self._shows_released():
            with torch.enable_grad():
                self._use_full_params()

        def inner_backward_ended() -> None:
            if self._pre_backward_hook_has_run:  # once: at its end, or at the forward's if it raised
                self._register_shards_under_views()
                self._pre_backward_hook_has_run = False
                self.training_state = entry

        torch.autograd.Variable._execution_engine.queue_callback(inner_backward_ended)
        # autograd runs no callback of a backward that raised: the root's forward then does
        self._root._inner_backwards.append(inner_backward_ended)

    def _scan_outputs(self, outputs: Any) -> Tuple[bool, bool]:
        """For a forward with gradients on: (whether a backward can reach it through `outputs`,
        whether they hold tensors that no pre-backward hook can be put on (scan_outputs)). An
        instance with such hidden outputs keeps its full parameters until its gradient is reduced
        (nothing re-gathers them before its backward), and the root's end of backward is then
        started by the first gradient (_post_backward_hook)."""
        if not torch.is_grad_enabled():
            return False, False
        reached, kind = scan_outputs(outputs)
        if kind is None:
            return reached, False
        if kind not in self._warned_opaque:
            self._warned_opaque.add(kind)
            warnings.warn(
                f"FullyShardedDataParallel: the output of {type(self.module).__name__} holds a "
                f"{kind.__module__}.{kind.__qualname__}, whose tensors FSDP cannot see (it looks into "
                f"tensors, dicts, lists, tuples and dataclasses); the instance keeps its full "
                f"parameters from this forward to its backward",
                stacklevel=5,
            )
        return False, True

    def _register_pre_backward_hooks(self, outputs: Any) -> Any:
        if not torch.is_grad_enabled():
            return outputs
        self._pre_backward_hook_has_run = False

        def hook(*unused: Any) -> None:
            if self._pre_backward_hook_has_run:
                return
            if self._root._outer_forward_running:
                self._backward_inside_forward()
                return
            if self._is_root:
                self._take_back_accumulated_grads()
            self._pre_backward_hook_has_run = True
            if self._is_root:
                torch.autograd.Variable._execution_engine.queue_callback(self._wait_for_post_backward)
                self._backward_task = _graph_task()
                self._backward_open = True
            self.training_state = TrainingState.BACKWARD_PRE
            if torch.is_grad_enabled():
                self._root._creates_graph = True
            self._rebuild_full_params()
            if not self.flatten_parameters or self._ties or self._shows_released():
                # A block recomputed in backward (activation checkpointing) reads the attributes:
                # they hold full views until the end of backward (a flat instance's held
                # ReleasedParameters from the end of its forward, which resharded). Views that
                # autograd records, so that a reentrant checkpoint's recomputed block reaches
                # the full parameters' gradient.
                with torch.enable_grad():
                    self._use_full_params()
            self._root._prefetch_neighbour(self, -1)

        def register(t: torch.Tensor) -> torch.Tensor:
            if t.requires_grad:
                t.register_hook(hook)
            return t

        return map_tensors(register, outputs)

    @torch.no_grad()
    def _post_backward_hook(self, h: Handle, full: torch.Tensor) -> None:
        """Runs when the full flat gradient is complete: start its reduce-scatter, free the full
        params. A reentrant checkpoint inside the instance (torch.utils.checkpoint with
        use_reentrant=True) backpropagates its recomputed part in a nested backward, which
        completes a gradient of its own first: that one is reduced as well (the shards add up),
        and the full params stay for the rest of the outer backward, which still holds views of
        them. An instance the checkpoint covers whole (its first forward ran without autograd)
        has its whole gradient in the nested backward, and is freed there as usual."""
        grad = full.grad
        if grad is None:
            return
        if grad.requires_grad:
            raise RuntimeError(
                "FullyShardedDataParallel: a backward with create_graph=True that reaches the parameters' gradients "
                "is not supported (the reduced gradient shards would carry no graph); a gradient penalty is: take "
                "the gradient with respect to the inputs, torch.autograd.grad(outputs, inputs, create_graph=True)"
            )
        root = self._root
        if self._released_in_forward and not self._pre_backward_hook_has_run:
            # Its backward ran without its pre-backward hook, on the buffers its forward released.
            # Had they stayed released, reading them would have failed in torch (setStorage) and
            # this gradient does not need them; a gather into them meanwhile (a prefetch) may have
            # been read while it was writing.
            regathered = any(h.has_full or h.gathering is not None for h in self._handles)
            self._finish_gathers()
            if regathered:
                raise RuntimeError(
                    f"FullyShardedDataParallel ({type(self.module).__name__}): the backward reached this instance's "
                    "parameters but not the outputs of its forward (a result kept in an attribute and read by the "
                    "parent, say), after its full parameters had been released at the end of that forward: return "
                    "the tensors the loss depends on from forward, or build this instance with "
                    "reshard_after_forward=False"
                )
        if not root._pre_backward_hook_has_run:
            # No pre-backward hook ran: the outputs' tensors were out of its reach (_scan_outputs).
            root._pre_backward_hook_has_run = True
            root._backward_task = _graph_task()
            torch.autograd.Variable._execution_engine.queue_callback(root._wait_for_post_backward)
            root._backward_open = True
        outer_needs_full = self._outer_uses_full and _graph_task() != self._root._backward_task
        self.training_state = TrainingState.BACKWARD_POST
        if self._require_backward_grad_sync:
            full.grad = None
            if self.fp32_reduce_scatter and grad.dtype is not torch.float32:
                g32 = torch.empty(grad.shape, dtype=torch.float32, device=grad.device)
                _copy(g32, grad)
                grad = g32
            pre, post = self.gradient_predivide_factor, self.gradient_postdivide_factor
            # FairScale divides by each factor only where it is > 1: the engine's average is that
            # where both are >= 1 and their product is the world size
            average = pre >= 1 and post >= 1 and abs(pre * post - self.world_size) < 1e-6
            if not average and pre > 1:
                grad.div_(pre)  # before the sum, as FairScale: fp16 stays in range
            self._root._bucket.add(self, h, grad, average)
        if (self._require_backward_grad_sync or self.reshard_after_forward) and not outer_needs_full:
            free_storage(h.full.detach())
            h.has_full = False

    @torch.no_grad()
    def _wait_for_post_backward(self) -> None:
        """Root only, at the end of backward: finish every reduce-scatter and set the grad shards."""
        self._backward_open = False
        keep_full, self._creates_graph = self._creates_graph, False
        self._grads_graph_pending = keep_full
        self._bucket.drain()
        for m in self._fsdp_instances:
            m._use_shard_params()
            if m._require_backward_grad_sync:
                m._free_full_params(keep_memory=keep_full)
                m._leave_shaped_views()
            else:
                self._grads_shown = m._show_accumulated_grads() or self._grads_shown
                m._leave_shaped_views()  # those its post-backward hook released (resharding)
            m._pre_backward_hook_has_run = False
            m.training_state = TrainingState.IDLE

    def _settle_failed_backward(self) -> None:
        """Called outside backward where a user's call begins (forward, summon_full_params,
        clip_grad_norm_, the state dicts): a backward that raised ran no end of backward
        (_wait_for_post_backward), and its states, full parameters and reduce-scatters are still
        there. They are put away, and that backward leaves no gradient: the reduce-scatters it
        started are finished (every rank started the same ones) and their results dropped, and
        so is the full gradient accumulated since the last synchronised backward (no_sync()).
        The gradient shards on ``.grad`` are as that backward found them. Only on the training
        loop's thread (the last forward's) outside a backward: another thread's call (a monitor
        reading parameters()) cannot tell a backward that failed from one that is running."""
        root = getattr(self, "_root", None)  # set by the root's first forward
        if root is None or not root._backward_open or _graph_task() != -1:
            return
        if root._loop_thread != threading.get_ident():
            return
        root._backward_open = root._creates_graph = root._grads_graph_pending = False
        try:
            root._bucket.abandon()
        finally:
            with torch.no_grad():
                for m in root._fsdp_instances:
                    for h in m._handles:
                        if h.shown is None:  # not no_sync()'s gradient shown on .grad
                            h.full.grad = None
                    m._use_shard_params()
                    m._free_full_params()
                    m._leave_shaped_views()
                    m._pre_backward_hook_has_run = False
                    m.training_state = TrainingState.IDLE

    @torch.no_grad()
    def _show_accumulated_grads(self) -> bool:
        """After a backward in no_sync(): each flat parameter's ``.grad`` shows the full gradient
        accumulated so far, unreduced, as FairScale's do (full size, in the compute dtype), so that
        zero_grad() discards it and clip_grad_norm_ sees it, until the next backward starts
        (_take_back_accumulated_grads). A gradient shard the parameter held is kept aside. Whether
        any is shown."""
        shown = False
        for h in self._handles:
            base = h.full.grad
            if base is None:
                continue
            p = h.param
            if h.shown is not None and p.grad is not h.shown:
                continue  # changed by the caller since, in a backward nothing took back (hidden outputs)
            n = h.layout.numel
            view = base[:n] if self.flatten_parameters else base[:n].view(h.layout.slots[0].shape)
            if h.shown is None:
                h.saved_shard = p.grad
            shard = p.data
            p.data = view  # .grad takes a tensor of the parameter's shape and dtype only
            p.grad = view
            p.data = shard
            h.shown = view
            shown = True
        return shown

    @torch.no_grad()
    def _take_back_accumulated_grads(self) -> None:
        """Root, as a backward starts (its pre-backward hook; after the forward when no hook can be
        put on the outputs): what no_sync() showed on ``.grad`` goes back to the full buffers'
        gradients, where this backward accumulates and the first synchronised one reduces it.
        As in FairScale: a ``.grad`` set to None (zero_grad()) drops it, zeroed in place it
        restarts from zero, a full-size tensor assigned replaces it, and a shard-size one is
        taken as the gradient shard (the accumulation dropped). Any other size is a ValueError,
        once every parameter is back as it was before no_sync()."""
        if not self._grads_shown:
            return
        wrong = []
        for m in self._fsdp_instances:
            for h in m._handles:
                if h.shown is None:
                    continue
                p, shown, g = h.param, h.shown, h.param.grad
                p.grad = None
                if g is None:
                    h.full.grad = None
                elif g is not shown:
                    if g.numel() == shown.numel():
                        full = torch.zeros_like(h.full)
                        full[: g.numel()].copy_(g.reshape(-1))
                        h.full.grad = full
                    elif g.shape == p.shape:
                        h.saved_shard, h.full.grad = g, None
                    else:
                        wrong.append(f"'{h.backing_name}' ({g.numel()} elements)")
                p.grad = h.saved_shard
                h.shown = h.saved_shard = None
        self._grads_shown = False
        if wrong:
            raise ValueError(
                "FullyShardedDataParallel: after a backward in no_sync(), .grad was set to a tensor of neither the "
                f"full gradient's size nor the shard's: {', '.join(wrong)}; it is left out"
            )

    def _accumulate_grad(self, h: Handle, reduced: torch.Tensor) -> None:
        p = h.param
        if h.shown is not None:  # reduced without a take-back (hidden outputs): the shard comes back
            p.grad = h.saved_shard
            h.shown = h.saved_shard = None
        target_device = torch.device("cpu") if self.move_grads_to_cpu else p.device
        if p.grad is None:
            if reduced.dtype is p.dtype and reduced.device == target_device:
                p.grad = reduced
            else:
                g = torch.empty(p.shape, dtype=p.dtype, device=target_device)
                _copy(g, reduced)
                p.grad = g
        else:
            p.grad.add_(reduced.to(device=p.grad.device, dtype=p.grad.dtype))
