"""AsyncPipe benchmark: fairscale_c's AsyncPipe against FairScale 0.4.13's, 2 stages on 2 CPU
ranks, in the same run, beside one process training the whole model.

    PYTHONPATH=. python benchmarks/async_pipe.py          # three sizes
    PYTHONPATH=. python benchmarks/async_pipe.py --quick  # two small sizes, 2 rounds

The model: 8 x (Linear(width, width), ReLU), half on each stage (balance [8, 8]); a training step
on every rank: ``pipe(batch)``, on the last stage loss = mean(y^2) and backward, then SGD on the
rank's partition. Rows: (width, batch, chunks), checkpoint "never".

- fairscale_c: activations and gradients through fairscale_c.distributed point-to-point.
- fairscale: FairScale 0.4.13's AsyncPipe, which needs torch RPC (its transport: TensorPipe).
  Skipped, and said so, without fairscale.
- fairscale_c rpc: the same AsyncPipe driven from rank 0 by PipeRPCWrapper (the last stage's
  output and its gradient, and the optimizer step through ``foreach_worker``, over torch RPC; rank
  1 only serves RPC). FairScale's PipeRPCWrapper needs CUDA, so it has no row here.
- local: one process training the whole model on the whole batch (no pipeline, no messages): what
  the two stages together compute, run by one core.

Timing alternates between the two pipes round by round (the order flips every round, a barrier
before each); each number is the median over rounds of the slower rank's mean step. Before
timing, the two pipes' last-stage outputs are compared (same weights, same batch).

Results go to stdout (a table) and benchmarks/results/async_pipe.json.
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ranks import _free_port, bench_main, max_over_ranks, parse_triples, time_steps  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "async_pipe.json"
WORLD = 2
SIZES = [(256, 64, 1), (256, 64, 4), (1024, 128, 4)]  # (width, batch, chunks)
QUICK = [(64, 16, 1), (64, 16, 4)]


def load_fairscale_async_pipe() -> Optional[Any]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from fairscale.nn.pipe import async_pipe
    except ImportError:
        return None
    if "fairscale_c" in getattr(async_pipe, "__file__", ""):  # the alias, not FairScale
        return None
    return async_pipe.AsyncPipe


def _model(width: int) -> nn.Sequential:
    torch.manual_seed(1)
    layers: List[nn.Module] = []
    for _ in range(8):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


class Stage:
    """One framework's pipe on this rank, its optimizer and its step."""

    def __init__(self, framework: str, width: int, batch: int, chunks: int, workers: Dict[int, str]) -> None:
        import torch.distributed as dist

        model = _model(width)
        self.x = torch.randn(batch, width, generator=torch.Generator().manual_seed(10))
        self.out: Any = None
        if framework == "fairscale_c rpc":
            from fairscale_c.nn.pipe import PipeRPCWrapper

            self.wrapper = PipeRPCWrapper(model, [8, 8], group=dist.group.WORLD, chunks=chunks, checkpoint="never")
            self.wrapper.foreach_worker(_register_sgd, include_self=True)
            return
        self.wrapper = None
        if framework == "fairscale":
            cls = load_fairscale_async_pipe()
            self.pipe = cls(model, [8, 8], worker_map=workers, chunks=chunks, checkpoint="never")
        else:
            from fairscale_c.nn.pipe import AsyncPipe

            self.pipe = AsyncPipe(model, [8, 8], group=dist.group.WORLD, chunks=chunks, checkpoint="never")
        self.opt = torch.optim.SGD(self.pipe.parameters(), lr=1e-3)

    def step(self) -> None:
        if self.wrapper is not None:
            out = self.wrapper(self.x)
            out.pow(2).mean().backward()
            self.wrapper.foreach_worker(_sgd_step, include_self=True)
            return
        self.opt.zero_grad(set_to_none=True)
        out = self.pipe(self.x)
        if self.pipe.final_stage:
            out.pow(2).mean().backward()
            self.out = out.detach()
        self.opt.step()


def _register_sgd(ctx: Any, model: nn.Module) -> None:
    model.opt = torch.optim.SGD(model.parameters(), lr=1e-3)


def _sgd_step(ctx: Any, model: nn.Module) -> None:
    model.opt.step()
    model.opt.zero_grad(set_to_none=True)


def _local_step_s(width: int, batch: int, cfg: Dict[str, Any]) -> float:
    """The whole model in this process: median over rounds of the mean step."""
    model = _model(width)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(10))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()

    step()
    rounds = []
    for _ in range(cfg["rounds"]):
        start = time.perf_counter()
        for _ in range(cfg["steps"]):
            step()
        rounds.append((time.perf_counter() - start) / cfg["steps"])
    return statistics.median(rounds)


def rank_main(rank: int, cfg: Dict[str, Any], mode: str) -> Dict[str, Any]:
    import torch.distributed as dist

    have_fs = load_fairscale_async_pipe() is not None
    frameworks = ["fairscale_c", "fairscale_c rpc"] + (["fairscale"] if have_fs else [])
    if mode == "memory":  # no peaks are measured here: the harness's second run has nothing to do
        return {f"w{w} b{b} c{c}": {f: {} for f in frameworks} for w, b, c in cfg["sizes"]}
    from torch.distributed import rpc

    workers = {r: f"worker{r}" for r in range(WORLD)}
    port = torch.tensor([_free_port() if rank == 0 else 0])
    dist.broadcast(port, 0)
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port.item()}")
    rpc.init_rpc(workers[rank], rank=rank, world_size=WORLD, rpc_backend_options=options)
    if have_fs:
        from fairscale.nn.model_parallel import initialize_model_parallel

        initialize_model_parallel(1, WORLD)
    try:
        results: Dict[str, Any] = {}
        for width, batch, chunks in cfg["sizes"]:
            key = f"w{width} b{batch} c{chunks}"
            stages = {f: Stage(f, width, batch, chunks, workers) for f in frameworks if f != "fairscale_c rpc"}
            if rank == 0:  # the wrapper lives on rank 0; rank 1 builds its stage when asked over RPC
                stages["fairscale_c rpc"] = Stage("fairscale_c rpc", width, batch, chunks, workers)
            steps: Dict[str, Callable[[], None]] = {f: stages[f].step if f in stages else _idle for f in frameworks}
            if have_fs:
                _guard(stages, key)
            results[key] = time_steps(steps, cfg)
            local = _local_step_s(width, batch, cfg) if rank == 0 else 0.0
            results[key]["local"] = {"step_s": max_over_ranks(local)}
        return results
    finally:
        rpc.shutdown()


def _idle() -> None:
    """Rank 1's part of a PipeRPCWrapper step: none (its RPC threads run the stage)."""


def _guard(stages: Dict[str, Stage], key: str) -> None:
    """One step of each pipe from the same weights gives the same last-stage output."""
    for f in ("fairscale_c", "fairscale"):
        stages[f].step()
    a, b = stages["fairscale_c"].out, stages["fairscale"].out
    if a is not None and not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
        raise RuntimeError(f"fairscale_c's and FairScale's AsyncPipe outputs differ at {key}")


def table(results: Dict[str, Any]) -> str:
    lines = [
        "| width, batch, chunks | local ms (one process) | fairscale_c ms | fairscale_c rpc ms | FairScale ms "
        "| ours / FairScale | rpc / ours | ours / local |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, r in results.items():
        ours, local, fs = r["fairscale_c"]["step_s"], r["local"]["step_s"], r.get("fairscale")
        rpc = r["fairscale_c rpc"]["step_s"]
        fs_ms = f"{1e3 * fs['step_s']:.2f}" if fs else "not installed"
        ratio = f"{ours / fs['step_s']:.2f}" if fs else "-"
        lines.append(
            f"| {key} | {1e3 * local:.2f} | {1e3 * ours:.2f} | {1e3 * rpc:.2f} | {fs_ms} | {ratio} | {rpc / ours:.2f} "
            f"| {ours / local:.2f} |"
        )
    return "\n".join(lines)


def parse_sizes(text: str) -> List[Tuple[int, int, int]]:
    return parse_triples(text, "256x64x4")


def main(argv: Optional[List[str]] = None) -> int:
    return bench_main(
        __doc__,
        argv,
        sizes_flag="--sizes",
        sizes_help="comma-separated WIDTHxBATCHxCHUNKS, e.g. 256x64x4",
        parse_sizes=parse_sizes,
        sizes=SIZES,
        quick=QUICK,
        rank_main=rank_main,
        world=WORLD,
        table=table,
        results_path=str(RESULTS),
        peer_installed=load_fairscale_async_pipe() is not None,
        default_steps=5,
        full_rounds=7,
    )


if __name__ == "__main__":
    sys.exit(main())
