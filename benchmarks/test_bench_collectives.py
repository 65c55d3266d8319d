"""CPU collectives at world 2: fairscale_c's shared-memory engine, and the same call through
torch.distributed gloo as the paired case (same tensors, same rank processes).

Each case first runs the op once on known data and checks the result, then times it: a round is
`calls` back-to-back calls on every rank after a barrier, and the round's per-call time is the
slowest rank's elapsed time / calls (see _harness.measured_time). extra_info has algorithm and bus
bandwidth as nccl-tests defines them (S = bytes of the full buffer: all_reduce, broadcast and
reduce the tensor, all_gather the output, reduce_scatter the input, all_to_all_single's input; algbw
= S / t; busbw = algbw * 2(n-1)/n for all_reduce, (n-1)/n for all_gather, reduce_scatter and
all_to_all, 1 for broadcast and reduce (to rank 0)) and, on the
fairscale_c cases, the ratio of its bus bandwidth to gloo's from the paired case run just before.
fairscale_c_shared is fairscale_c with the buffers in shared tensors (shared_empty), which the
ranks map: the engine then copies straight between them.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Tuple

import pytest
from conftest import WORLD

from _harness import RankState, drive, measured_time, median, time_calls

KiB, MiB = 1024, 1024 * 1024
OPS = ["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "all_to_all"]
# name -> (S in bytes, calls per round): enough calls that a round is well above timer noise,
# few enough that every case takes about a second.
SIZES: Dict[str, Tuple[int, int]] = {"8B": (8, 200), "64KiB": (64 * KiB, 100), "16MiB": (16 * MiB, 3)}
# gloo first: the fairscale_c cases read its median for the ratio. fairscale_c_shared: the same op
# with its buffers in shared tensors (fairscale_c.distributed.shared_empty), which the ranks map.
IMPLS = ["gloo", "fairscale_c", "fairscale_c_shared"]
ROUNDS = 10
BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
    "all_to_all": lambda n: (n - 1) / n,
}

# (op, size, impl) -> median seconds per call, for the ratio of the paired cases.
_medians: Dict[Tuple[str, str, str], float] = {}


def _prepare_collective(state: RankState, impl: str, op: str, nbytes: int) -> None:
    """Rank command: build the tensors of `op` over S = nbytes (float32), run it once through
    `impl` on rank-distinct data and check the result, then zero the tensors and leave the call
    in state.op for time_calls."""
    import torch
    import torch.distributed as dist

    state.op = None  # drop the previous case's tensors before allocating
    n, r, g = state.world, state.rank, state.group
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if nbytes % (4 * n):
        raise ValueError(f"nbytes must be a multiple of 4 * world ({4 * n}), got {nbytes}")
    numel, block = nbytes // 4, nbytes // 4 // n
    ours = impl != "gloo"
    ramp = torch.arange(numel, dtype=torch.float32)  # exact in float32 up to 2**24 elements
    if impl == "fairscale_c_shared":
        import fairscale_c.distributed as fdist

        def new(x: Any) -> Any:  # x's values in a shared tensor
            return fdist.shared_empty(x.numel(), group=g).copy_(x)

    else:

        def new(x: Any) -> Any:
            return x

    call: Callable[[], Any]
    if op == "all_reduce":
        t = new(torch.full((numel,), float(r + 1)))
        call = (lambda: g.all_reduce(t)) if ours else (lambda: dist.all_reduce(t))
        call()
        expected, outs = torch.full((numel,), float(n * (n + 1) // 2)), [t]
        got = t
    elif op == "all_gather":
        inp, out = new(torch.full((block,), float(r + 1))), new(torch.empty(numel))
        call = (lambda: g.all_gather(out, inp)) if ours else (lambda: dist.all_gather_into_tensor(out, inp))
        call()
        expected, outs = torch.arange(1, n + 1, dtype=torch.float32).repeat_interleave(block), [inp, out]
        got = out
    elif op == "reduce_scatter":
        inp, out = new(ramp * (r + 1)), torch.empty(block)
        call = (lambda: g.reduce_scatter(out, inp)) if ours else (lambda: dist.reduce_scatter_tensor(out, inp))
        call()
        expected, outs = ramp[r * block : (r + 1) * block] * (n * (n + 1) // 2), [inp, out]
        got = out
    elif op == "broadcast":
        t = new(ramp * (r + 1))
        call = (lambda: g.broadcast(t, root=0)) if ours else (lambda: dist.broadcast(t, src=0))
        call()
        expected, outs = ramp, [t]
        got = t
    elif op == "reduce":  # to rank 0; only the root's result is defined (gloo may use the others' as scratch)
        t = new(ramp * (r + 1))
        call = (lambda: g.reduce(t, root=0)) if ours else (lambda: dist.reduce(t, dst=0))
        call()
        expected, outs = (ramp * (n * (n + 1) // 2) if r == 0 else t), [t]
        got = t
    elif op == "all_to_all":  # all_to_all_single: block j of each rank's input goes to rank j
        inp, out = new(ramp + r * numel), new(torch.empty(numel))
        call = (lambda: g.all_to_all_single(out, inp)) if ours else (lambda: dist.all_to_all_single(out, inp))
        call()
        expected = torch.cat([ramp[r * block : (r + 1) * block] + i * numel for i in range(n)])
        outs, got = [inp, out], out
    else:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    if not torch.equal(got, expected):
        bad = (got != expected).nonzero()[0].item()
        raise AssertionError(
            f"{impl} {op} of {nbytes} B: element {bad} is {got[bad].item()}, expected {expected[bad].item()}"
        )
    for x in outs:  # timed calls run on zeros: all_reduce would otherwise grow its data to inf
        x.zero_()
    state.op = call


@pytest.mark.benchmark(timer=measured_time)
@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("op", OPS)
def test_collective(benchmark: Any, ranks: Any, op: str, size: str, impl: str) -> None:
    nbytes, calls = SIZES[size]
    benchmark.group = f"collective {op} {size} world {WORLD}"
    ranks.run(_prepare_collective, impl, op, nbytes)
    per_call = drive(benchmark, lambda: max(ranks.run(time_calls, calls)) / calls, ROUNDS)
    t = median(per_call)
    algbw = nbytes / t / 1e9
    info = {
        "op": op,
        "impl": impl,
        "world": WORLD,
        "bytes": nbytes,
        "dtype": "float32",
        "calls_per_round": calls,
        "timing": "slowest rank's time for calls_per_round back-to-back calls after a barrier, / calls_per_round",
        "algbw_GBps": algbw,
        "busbw_GBps": algbw * BUS_FACTOR[op](WORLD),
    }
    _medians[(op, size, impl)] = t
    if impl != "gloo":
        gloo = _medians.get((op, size, "gloo"))
        # The paired gloo case ran just before in this session (None when it was deselected).
        info["busbw_vs_gloo"] = gloo / t if gloo is not None else None
    benchmark.extra_info.update(info)
