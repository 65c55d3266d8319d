"""Spawned CPU ranks for the stand-alone layer benchmarks (benchmarks/moe.py,
benchmarks/model_parallel.py): each rank joins a gloo process group, runs the benchmark's body and
rank 0's result comes back; a rank that dies or a run past its timeout is an error, never a hang.

Also: timing frameworks in alternating rounds (the order flips every round, a barrier before each
framework's steps, the slower rank's mean step per round) and a step's peak resident memory (the
rise of VmHWM, reset through /proc/self/clear_refs, over the resident size before the step; the
"memory" runs fix glibc's mmap threshold at 64 KiB so that freed tensors leave the resident set).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import queue
import socket
import time
from typing import Any, Callable, Dict, List

import torch


def max_over_ranks(value: float) -> float:
    import torch.distributed as dist

    t = torch.tensor([value])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def peak_rise_mib(step: Callable[[], None]) -> float:
    """MiB the resident high-water mark rises above the resident size during one step."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        return float("nan")
    before = rss_kib("VmRSS")
    step()
    return (rss_kib("VmHWM") - before) / 1024


def timed_rounds(steps: Dict[str, Callable[[], None]], rounds: int, per_round: int) -> Dict[str, List[float]]:
    """Per framework, the slower rank's mean step of each round (one warm-up step first)."""
    import torch.distributed as dist

    for step in steps.values():
        step()
    names = list(steps)
    times: Dict[str, List[float]] = {f: [] for f in names}
    for r in range(rounds):
        for f in names if r % 2 == 0 else names[::-1]:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(per_round):
                steps[f]()
            times[f].append(max_over_ranks((time.perf_counter() - start) / per_round))
    return times


def _rank_entry(rank: int, world: int, port: int, body: Callable, cfg: Dict[str, Any], mode: str, q: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    try:
        result = body(rank, cfg, mode)
        if rank == 0:
            q.put(result)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(body: Callable, world: int, cfg: Dict[str, Any], mode: str, timeout: float) -> Any:
    """`body(rank, cfg, mode)` (a module-level function) on `world` spawned ranks; rank 0's result."""
    env = dict(os.environ)
    if mode == "memory":
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # read by the ranks' C library at start
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_rank_entry, args=(r, world, port, body, cfg, mode, q), daemon=True) for r in range(world)
    ]
    try:
        for p in procs:
            p.start()
    finally:
        os.environ.clear()
        os.environ.update(env)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                return q.get(timeout=1.0)
            except queue.Empty:
                dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead or all(p.exitcode is not None for p in procs):
                    raise RuntimeError(f"ranks ended without a result (rank, exit code): {dead}") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no result within {timeout} s") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


def times_and_peaks(body: Callable, world: int, cfg: Dict[str, Any], timeout: float = 1800) -> Dict[str, Any]:
    """`body` run twice on fresh ranks, mode "time" then "memory"; each returns {row: {framework:
    {...}}}, and the memory run's entries are merged into the time run's."""
    results = run_world(body, world, cfg, "time", timeout)
    for row, peaks in run_world(body, world, cfg, "memory", timeout).items():
        for framework, values in peaks.items():
            results[row][framework].update(values)
    return results


def save(path: str, cfg: Dict[str, Any], results: Dict[str, Any]) -> None:
    import json
    from pathlib import Path

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": cfg, "results": results}, indent=1) + "\n")
