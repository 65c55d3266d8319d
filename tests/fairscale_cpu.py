"""FairScale 0.4.13's FSDP on a CPU-only torch, for tests that compare with it (not for speed).

Its FSDP issues its work on CUDA side streams, moves a norm to the GPU, and reduce-scatters with
a collective gloo lacks. ``enable()`` turns the stream calls and ``Tensor.cuda()`` into no-ops (on
the CPU every op runs in order anyway) and gives gloo a reduce-scatter made of an all-reduce, in
this process only. Importing FairScale is
left to the caller (tests skip visibly when it is not importable: see ``make fairscale-tests``).
"""

import contextlib

import torch
import torch.distributed as dist


class _Stream:
    """Stands for every CUDA stream: the host runs the ops in order."""

    def wait_stream(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, *args, **kwargs) -> None:
        return None

    def wait_event(self, *args, **kwargs) -> None:
        pass


def _reduce_scatter_base(output, inp, group=None, op=dist.ReduceOp.SUM, async_op=False):
    total = inp.clone()
    dist.all_reduce(total, op=op, group=group)
    n = output.numel()
    rank = dist.get_rank(group)
    output.copy_(total.reshape(-1)[rank * n : (rank + 1) * n].view_as(output))


def _reduce_scatter(output, input_list, group=None, op=dist.ReduceOp.SUM, async_op=False):
    _reduce_scatter_base(output, torch.cat([t.reshape(-1) for t in input_list]), group, op)


def enable() -> None:
    """Let FairScale's FullyShardedDataParallel run here (call before building one)."""
    from fairscale.nn.data_parallel import fully_sharded_data_parallel as fsdp

    stream = _Stream()
    torch.cuda.Stream = lambda *args, **kwargs: stream
    torch.cuda.stream = lambda s=None: contextlib.nullcontext()
    torch.cuda.current_stream = lambda *args, **kwargs: stream
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.Tensor.record_stream = lambda self, s: None
    torch.Tensor.cuda = lambda self, *args, **kwargs: self  # its clip_grad_norm_ moves the norm there
    dist._reduce_scatter_base = _reduce_scatter_base
    dist.reduce_scatter = _reduce_scatter
    setup = fsdp.FullyShardedDataParallel._setup_streams

    def _setup_streams(self):
        setup(self)  # creates none without CUDA
        for name in ("fp32_to_fp16", "all_gather", "post_backward"):
            self._streams.setdefault(name, stream)

    fsdp.FullyShardedDataParallel._setup_streams = _setup_streams
    gather = fsdp.FullyShardedDataParallel._gather_optim_state

    def _gather_optim_state(self, *args, **kwargs):
        # It keeps x.cpu() of each gathered chunk and reuses the gather buffer for the next state:
        # from a GPU that is a copy; on the CPU it would be the buffer itself.
        cpu = torch.Tensor.cpu
        torch.Tensor.cpu = lambda t, *a, **k: t.clone() if t.device.type == "cpu" else cpu(t, *a, **k)
        try:
            return gather(self, *args, **kwargs)
        finally:
            torch.Tensor.cpu = cpu

    fsdp.FullyShardedDataParallel._gather_optim_state = _gather_optim_state
