"""Spawning ranks for multi-process tests: one job runs `fn(rank, world_size, *args)` on every
rank (fresh interpreters, 'spawn' start method) and returns each rank's result, re-raising a
rank's exception with its traceback. Ranks get RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT; an
`env` value "__per_rank__" becomes "host<rank>" (to give each rank a different identity)."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import time
import socket
import traceback
from typing import Any, Callable, Dict, List, Optional


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shm_segments() -> set:
    """Names of fairscale_c segments currently in /dev/shm."""
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith("fsc-")}
    except FileNotFoundError:
        return set()


def orphaned_segments() -> set:
    """fairscale_c segments whose creating process (the pid in the name, "fsc-<pid>-...") is gone:
    left behind by a run that has ended. Segments of live processes are not counted, so that other
    runs on the same machine, which share /dev/shm, do not make a leak check fail."""
    orphans = set()
    for name in shm_segments():
        pid = name.split("-")[1] if name.count("-") >= 2 else ""
        if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            orphans.add(name)
    return orphans


def _entry(fn: Callable, rank: int, world: int, port: int, env: Dict[str, str], q: Any, args: tuple) -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    os.environ.update({k: (v if v != "__per_rank__" else f"host{rank}") for k, v in env.items()})
    try:
        q.put((rank, True, fn(rank, world, *args)))
    except BaseException:
        q.put((rank, False, traceback.format_exc()))


def run_ranks(
    fn: Callable,
    world: int,
    *args: Any,
    env: Optional[Dict[str, str]] = None,
    timeout: float = 300,
    may_die: Optional[List[int]] = None,
) -> List[Any]:
    """Run `fn` (a module-level function) on `world` ranks; return results indexed by rank.
    Ranks in `may_die` may exit without reporting (their result is None)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world, port, dict(env or {}), q, args), daemon=True)
        for r in range(world)
    ]
    for p in procs:
        p.start()
    results: Dict[int, Any] = {}
    errors: List[str] = []
    reported: set = set()
    deadline = time.monotonic() + timeout
    try:
        while len(reported) < world and time.monotonic() < deadline:
            if all(r in reported or (r in (may_die or []) and not procs[r].is_alive()) for r in range(world)):
                break
            try:
                rank, ok, value = q.get(timeout=0.1)
            except queue.Empty:
                continue
            reported.add(rank)
            if ok:
                results[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    missing = [r for r in range(world) if r not in results and r not in (may_die or [])]
    if missing:
        raise AssertionError(f"ranks {missing} did not report within {timeout} s")
    return [results.get(r) for r in range(world)]
