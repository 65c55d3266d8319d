"""Shared pieces of the pytest-benchmark suite (benchmarks/test_*.py).

RankPool: `world` spawned rank processes that live for a whole test module. Each rank joins a gloo
process group and a fairscale_c group once, then serves commands sent over a pipe: a command is a
module-level function `fn(state, *args)` run on every rank at once, whose return value comes back
by rank. Every wait has a timeout; a rank that fails or stops answering brings the pool down
(ranks stopped, then killed), and later commands fail at once naming the first failure.

measured_time: a pytest-benchmark timer (`@pytest.mark.benchmark(timer=measured_time)`) that
advances only by what a case measured itself (`advance`): the slowest rank's time for N
back-to-back calls divided by N, or a CUDA event interval divided by N. With it, pytest-benchmark's
statistics are per-call times of the work, without the pipe round trip that drives the ranks.

check_cuda_ranks / rank_cuda_device: the `--device cuda` choice of the multi-process scripts
(benchmarks/oss.py, benchmarks/pipe_stages.py): exit with a message where CUDA ranks cannot run,
else one GPU per rank (rank r on cuda:r % device_count), or ranks sharing GPUs through NCCL >= 2.30's
NCCL_MULTI_RANK_GPU_ENABLE=1.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import socket
import statistics
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

# Seconds a command may take on the ranks before the pool is declared hung, and the engine's own
# bound on a wait for a peer inside the ranks (FAIRSCALE_C_TIMEOUT), kept below it so a rank
# whose peer failed reports an error before the pool gives up on it.
COMMAND_TIMEOUT_S = 120.0
RANK_ENGINE_TIMEOUT_S = 60
START_TIMEOUT_S = 180.0  # importing torch on a loaded 2-core machine takes a while
STOP_GRACE_S = 20.0
# A rank that hears nothing from the pool for this long exits on its own (a lost parent).
RANK_IDLE_EXIT_S = 1800.0


# ---------------------------------------------------------------- timer


_measured_s = 0.0


def measured_time() -> float:
    """pytest-benchmark timer: the sum of every interval passed to advance() so far (seconds)."""
    return _measured_s


def advance(seconds: float) -> None:
    """Add a measured interval to measured_time()."""
    global _measured_s
    if not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"advance: seconds must be a finite number >= 0, got {seconds!r}")
    _measured_s += float(seconds)


def drive(benchmark: Any, measure: Callable[[], float], rounds: int, warmup_rounds: int = 1) -> List[float]:
    """Run `measure` (returns the seconds per call it measured) under benchmark.pedantic, one call
    per round, feeding measured_time. Returns the per-call seconds of the timed rounds."""
    if rounds < 1 or warmup_rounds < 0:
        raise ValueError(f"drive: rounds must be >= 1 and warmup_rounds >= 0, got {rounds}, {warmup_rounds}")
    seen: List[float] = []

    def one_round() -> None:
        t = measure()
        seen.append(t)
        advance(t)

    benchmark.pedantic(one_round, rounds=rounds, warmup_rounds=warmup_rounds, iterations=1)
    # With --benchmark-disable pedantic runs the target once, with no warm-up.
    return seen[warmup_rounds:] if len(seen) > warmup_rounds else seen


def median(values: List[float]) -> float:
    return statistics.median(values)


def record_training(
    benchmark: Any,
    results: Dict[str, Dict[str, Any]],
    framework: str,
    base: str,
    per_step: List[float],
    losses: List[List[float]],
    info: Dict[str, Any],
    steps_per_round: int,
    loss_atol: float,
) -> None:
    """A training benchmark's bookkeeping and guards: records `framework`'s median step and its
    ranks' `losses` in `results`; adds to `info` (the case's fixed description) the first and last
    losses, the step time as a ratio of `base`'s (the framework measured first) and, for
    fairscale_c, its largest loss difference from `base`; stores `info` in the benchmark's
    extra_info; then asserts every loss is finite, the loss fell, and fairscale_c's losses are
    within `loss_atol` of `base`'s (both train the same global batch)."""
    t = median(per_step)
    results[framework] = {"step_s": t, "losses": losses}
    info["loss_first"] = [r[0] for r in losses]
    info["loss_last"] = [r[-1] for r in losses]
    ref = results.get(base)
    info[f"step_vs_{base}"] = t / ref["step_s"] if ref is not None and framework != base else None
    diff_key = f"max_abs_loss_diff_vs_{base}"
    if framework == "fairscale_c" and ref is not None:
        info[diff_key] = max(abs(a - b) for mine, theirs in zip(losses, ref["losses"]) for a, b in zip(mine, theirs))
    benchmark.extra_info.update(info)
    for rank, rank_losses in enumerate(losses):
        assert all(math.isfinite(v) for v in rank_losses), f"{framework} rank {rank}: non-finite loss {rank_losses}"
        tail = rank_losses[-steps_per_round:]
        assert sum(tail) / len(tail) < rank_losses[0], f"{framework} rank {rank}: the loss did not fall {rank_losses}"
    if diff_key in info:
        assert info[diff_key] <= loss_atol, f"fairscale_c's losses differ from {base}'s by {info[diff_key]:.3g}"


# ---------------------------------------------------------------- device choice

# NCCL refuses two ranks on one GPU before 2.30; from 2.30 on this variable allows it.
NCCL_SHARE_ENV = "NCCL_MULTI_RANK_GPU_ENABLE"
NCCL_SHARE_MIN_VERSION = (2, 30)


def _torch_nccl_version() -> Optional[Tuple[int, ...]]:
    import torch

    try:
        v = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    if isinstance(v, int):  # older torch: one code, e.g. 23102 or 2708
        return (v // 10000, v // 100 % 100, v % 100) if v >= 10000 else (v // 1000, v // 100 % 10, v % 100)
    return tuple(v)


def mps_running() -> bool:
    """Whether an MPS control daemon answers for this process: its pipe directory
    (CUDA_MPS_PIPE_DIRECTORY, default /tmp/nvidia-mps) holds the `control` pipe while it runs.
    Under MPS, ranks sharing a GPU run their kernels at the same time; without it the GPU
    time-slices between their processes, and collectives then wait for the other's slice."""
    pipe_dir = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"
    return os.path.exists(os.path.join(pipe_dir, "control"))


def check_cuda_ranks(world: int, flag: str = "--device cuda") -> str:
    """For `flag`: check that `world` ranks can run on this machine's GPUs and return a one-line
    note saying how (GPU per rank, or sharing). Exits with a message (SystemExit, status 1) when
    torch has no usable CUDA device, or when there are fewer GPUs than ranks and NCCL cannot
    share one. When sharing is possible (torch's NCCL >= 2.30, or NCCL_MULTI_RANK_GPU_ENABLE
    already set to 1), sets NCCL_MULTI_RANK_GPU_ENABLE=1 in this process's environment, which
    the rank processes spawned afterwards inherit."""
    import torch

    if not isinstance(world, int) or world < 1:
        raise ValueError(f"check_cuda_ranks: world must be an int >= 1, got {world!r}")
    if not torch.cuda.is_available():
        built = torch.version.cuda or "none (a CPU-only build)"
        raise SystemExit(
            f"{flag}: no CUDA device: torch.cuda.is_available() is False (torch {torch.__version__}, CUDA "
            f"{built}). Run it on a machine with a GPU and a CUDA build of torch, or use --device cpu."
        )
    count = torch.cuda.device_count()
    if count >= world:
        return f"{world} ranks on {world} of {count} GPU(s), one each"
    set_to = os.environ.get(NCCL_SHARE_ENV)
    version = _torch_nccl_version()
    shown = ".".join(map(str, version)) if version else "unknown"
    if set_to is not None and set_to != "1":
        raise SystemExit(
            f"{flag}: {world} ranks need {world} GPUs or ranks sharing one, but {NCCL_SHARE_ENV}={set_to!r} "
            f"forbids sharing ({count} GPU(s)); unset it or set it to 1 (NCCL >= 2.30)"
        )
    if set_to is None:
        if version is None or version[:2] < NCCL_SHARE_MIN_VERSION:
            raise SystemExit(
                f"{flag}: {world} ranks on {count} GPU(s) must share a GPU, which needs NCCL >= 2.30 with "
                f"{NCCL_SHARE_ENV}=1; torch's NCCL is {shown}. Install NCCL >= 2.30 (and set {NCCL_SHARE_ENV}=1 if "
                f"torch reports an older version than the library it loads), or run with --world {count}."
            )
        os.environ[NCCL_SHARE_ENV] = "1"
    shared = f"{world} ranks share {count} GPU(s) ({NCCL_SHARE_ENV}=1, torch's NCCL {shown})"
    if mps_running():
        return f"{shared} under MPS: their kernels run at the same time, so step times include each other's work"
    return (
        f"{shared} without MPS: they time-slice the GPU, so collectives wait for the other process's slice and "
        "step times include each other's work (start an MPS server, nvidia-cuda-mps-control -d, for timings that "
        "compare communication)"
    )


def cuda_info() -> Dict[str, Any]:
    """The GPU and library versions of a CUDA run, for its results (after check_cuda_ranks)."""
    import torch

    import fairscale_c

    version = _torch_nccl_version()
    return {
        "gpu": torch.cuda.get_device_name(0),
        "gpu_count": torch.cuda.device_count(),
        "torch_cuda": torch.version.cuda,
        "torch_nccl": ".".join(map(str, version)) if version else "unknown",
        "fairscale_c": fairscale_c.__version__,
    }


def rank_cuda_device(rank: int) -> Any:
    """In a rank process: this rank's GPU (cuda:rank % device_count), made the current device."""
    import torch

    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


# ---------------------------------------------------------------- ranks


@dataclass
class RankState:
    """What a rank keeps between commands: its place in the world, the process groups, and
    whatever the current case set up (`op`: the callable that _time_calls times)."""

    rank: int
    world: int
    group: Any  # fairscale_c.distributed.Group
    op: Optional[Callable[[], Any]] = None
    case: Dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"  # "cuda": the rank's GPU is torch.cuda.current_device() (rank_cuda_device)


def _rank_setup(rank: int, world: int, device: str = "cpu") -> RankState:
    import datetime

    import torch
    import torch.distributed as dist

    import fairscale_c.distributed as fdist

    # One intra-op thread per rank: `world` ranks share the machine's cores, as in training.
    torch.set_num_threads(1)
    backend = "gloo"
    if device == "cuda":
        rank_cuda_device(rank)
        # CUDA tensors of torch's collectives on NCCL, host tensors (object lists) on gloo
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(
        backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=RANK_ENGINE_TIMEOUT_S)
    )
    return RankState(rank=rank, world=world, group=fdist.init_group(), device=device)


def _rank_teardown(state: RankState) -> None:
    import torch.distributed as dist

    import fairscale_c.distributed as fdist

    state.op, state.case = None, {}
    fdist.destroy(state.group)
    dist.destroy_process_group()


def install_training(state: RankState, cfg_dict: Dict[str, Any], build_step: Callable[[Any], Any]) -> None:
    """Rank-command body of the training cases: release the previous case's model, then, with
    benchmarks/fsdp.py's config, batches and seed, build one with ``build_step(cfg)`` (returns
    ``step(x, y) -> list of losses``), take the config's warm-up steps, and leave one training step
    in state.op (its losses accumulate in state.case["losses"])."""
    import gc

    import torch

    import fsdp as fsdp_script

    state.op, state.case = None, {}
    gc.collect()
    cfg = fsdp_script.Config(**cfg_dict)
    batches = fsdp_script.make_batches(cfg, state.rank, torch.device("cpu"))
    torch.manual_seed(cfg.seed)
    train_step = build_step(cfg)
    losses: List[float] = []

    def step() -> None:
        x, y = batches[len(losses) % len(batches)]
        losses.extend(train_step(x, y))

    for _ in range(cfg.warmup):
        step()
    state.case = {"losses": losses}
    state.op = step


def case_losses(state: RankState) -> List[float]:
    """Rank command: the losses of every step taken so far by the current case."""
    return list(state.case["losses"])


def time_calls(state: RankState, calls: int) -> float:
    """Rank command: after a barrier, time `calls` back-to-back calls of state.op (seconds)."""
    if not isinstance(calls, int) or calls < 1:
        raise ValueError(f"time_calls: calls must be an int >= 1, got {calls!r}")
    if state.op is None:
        raise RuntimeError("time_calls: no case was set up on this rank (state.op is None)")
    op = state.op
    state.group.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        op()
    return time.perf_counter() - t0


def _rank_main(rank: int, world: int, port: int, conn: Any, device: str = "cpu") -> None:
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world),  # as torchrun sets it: one host
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "FAIRSCALE_C_TIMEOUT": str(RANK_ENGINE_TIMEOUT_S),
        }
    )
    try:
        state = _rank_setup(rank, world, device)
    except BaseException:
        conn.send(("err", traceback.format_exc()))
        return
    conn.send(("ok", None))
    try:
        while conn.poll(RANK_IDLE_EXIT_S):
            try:
                msg = conn.recv()
            except EOFError:  # the pool's end is gone
                break
            if msg[0] == "stop":
                break
            _, fn, args = msg
            try:
                reply = ("ok", fn(state, *args))
            except BaseException:
                reply = ("err", traceback.format_exc())
            conn.send(reply)
    finally:
        _rank_teardown(state)
        conn.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shm_segments_of(pids: List[int]) -> List[str]:
    """fairscale_c shared-memory segments in /dev/shm created by these processes (their names
    start with fsc-<pid>-). A group's segment is unlinked once every rank has attached, so after
    a clean shutdown there are none."""
    prefixes = tuple(f"fsc-{pid}-" for pid in pids)
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(prefixes))
    except FileNotFoundError:
        return []


class RankPool:
    """`world` rank processes started once; see the module docstring.

    pool.run(fn, *args) runs module-level `fn(state, *args)` on every rank and returns the results
    by rank. pool.close() stops the ranks (killing any that do not stop within STOP_GRACE_S) and
    raises if they left shared-memory segments behind.

    device="cuda": each rank takes its GPU (rank_cuda_device) and the torch group is
    "cpu:gloo,cuda:nccl"; call check_cuda_ranks(world) first."""

    def __init__(self, world: int, device: str = "cpu") -> None:
        if not isinstance(world, int) or world < 1:
            raise ValueError(f"RankPool: world must be an int >= 1, got {world!r}")
        if device not in ("cpu", "cuda"):
            raise ValueError(f"RankPool: device must be 'cpu' or 'cuda', got {device!r}")
        self.world = world
        self.pids: List[int] = []
        self._broken: Optional[str] = None
        self._closed = False
        ctx = mp.get_context("spawn")
        port = _free_port()
        self._conns = []
        self._procs = []
        try:
            for r in range(world):
                parent, child = ctx.Pipe()
                p = ctx.Process(
                    target=_rank_main, args=(r, world, port, child, device), daemon=True, name=f"bench-rank{r}"
                )
                p.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(p)
                self.pids.append(p.pid)
            self._collect("start-up", START_TIMEOUT_S)
        except BaseException as e:
            self._broken = f"start-up: {type(e).__name__}: {e}"
            self._closed = True
            self._stop(graceful=False)
            raise

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = COMMAND_TIMEOUT_S) -> List[Any]:
        if self._closed:
            raise RuntimeError("RankPool.run: the pool is closed")
        if self._broken is not None:
            raise RuntimeError(f"RankPool.run: the ranks were stopped after an earlier failure:\n{self._broken}")
        what = getattr(fn, "__name__", repr(fn))
        try:
            for c in self._conns:
                c.send(("run", fn, args))
            return self._collect(what, timeout)
        except BaseException as e:
            self._broken = f"{type(e).__name__}: {e}"
            self._stop(graceful=False)
            raise

    def _collect(self, what: str, timeout: float) -> List[Any]:
        """One reply from every rank, or an error naming the ranks that failed, died or timed out."""
        replies: Dict[int, Any] = {}
        errors: List[str] = []
        deadline = time.monotonic() + timeout
        while len(replies) + len(errors) < self.world:
            waiting = {self._conns[r]: r for r in range(self.world) if r not in replies}
            ready = mpc.wait(list(waiting), timeout=min(0.5, max(0.0, deadline - time.monotonic())))
            for c in ready:
                r = waiting[c]
                try:
                    status, value = c.recv()
                except EOFError:
                    status, value = "err", f"exited (code {self._procs[r].exitcode}) without replying"
                if status == "ok":
                    replies[r] = value
                else:
                    errors.append(f"--- rank {r} ---\n{value}")
                    replies[r] = None
            if errors:
                # A peer of the failed rank may sit in a collective until its engine times out:
                # do not wait for it.
                break
            if time.monotonic() >= deadline:
                late = sorted(set(range(self.world)) - set(replies))
                raise TimeoutError(f"{what}: ranks {late} did not answer within {timeout:.0f} s")
        if errors:
            raise RuntimeError(f"{what} failed:\n" + "\n".join(errors))
        return [replies[r] for r in range(self.world)]

    def close(self) -> None:
        """Stop the ranks; raise if a clean stop left shared-memory segments. Idempotent."""
        if self._closed:
            return
        self._closed = True
        left = self._stop(graceful=self._broken is None)
        if left and self._broken is None:
            raise RuntimeError(f"RankPool.close: the ranks left shared-memory segments behind: {left}")

    def _stop(self, graceful: bool) -> List[str]:
        """Ask every rank to stop; wait STOP_GRACE_S (2 s when not graceful: a rank may sit in a
        collective whose peer failed), then terminate and kill. Removes the shared-memory
        segments named by our ranks' pids and returns their names."""
        for c in self._conns:
            try:
                c.send(("stop",))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + (STOP_GRACE_S if graceful else 2.0)
        for p in self._procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        for c in self._conns:
            c.close()
        self._conns, self._procs = [], []
        left = shm_segments_of(self.pids)
        for name in left:
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except FileNotFoundError:
                pass
        return left

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
