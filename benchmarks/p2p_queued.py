"""Point-to-point latency of a send queued behind a pending receive, fairscale_c against gloo.

    PYTHONPATH=. python benchmarks/p2p_queued.py [--rounds 40]

World 2, CPU. Each round: rank 0 posts an asynchronous receive that rank 1 satisfies only about
20 ms later, waits 5 ms, stamps the time (CLOCK_MONOTONIC, shared by the two processes) into an
8-byte tensor and sends it asynchronously; rank 1 receives the stamp and records how long after
the stamp it arrived. This is the pattern of a pipeline stage that sends an activation while its
receive of a gradient is still outstanding: on fairscale_c the send is queued while the group's
progress thread waits for the receive. The same rounds run on a gloo process group in the same
processes (benchmarks/_harness.RankPool). Prints the median, min and max per framework (first 5
rounds dropped).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import RankPool, RankState  # noqa: E402

WARMUP = 5


def _rounds(rank: int, send, recv, barrier, rounds: int) -> list:
    import torch

    payload = torch.zeros(1000)
    stamp = torch.zeros(1, dtype=torch.float64)
    latencies = []
    for _ in range(rounds):
        barrier()
        if rank == 0:
            pending = recv(payload, 1)
            time.sleep(0.005)
            stamp[0] = time.monotonic()
            sent = send(stamp, 1)
            pending.wait()
            sent.wait()
        else:
            recv(stamp, 0).wait()
            latencies.append(time.monotonic() - stamp[0].item())
            time.sleep(0.02)
            send(payload, 0).wait()
    barrier()
    return latencies


def _measure(state: RankState, rounds: int) -> dict:
    """Rank command: the rounds on the fairscale_c group, then on the gloo group."""
    import torch.distributed as dist

    group = state.group
    return {
        "fairscale_c": _rounds(
            state.rank,
            lambda t, peer: group.send(t, peer, async_op=True),
            lambda t, peer: group.recv(t, peer, async_op=True),
            group.barrier,
            rounds,
        ),
        "gloo": _rounds(state.rank, dist.isend, dist.irecv, dist.barrier, rounds),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=40)
    args = p.parse_args(argv)
    if args.rounds <= WARMUP:
        p.error(f"--rounds must be more than {WARMUP}")
    with RankPool(2) as pool:
        result = pool.run(_measure, args.rounds)[1]
    print(f"send queued behind a pending receive, world 2, CPU; load average {os.getloadavg()}")
    for name, lat in result.items():
        us = sorted(x * 1e6 for x in lat[WARMUP:])
        print(
            f"{name:12s} arrival after the stamp: median {statistics.median(us):8.0f} us, "
            f"min {us[0]:8.0f}, max {us[-1]:8.0f} ({len(us)} rounds)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
