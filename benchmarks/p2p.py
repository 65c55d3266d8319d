"""Point-to-point bandwidth, fairscale_c against gloo, world 2, CPU.

    PYTHONPATH=. python benchmarks/p2p.py [--sizes 64K 1M 16M 64M] [--repeats 20]

Two patterns per message size, each timed on both libraries in the same processes
(benchmarks/_harness.RankPool), alternating within each round:
- exchange: both ranks send their buffer to the other and receive the other's, issued together
  (fairscale_c: ``group.batch``; gloo: ``batch_isend_irecv``), as SlowMo's SGP gossip and a ring
  step do;
- one way: rank 0 sends, rank 1 receives (a pipeline's activation).

Per size and pattern: the median over repeats of the slower rank's time, and GB/s = bytes moved
into one rank / time. Prints a table with gloo ÷ ours.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import RankPool, RankState  # noqa: E402
from collectives import _parse_size  # noqa: E402

SIZES = ["64K", "1M", "4M", "16M", "64M"]


def _time(fn, barrier, repeats: int) -> List[float]:
    out = []
    for _ in range(repeats):
        barrier()
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _patterns(group: Any, rank: int, src: Any, dst: Any) -> Dict[str, Callable[[], None]]:
    import torch.distributed as dist

    import fairscale_c.distributed as fdist

    peer = 1 - rank

    def ours_exchange() -> None:
        group.batch([fdist.P2POp("send", src, peer), fdist.P2POp("recv", dst, peer)])

    def gloo_exchange() -> None:
        ops = [dist.P2POp(dist.isend, src, peer), dist.P2POp(dist.irecv, dst, peer)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()

    def ours_one_way() -> None:
        group.send(src, 1) if rank == 0 else group.recv(dst, 0)

    def gloo_one_way() -> None:
        dist.send(src, 1) if rank == 0 else dist.recv(dst, 0)

    return {
        "ours_exchange": ours_exchange,
        "gloo_exchange": gloo_exchange,
        "ours_one_way": ours_one_way,
        "gloo_one_way": gloo_one_way,
    }


def _measure(state: RankState, sizes: List[int], repeats: int, shared: bool) -> Dict[str, Any]:
    import torch

    import fairscale_c.distributed as fdist

    group, rank = state.group, state.rank
    res: Dict[str, Any] = {}
    for nbytes in sizes:
        if shared:  # rank r sends row r of a tensor every rank maps
            rows = fdist.shared_empty(2, nbytes // 4, group=group)
            rows[rank] = float(rank + 1)
            src = rows[rank]
        else:
            src = torch.full((nbytes // 4,), float(rank + 1))
        dst = torch.empty_like(src)
        fns = _patterns(group, rank, src, dst)
        for fn in fns.values():  # warm-up
            _time(fn, group.barrier, 2)
        row: Dict[str, List[float]] = {name: [] for name in fns}
        for r in range(repeats):
            order = list(fns) if r % 2 == 0 else list(fns)[::-1]
            for name in order:
                row[name] += _time(fns[name], group.barrier, 1)
        if not bool((dst == float(2 - rank)).all()):
            raise AssertionError("wrong data received")
        res[str(nbytes)] = row
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes", nargs="+", type=_parse_size, default=[_parse_size(x) for x in SIZES])
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--shared", action="store_true", help="send from shared tensors (shared_empty)")
    args = p.parse_args(argv)
    sizes = args.sizes
    with RankPool(2) as pool:
        by_rank = pool.run(_measure, sizes, args.repeats, args.shared)
    print(f"point-to-point, world 2, CPU{', sending shared tensors' if args.shared else ''}; load {os.getloadavg()}")
    print("| size | pattern | fairscale_c us | GB/s | gloo us | GB/s | gloo / ours |")
    print("|---|---|---|---|---|---|---|")
    for nbytes in sizes:
        for pattern in ("exchange", "one_way"):
            meds = {}
            for lib in ("ours", "gloo"):
                per_rank = [by_rank[r][str(nbytes)][f"{lib}_{pattern}"] for r in range(2)]
                slowest = [max(a, b) for a, b in zip(*per_rank)]
                meds[lib] = statistics.median(slowest)
            o, g = meds["ours"], meds["gloo"]
            print(
                f"| {nbytes / 2**20:g} MiB | {pattern.replace('_', ' ')} | {o * 1e6:.0f} | {nbytes / o / 1e9:.2f} | "
                f"{g * 1e6:.0f} | {nbytes / g / 1e9:.2f} | {g / o:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
