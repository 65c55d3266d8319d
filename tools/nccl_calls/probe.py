"""What one small collective costs on the host: fairscale_c's group against torch.distributed,
two ranks (both on cuda:0 with --device cuda, which needs NCCL >= 2.30 and
NCCL_MULTI_RANK_GPU_ENABLE=1; under MPS for timings that mean something), an all_reduce of 8 B
and of 64 KiB. Each call is timed alone (the enqueue, or the whole op on CPU) and with a device
synchronisation after it; with the counter preloaded, the threads started, yields and sleeps
per call are printed too. On CUDA a third row calls the group's NCCL backend directly (the op on
the current stream, without the group's side stream, events and Work), which splits our time
between the Python layer and the C path:

    cc -shared -fPIC -O2 -o /tmp/callcount.so tools/nccl_calls/callcount.c -ldl
    LD_PRELOAD=/tmp/callcount.so python3 tools/nccl_calls/probe.py --device cuda

FAIRSCALE_C_NCCL_BLOCKING picks our communicators' mode, as always.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import queue
import socket
import statistics
import time
from typing import Dict, Tuple

import torch
import torch.multiprocessing as mp


def _counts(lib: ctypes.CDLL) -> Tuple[int, int, int]:
    try:
        return lib.cc_creates(), lib.cc_yields(), lib.cc_sleeps()
    except AttributeError:  # the counter is not preloaded
        return 0, 0, 0


def _rank(rank: int, world: int, port: int, calls: int, device: str, q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch.distributed as dist

    import fairscale_c.distributed as fdist

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", rank=rank, world_size=world)
    group = fdist.init_group()
    lib = ctypes.CDLL(None)
    out: Dict[Tuple[str, int], tuple] = {}
    for numel in (2, 16384):
        t = torch.ones(numel, device="cuda" if cuda else "cpu")
        variants = [("fairscale_c", lambda t=t: group.all_reduce(t)), ("torch", lambda t=t: dist.all_reduce(t))]
        if cuda:  # the NCCL backend alone, on the current stream: no side stream, events or Work
            nccl = group._cuda()
            variants.insert(1, ("fsc backend", lambda t=t, nccl=nccl: nccl.all_reduce(t, "sum")))
        for name, call in variants:
            for _ in range(30):
                call()
            sync()
            dist.barrier()
            before = _counts(lib)
            alone, synced = [], []
            for _ in range(calls):
                a = time.perf_counter()
                call()
                b = time.perf_counter()
                sync()
                synced.append(time.perf_counter() - a)
                alone.append(b - a)
            per_call = [(y - x) / calls for x, y in zip(before, _counts(lib))]
            out[(name, numel * 4)] = (statistics.median(alone) * 1e6, statistics.median(synced) * 1e6, per_call)
            dist.barrier()
    group.destroy()
    dist.destroy_process_group()
    q.put((rank, out))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--calls", type=int, default=300, help="timed calls per op and size")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, 2, port, args.calls, args.device, q)) for r in range(2)]
    for proc in procs:
        proc.start()
    res: Dict[int, dict] = {}
    deadline = time.monotonic() + 300
    while len(res) < len(procs):
        if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
            for proc in procs:
                proc.kill()
            raise SystemExit("a rank failed or timed out (see its traceback above)")
        try:
            rank, out = q.get(timeout=1)
            res[rank] = out
        except queue.Empty:
            pass
    for proc in procs:
        proc.join(30)
    mode = os.environ.get("FAIRSCALE_C_NCCL_BLOCKING") or "1 (default)"
    print(f"device {args.device}, FAIRSCALE_C_NCCL_BLOCKING={mode}; medians of {args.calls} calls")
    for key in res[0]:
        for r in sorted(res):
            alone, synced, c = res[r][key]
            print(
                f"rank {r} {key[0]:12s} all_reduce {key[1]:6d} B: call {alone:7.1f} us, call + sync {synced:7.1f} us; "
                f"per call: {c[0]:.2f} threads started, {c[1]:.1f} yields, {c[2]:.2f} sleeps"
            )


if __name__ == "__main__":
    main()
