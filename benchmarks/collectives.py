"""CPU collectives: fairscale_c's shared-memory engine vs torch.distributed gloo, same tensors,
same run, plus single-process memcpy as the roofline, and memcpy with every rank copying at
once (what one rank can copy while its peers copy too).

Reports algorithm and bus bandwidth as nccl-tests defines them (S = bytes of the full buffer:
all_reduce the tensor, all_gather the output, reduce_scatter the input; algbw = S / t;
busbw = algbw * 2(n-1)/n for all_reduce and (n-1)/n for the others), prints a table with ratios
and writes JSON.

    python benchmarks/collectives.py                 # 4 KiB .. 256 MiB, world 2 and 4
    python benchmarks/collectives.py --quick         # a few sizes, about a minute
    python benchmarks/collectives.py --plot out.png  # also plot (needs matplotlib)
    python benchmarks/collectives.py --device cuda   # NCCL backend vs torch's NCCL (not yet run)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import platform
import queue
import socket
import statistics
import sys
import time
import warnings
from typing import Any, Callable, Dict, List

import torch

warnings.filterwarnings("ignore", category=FutureWarning)

OPS = ["all_reduce", "all_gather", "reduce_scatter"]
# Also measured: all_gather whose input is this rank's block of the output (as FSDP calls it;
# nccl-tests reports in-place columns the same way).
MEASURED = OPS + ["all_gather_inplace"]
KiB, MiB = 1024, 1024 * 1024


def _fmt_size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def _parse_size(text: str) -> int:
    units = {"K": KiB, "M": MiB}
    try:
        return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)
    except (ValueError, IndexError):
        raise argparse.ArgumentTypeError(f"size {text!r}: expected bytes or a number with K or M") from None


def _bus_factor(op: str, n: int) -> float:
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def _traffic_busbw(op: str, n: int, memcpy_all: float) -> float:
    """Bus bandwidth the op would reach if the memory traffic it cannot avoid moved at the rate
    every rank's simultaneous memcpy moved data: each rank reads every byte of its input once and
    writes every byte of its output once (slots and other intermediates assumed to stay in the
    caches), and memcpy of B bytes moves 2B (read + non-temporal write). Per rank, with S the full
    buffer: all_reduce 2S, all_gather S/n + S, in-place all_gather S (its own block is read, the
    rest written), reduce_scatter S + S/n. Meaningful only for buffers that do not fit in the
    caches, where memory bandwidth, not the algorithm, bounds every implementation."""
    per_rank = {
        "all_reduce": 2.0,
        "all_gather": 1.0 + 1.0 / n,
        "all_gather_inplace": 1.0,
        "reduce_scatter": 1.0 + 1.0 / n,
    }[op]
    t_over_s = per_rank / (2.0 * memcpy_all)  # seconds per byte of S
    return _bus_factor("all_reduce" if op == "all_reduce" else "all_gather", n) / t_over_s


def _iters(nbytes: int, quick: bool) -> int:
    budget = (64 if quick else 256) * MiB
    return max(3, min(200 if not quick else 50, budget // max(nbytes, 1)))


def _time_op(fn, barrier, iters: int) -> float:
    fn()  # warm-up (page faults, first-touch)
    samples = []
    for _ in range(iters):
        barrier()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _rank_main(rank: int, world: int, port: int, sizes: List[int], quick: bool, device: str, q) -> None:
    """One rank: every op and size on fairscale_c's group and on torch.distributed, same tensors.
    On CUDA the comparison is torch's NCCL process group, and each timed call ends with a device
    synchronisation (both libraries only enqueue)."""
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    import torch.distributed as dist

    import fairscale_c.distributed as fdist

    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", rank=rank, world_size=world)
    group = fdist.init_group()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def timed(call):
        return lambda: (call(), sync())

    torch_barrier = lambda: dist.barrier()  # noqa: E731
    rows = []
    for nbytes in sizes:
        numel = max(world, nbytes // 4) // world * world
        for op in MEASURED:
            if op == "all_reduce":
                t = torch.randn(numel, device=dev)
                ours = lambda t=t: group.all_reduce(t)  # noqa: E731
                gloo = lambda t=t: dist.all_reduce(t)  # noqa: E731
            elif op == "all_gather":
                inp, out = torch.randn(numel // world, device=dev), torch.empty(numel, device=dev)
                ours = lambda out=out, inp=inp: group.all_gather(out, inp)  # noqa: E731
                gloo = lambda out=out, inp=inp: dist.all_gather_into_tensor(out, inp)  # noqa: E731
            elif op == "all_gather_inplace":
                out = torch.randn(numel, device=dev)
                inp = out[rank * (numel // world) : (rank + 1) * (numel // world)]
                ours = lambda out=out, inp=inp: group.all_gather(out, inp)  # noqa: E731
                gloo = lambda out=out, inp=inp: dist.all_gather_into_tensor(out, inp)  # noqa: E731
            else:
                inp, out = torch.randn(numel, device=dev), torch.empty(numel // world, device=dev)
                ours = lambda out=out, inp=inp: group.reduce_scatter(out, inp)  # noqa: E731
                gloo = lambda out=out, inp=inp: dist.reduce_scatter_tensor(out, inp)  # noqa: E731
            if cuda:
                ours, gloo = timed(ours), timed(gloo)
            iters = _iters(numel * 4, quick)
            t_ours = _time_op(ours, group.barrier, iters)
            try:
                t_gloo = _time_op(gloo, torch_barrier, iters)
            except Exception:  # gloo lacks some ops in some torch versions
                t_gloo = float("nan")
            rows.append({"op": op, "bytes": numel * 4, "world": world, "t_ours": t_ours, "t_gloo": t_gloo})
        if not cuda:
            # Every rank copies S bytes at the same moment: on a shared memory bus this is the
            # bandwidth a collective's copies actually get.
            src, dst = torch.randn(numel), torch.empty(numel)
            fn = lambda src=src, dst=dst, n=numel * 4: ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)  # noqa: E731
            t_copy = _time_op(fn, group.barrier, _iters(numel * 4, quick))
            for r in rows:
                if r["world"] == world and r["bytes"] == numel * 4:
                    r["memcpy_all_gbps"] = numel * 4 / t_copy / 1e9
    group.destroy()
    dist.destroy_process_group()
    if rank == 0:
        q.put(rows)


def _memcpy_bw(nbytes: int, quick: bool, device: str = "cpu") -> float:
    """Single-thread libc memcpy bandwidth (bytes copied per second); on CUDA a device-to-device
    copy on one GPU, synchronised."""
    if device == "cuda":
        src, dst = torch.randn(nbytes // 4, device="cuda"), torch.empty(nbytes // 4, device="cuda")
        fn = lambda: (dst.copy_(src), torch.cuda.synchronize())  # noqa: E731
        return src.numel() * 4 / _time_op(fn, lambda: None, _iters(nbytes, quick))
    src, dst = torch.randn(nbytes // 4), torch.empty(nbytes // 4)
    n = src.numel() * 4
    fn = lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)  # noqa: E731
    t = _time_op(fn, lambda: None, _iters(n, quick))
    return n / t


def _spawn_ranks(target: Callable, world: int, args: tuple, timeout_s: float) -> Any:
    """Run target(rank, world, port, *args, q) in `world` spawned processes and return what rank 0
    puts on q. Raises if a rank exits with an error or no result comes within timeout_s; the ranks
    are ended in every case (terminated, then killed, if they do not exit by themselves)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=target, args=(r, world, port, *args, q)) for r in range(world)]
    ok = False
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                result = q.get(timeout=1.0)
                ok = True
                return result
            except queue.Empty:
                pass
            failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed:
                raise RuntimeError(f"world {world}: rank {failed[0][0]} exited with code {failed[0][1]}")
            if all(p.exitcode == 0 for p in procs) and q.empty():
                raise RuntimeError(f"world {world}: the ranks exited without a result")
            if time.monotonic() > deadline:
                raise TimeoutError(f"world {world}: no result within {timeout_s:.0f} s")
    finally:
        for p in procs:
            if p.pid is not None:
                p.join(timeout=30 if ok else 0)
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        q.close()


def run(worlds: List[int], sizes: List[int], quick: bool, device: str = "cpu") -> Dict:
    rows = []
    for world in worlds:
        rows += _spawn_ranks(_rank_main, world, (sizes, quick, device), timeout_s=3600)
    memcpy = {n: _memcpy_bw(n, quick, device) for n in sizes}
    for r in rows:
        n = r["bytes"]
        f = _bus_factor(r["op"], r["world"])
        r["algbw_ours"] = n / r["t_ours"] / 1e9
        r["busbw_ours"] = r["algbw_ours"] * f
        r["algbw_gloo"] = n / r["t_gloo"] / 1e9
        r["busbw_gloo"] = r["algbw_gloo"] * f
        r["memcpy_gbps"] = memcpy[min(memcpy, key=lambda s: abs(s - n))] / 1e9
        r["vs_gloo"] = r["busbw_ours"] / r["busbw_gloo"]
        r["vs_memcpy"] = r["busbw_ours"] / r["memcpy_gbps"]
        if "memcpy_all_gbps" in r:
            r["vs_memcpy_all"] = r["busbw_ours"] / r["memcpy_all_gbps"]
            r["traffic_busbw"] = _traffic_busbw(r["op"], r["world"], r["memcpy_all_gbps"])
            r["vs_traffic"] = r["busbw_ours"] / r["traffic_busbw"]
    return {
        "machine": {
            "cpus": os.cpu_count(),
            "platform": platform.platform(),
            "torch": torch.__version__,
            "python": sys.version.split()[0],
        },
        "dtype": "float32",
        "device": device,
        "baseline": "torch nccl" if device == "cuda" else "torch gloo",
        "shm_chunk_bytes": int(os.environ.get("FAIRSCALE_C_SHM_CHUNK", MiB)),
        "rows": rows,
    }


def print_table(result: Dict) -> None:
    base = "nccl" if result.get("device") == "cuda" else "gloo"  # the torch backend compared against
    head = (
        f"{'op':<19}{'world':>6}{'size':>10}{'ours algbw':>12}{'ours busbw':>12}{base + ' busbw':>12}"
        f"{'memcpy':>9}{'memcpy/all':>11}{'x ' + base:>8}{'/memcpy':>9}{'/m.all':>8}{'traffic':>9}{'/traffic':>9}"
    )
    print(head)
    print("-" * len(head))
    for r in result["rows"]:
        print(
            f"{r['op']:<19}{r['world']:>6}{_fmt_size(r['bytes']):>10}{r['algbw_ours']:>12.2f}{r['busbw_ours']:>12.2f}"
            f"{r['busbw_gloo']:>12.2f}{r['memcpy_gbps']:>9.2f}{r.get('memcpy_all_gbps', float('nan')):>11.2f}"
            f"{r['vs_gloo']:>8.2f}{r['vs_memcpy']:>9.2f}{r.get('vs_memcpy_all', float('nan')):>8.2f}"
            f"{r.get('traffic_busbw', float('nan')):>9.2f}{r.get('vs_traffic', float('nan')):>9.2f}"
        )
    roof = "device-to-device copy" if result.get("device") == "cuda" else "single-thread libc memcpy"
    print(f"bandwidths in GB/s (1e9 bytes/s); busbw per nccl-tests; {base} = torch.distributed; memcpy = {roof}")
    if result.get("device") != "cuda":
        print("memcpy/all = the same memcpy run by every rank of the world at once (per-rank bandwidth)")
        print(
            "traffic = busbw if the bytes no implementation can avoid (each rank reads its input once, writes its"
            " output once) moved at memcpy/all's rate; meaningful for buffers larger than the caches"
        )


def plot(result: Dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({r["world"] for r in result["rows"]})
    fig, axes = plt.subplots(len(worlds), len(OPS), figsize=(5 * len(OPS), 3.6 * len(worlds)), squeeze=False)
    for i, w in enumerate(worlds):
        for j, op in enumerate(OPS):
            rows = [r for r in result["rows"] if r["world"] == w and r["op"] == op]
            x = [r["bytes"] for r in rows]
            ax = axes[i][j]
            ax.plot(x, [r["busbw_ours"] for r in rows], "o-", label="fairscale_c shm")
            if op == "all_gather":
                inplace = [r for r in result["rows"] if r["world"] == w and r["op"] == "all_gather_inplace"]
                ax.plot(
                    [r["bytes"] for r in inplace],
                    [r["busbw_ours"] for r in inplace],
                    "^-",
                    label="fairscale_c in place",
                )
            ax.plot(x, [r["busbw_gloo"] for r in rows], "s-", label="torch gloo")
            ax.plot(x, [r["memcpy_gbps"] for r in rows], "k--", label="memcpy (1 thread)")
            if all("memcpy_all_gbps" in r for r in rows):
                ax.plot(x, [r["memcpy_all_gbps"] for r in rows], "k:", label="memcpy (every rank at once)")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{op}, world {w}")
            ax.set_xlabel("bytes")
            ax.set_ylabel("bus bandwidth GB/s")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="sizes 4 KiB, 1 MiB, 16 MiB; fewer iterations")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--sizes", type=_parse_size, nargs="+", help="buffer sizes (e.g. 16M 64M); overrides --quick's")
    ap.add_argument("--json", default="benchmarks/results/collectives.json")
    ap.add_argument("--plot", default=None, help="write a PNG plot (needs matplotlib)")
    ap.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cuda: fairscale_c's NCCL backend against torch's NCCL process group, device-to-device copy as "
        "the roofline (ranks share GPUs when there are fewer than the world size: NCCL >= 2.30 and "
        "NCCL_MULTI_RANK_GPU_ENABLE=1)",
    )
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch.cuda.is_available() is False")
    sizes = [4 * KiB, MiB, 16 * MiB] if args.quick else [4 * KiB * 4**i for i in range(9)]  # 4 KiB .. 256 MiB
    if args.sizes:
        sizes = args.sizes
    result = run(args.worlds, sizes, args.quick, args.device)
    print_table(result)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {args.json}")
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
