"""Starting ranks for multi-process tests: one job runs `fn(rank, world_size, *args)` on every
rank and returns each rank's result, re-raising a rank's exception with its traceback. Ranks get
the caller's environment as it is at the call, RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT, and
`env`; an `env` value "__per_rank__" becomes "host<rank>" (to give each rank a different
identity)."""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import queue
import signal
import time
import socket
import sys
import traceback
from typing import Any, Callable, Dict, List, Optional

import pytest


def join_gloo(rank: int, world: int, device: str = "cpu") -> None:
    """A spawned rank's set-up: one torch thread, its GPU (device "cuda"), a gloo process group."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("gloo", rank=rank, world_size=world)


class OneRankGroup:
    """A process group stand-in of one rank (rank() and size()), for one-process tests."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1


@contextlib.contextmanager
def rpc_workers(rank: int, world: int, prefix: str = "worker", threads: Optional[int] = None):
    """torch RPC on a joined gloo rank, workers named "<prefix><rank>" (``threads``: each agent's
    RPC thread count, TensorPipe's default where None); yields {rank: name}. The agents shut down
    gracefully only if every rank's body succeeded (the ranks tell each other over gloo first), so
    that no rank waits in a graceful shutdown for a peer that failed."""
    import torch
    import torch.distributed as dist
    from torch.distributed import rpc

    port = torch.tensor([free_port() if rank == 0 else 0])
    dist.broadcast(port, 0)
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port.item()}")
    if threads is not None:
        options.num_worker_threads = threads
    rpc.init_rpc(f"{prefix}{rank}", rank=rank, world_size=world, rpc_backend_options=options)
    succeeded = False
    try:
        yield {r: f"{prefix}{r}" for r in range(world)}
        succeeded = True
    finally:
        everywhere = torch.tensor([int(succeeded)])
        dist.all_reduce(everywhere, op=dist.ReduceOp.MIN)
        rpc.shutdown(graceful=bool(everywhere.item()))


@contextlib.contextmanager
def fairscale_pipeline_rpc(rank: int, world: int):
    """What FairScale's AsyncPipe needs on a joined gloo rank: torch RPC (workers "Test<rank>")
    and FairScale's model parallel groups (one pipeline of every rank). Yields the worker map."""
    from fairscale.nn.model_parallel import initialize_model_parallel

    with rpc_workers(rank, world, "Test") as workers:
        initialize_model_parallel(1, world)
        yield workers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_cmd(script: str, nproc: int, *args: str) -> List[str]:
    """The command line of `script` launched by torchrun with `nproc` processes on this host."""
    import sys

    launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={nproc}"]
    return launcher + ["--master_addr=127.0.0.1", f"--master_port={free_port()}", script, *args]


def torchrun_env() -> Dict[str, str]:
    """The environment the example tests run torchrun in: a short engine timeout, one thread."""
    return dict(os.environ, FAIRSCALE_C_TIMEOUT="60", OMP_NUM_THREADS="1")


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


# torch's CPU build dispatches sqrt, exp, log and the other MKL vector-math functions lazily, and
# a first call that ATen splits across intra-op threads (more than 2048 elements) can run one
# thread's chunk through MKL's low-accuracy kernel: about 1e-4 relative error in float32, 1e-11 in
# float64 (pytorch/pytorch#188792). One single-element call per function and dtype, before any
# reference is computed, settles the dispatch in this process.
_VML_FUNCTIONS = (
    "sqrt", "rsqrt", "exp", "expm1", "log", "log1p", "log2", "log10", "sin", "cos", "tan",
    "asin", "acos", "atan", "sinh", "cosh", "tanh", "erf", "erfc", "erfinv", "sigmoid", "reciprocal",
)  # fmt: skip


def settle_torch_math() -> None:
    import torch

    for dtype in (torch.float32, torch.float64):
        half = torch.full((1,), 0.5, dtype=dtype)
        for name in _VML_FUNCTIONS:
            getattr(half, name)()


@pytest.fixture
def clean_dev_shm():
    """Import it into a test module (autouse there) to fail a test that leaves segments behind."""
    before = orphaned_segments()
    yield
    assert orphaned_segments() - before == set(), "shared-memory segments left in /dev/shm"


def rank_data(rank: int, n: int, dtype: Any, salt: int) -> Any:
    """n deterministic elements for `rank`: normal floats, or small non-negative integers."""
    import torch

    g = torch.Generator().manual_seed(rank * 7919 + n * 31 + salt)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(0, 250, (n,), generator=g).to(dtype)


# torch.testing.assert_close's default tolerances (rtol, atol) per floating dtype
_DEFAULT_TOL = {"float16": (1e-3, 1e-5), "bfloat16": (1.6e-2, 1e-5), "float32": (1.3e-6, 1e-5), "float64": (1e-7, 1e-7)}


def not_equal(got: Any, want: Any) -> str:
    """ "" when `got` and `want` are equal tensors (same shape, dtype and bits), else how many
    elements differ."""
    import torch

    if got.shape != want.shape or got.dtype != want.dtype:
        return f"got {got.dtype}{list(got.shape)}, expected {want.dtype}{list(want.shape)}"
    if torch.equal(got, want):
        return ""
    return f"{(got != want).sum().item()} of {got.numel()} elements differ"


def not_close(got: Any, want: Any, rtol: Optional[float] = None, atol: Optional[float] = None) -> str:
    """ "" when `got` is close to `want` as torch.testing.assert_close decides it (|got - want| <=
    atol + rtol * |want| elementwise, NaN never close, equal infinities close; its default
    tolerances for the dtype unless given), else assert_close's message. The test itself is done
    here, a few times cheaper than assert_close on tensors of megabytes; assert_close runs only to
    describe a mismatch."""
    import torch

    bad = _mismatches(got, want, rtol, atol)
    if not bad:
        return ""
    try:
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    except AssertionError as exc:
        return str(exc).splitlines()[0] + f" ({bad} of {got.numel()} elements)"
    return f"{bad} of {got.numel()} elements not close"


def _mismatches(got: Any, want: Any, rtol: Optional[float], atol: Optional[float]) -> int:
    if got.shape != want.shape or got.dtype != want.dtype:
        return max(got.numel(), want.numel(), 1)
    if not got.dtype.is_floating_point:
        return int((got != want).sum())
    d_rtol, d_atol = _DEFAULT_TOL[str(got.dtype).split(".")[1]]
    rtol, atol = d_rtol if rtol is None else rtol, d_atol if atol is None else atol
    g, w = (got.float(), want.float()) if got.element_size() == 2 else (got, want)
    ok = (g - w).abs_() <= atol + rtol * w.abs()
    return int((~(ok | (g == w))).sum())


class Checks:
    """A rank's comparisons of collective results with a torch reference: the mismatches are
    collected in `failures` (returned to the test, which asserts there are none)."""

    def __init__(self, world: int) -> None:
        self.world, self.failures = world, []

    def __call__(self, got: Any, want: Any, what: str, reduced: bool = False) -> None:
        # copies are exact; so is a reduction over two ranks (either order gives the same bits),
        # while over more ranks its order may differ from torch's
        if not reduced or self.world == 2 or not got.dtype.is_floating_point:
            msg = not_equal(got, want)
        else:
            tol = 1e-2 if got.element_size() == 2 else None
            msg = not_close(got, want, rtol=tol, atol=tol)
        if msg:
            self.failures.append(f"{what}: {msg}")

    def summed(self, blocks: List[Any], dtype: Any, op: str = "sum") -> Any:
        """The sum (or avg) of `blocks` as the engine rounds it: 16-bit floats accumulate in float32."""
        import torch

        wide = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        acc = torch.stack([b.to(wide) for b in blocks]).sum(0)
        return (acc / self.world if op == "avg" else acc).to(dtype)


# Ranks are forked from a server process that has imported torch and pytest and nothing else:
# torch's import is most of a fresh interpreter's start-up, and pytest's is most of the rest (a rank
# imports the caller's main module, pytest's, and the test module, which imports pytest); both
# would be paid for every rank of every test. The server neither starts torch's thread pools nor
# touches a GPU, so forking it is safe; fairscale_c and the test's module are imported in each rank,
# after its environment and stdio are set. The server starts at the first rank.
_RANKS = mp.get_context("forkserver")
_RANKS.set_forkserver_preload(["torch", "pytest"])


class _CallerStdio:
    """Handles to the caller's stdout and stderr, passed to a rank as it starts: a rank forked from
    the server would otherwise write to the server's, which were the caller's when the server
    started (another test's capture, for capfd). In the rank it unpickles to the two descriptors."""

    def __reduce__(self) -> tuple:
        from multiprocessing import reduction

        sys.stdout.flush()
        sys.stderr.flush()
        return (_detach_both, (reduction.DupFd(1), reduction.DupFd(2)))


def _detach_both(out: Any, err: Any) -> tuple:
    return out.detach(), err.detach()


def _entry(
    fn: Callable,
    rank: int,
    world: int,
    port: int,
    stdio: tuple,
    environ: Dict[str, str],
    env: Dict[str, str],
    q: Any,
    args: tuple,
) -> None:
    for fd, target in zip(stdio, (1, 2)):
        os.dup2(fd, target)
        os.close(fd)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # run_ranks asks for it on a timeout
    os.environ.clear()
    os.environ.update(environ)
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
        settle_torch_math()
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
    q = _RANKS.Queue()
    port = free_port()
    procs = [
        _RANKS.Process(
            target=_entry,
            args=(fn, r, world, port, _CallerStdio(), dict(os.environ), dict(env or {}), q, args),
            daemon=True,
        )
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
        stuck = [p for r, p in enumerate(procs) if r not in reported and p.is_alive()]
        if stuck and time.monotonic() >= deadline:
            # every thread's stack of a rank still running at the timeout, on the caller's stderr
            for p in stuck:
                with contextlib.suppress(ProcessLookupError):  # it may have ended just now
                    os.kill(p.pid, signal.SIGUSR1)
            time.sleep(2)
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
