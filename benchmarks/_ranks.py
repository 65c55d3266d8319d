"""Spawned CPU ranks for the stand-alone layer benchmarks (benchmarks/moe.py,
benchmarks/model_parallel.py, benchmarks/sync_batchnorm.py): each rank joins a gloo process
group, runs the benchmark's body and rank 0's result comes back; a rank that dies or a run past
its timeout is an error, never a hang.

Also: timing frameworks in alternating rounds (the order flips every round, a barrier before each
framework's steps, the slower rank's mean step per round) and a step's peak resident memory (the
rise of VmHWM, reset through /proc/self/clear_refs, over the resident size before the step; the
"memory" runs fix glibc's mmap threshold at 64 KiB so that freed tensors leave the resident set),
and the command line the three share (bench_main).
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import queue
import socket
import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

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
    """MiB the resident high-water mark rises above the resident size during one step. The kernel
    folds each thread's page counts into the process's in batches (up to 64 pages a thread), so
    the marks read before and after carry that much noise: a step that allocates almost nothing
    can read a little below zero, which is returned as 0."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
    except OSError:
        return float("nan")
    before = rss_kib("VmHWM")
    step()
    return max(0.0, (rss_kib("VmHWM") - before) / 1024)


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


def time_steps(steps: Dict[str, Callable[[], None]], cfg: Dict[str, Any]) -> Dict[str, Dict[str, Any]]:
    """timed_rounds over ``cfg``'s rounds and steps: per framework, the median step and the rounds."""
    rounds = timed_rounds(steps, cfg["rounds"], cfg["steps"])
    return {f: {"step_s": statistics.median(v), "rounds_s": v} for f, v in rounds.items()}


def parse_triples(text: str, example: str) -> List[Tuple[int, int, int]]:
    """Comma-separated AxBxC of positive ints (argparse.ArgumentTypeError otherwise)."""
    sizes = []
    for item in text.split(","):
        parts = item.split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise argparse.ArgumentTypeError(f"expected triples like {example}, got {item!r}")
        sizes.append((int(parts[0]), int(parts[1]), int(parts[2])))
    return sizes


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


def bench_main(
    doc: str,
    argv: Optional[Sequence[str]],
    *,
    sizes_flag: str,
    sizes_help: str,
    parse_sizes: Callable[[str], list],
    sizes: list,
    quick: list,
    rank_main: Callable,
    world: int,
    table: Callable[[Dict[str, Any]], str],
    results_path: str,
    peer_installed: bool,
    default_steps: int = 3,
    full_rounds: int = 5,
) -> int:
    """The benchmarks' command line: ``--quick`` (the `quick` sizes, 2 rounds), ``sizes_flag``
    (parsed by `parse_sizes`, which raises argparse.ArgumentTypeError), ``--rounds``, ``--steps``,
    ``--out``; then times_and_peaks of `rank_main` on `world` ranks, the table on stdout and the
    JSON at ``--out``. Says so on stderr when FairScale (the peer column) is not installed."""
    import sys

    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--quick", action="store_true", help=f"{quick}, 2 rounds")
    p.add_argument(sizes_flag, dest="sizes", type=parse_sizes, default=None, help=sizes_help)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--steps", type=int, default=default_steps, help="steps per framework per round")
    p.add_argument("--out", default=results_path)
    args = p.parse_args(argv)
    cfg = {
        "sizes": args.sizes or (quick if args.quick else sizes),
        "rounds": args.rounds or (2 if args.quick else full_rounds),
        "steps": args.steps,
    }
    if not peer_installed:
        print("fairscale is not installed (pip install fairscale==0.4.13): its column is skipped", file=sys.stderr)
    results = times_and_peaks(rank_main, world, cfg)
    print(table(results))
    save(args.out, cfg, results)
    return 0
