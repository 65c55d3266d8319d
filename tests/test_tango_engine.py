"""fairscale_c.integrations.tango's engine against a minimal stand-in of Tango's TrainingEngine
contract (tests/tango_standin; `make tango` runs the real Tango): 2 workers with FSDP, inner FSDP
instances and activation checkpointing match Tango's torch (DDP) engine, a checkpoint taken
mid-run resumes bit-identically in a fresh engine, the consolidated weights load into an
unwrapped model, and bf16 autocast with mixed precision runs on CPU, inner FSDP instances
included. All runs in one spawned job."""

import math
import os
import sys
from pathlib import Path

import pytest
import torch

from dist_utils import free_port, orphaned_segments, run_ranks

STANDIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tango_standin")
STEPS, CHECKPOINT_AT = 6, 4


def _tango():
    sys.path.insert(0, STANDIN)
    import tango.integrations.torch as tt
    from tango.common import Lazy

    import fairscale_c.integrations.tango as ft

    return tt, Lazy, ft


def _model_class():
    from torch import nn

    tt, _, _ = _tango()

    class Regressor(tt.Model):
        """Tango's FairScale test fixture in spirit: Linear+ReLU blocks, a head, MSE loss."""

        def __init__(self):
            super().__init__()
            torch.manual_seed(317)
            self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.ReLU()) for _ in range(3)])
            self.head = nn.Linear(8, 1)

        def forward(self, x, y=None):
            out = self.head(self.blocks(x))
            return {"out": out, "loss": nn.functional.mse_loss(out, y) if y is not None else None}

    return Regressor


def _batches(rank: int, world: int):
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 8, generator=g), torch.randn(8, 1, generator=g)) for _ in range(STEPS)]
    mine = slice(rank * 8 // world, (rank + 1) * 8 // world)
    return [{"x": x[mine], "y": y[mine]} for x, y in data]


def _worker(rank: int, world: int, engine: str, workdir: str, resume: bool, port: int, amp: bool = False):
    tt, Lazy, ft = _tango()
    from fairscale_c.nn.data_parallel import FullyShardedDataParallel as FSDP

    Regressor = _model_class()
    config = tt.TrainConfig(worker_id=rank, world_size=world, distributed_port=port)
    kwargs = {}
    if engine == "fairscale_c":
        # Tango builds the inner instances from the model's own config: no compute_dtype, so they
        # must take the engine's AMP dtype, as the engine's own instance does.
        fsdp = ft.FSDPConfig(mixed_precision=amp)
        model = Lazy(
            lambda: ft.with_wrapped_modules(
                Regressor(), {r"blocks\.[0-9]+"}, ft.FSDPConfig(mixed_precision=amp), activation_checkpointing=True
            )
        )
        kwargs["fsdp_config"] = fsdp
    else:
        model = Lazy(Regressor)
    eng = tt.TrainingEngine.by_name(engine)(
        config,
        model,
        Lazy(torch.optim.AdamW, lr=0.005),
        lr_scheduler=Lazy(torch.optim.lr_scheduler.StepLR, step_size=2, gamma=0.5),
        amp=amp,
        **kwargs,
    )
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    first = 0
    if resume:
        state = eng.load_checkpoint(work / f"step{CHECKPOINT_AT}")
        first = state["training_steps"]
    losses, val = {}, None
    batches = _batches(rank, world)
    for step in range(first, STEPS):
        loss, _ = eng.forward_train(batches[step], 0, 1)
        eng.backward(loss)
        eng.step()
        losses[step + 1] = loss.detach().float().clone()
        if step + 1 == CHECKPOINT_AT:
            eng.model.eval()
            val = eng.forward_eval(batches[0])["loss"].float().clone()
            eng.model.train()
        if step + 1 in (CHECKPOINT_AT, STEPS):
            eng.save_checkpoint(work / f"step{step + 1}", {"training_steps": step + 1})
            if world > 1:
                torch.distributed.barrier()
    for v in losses.values():
        if world > 1:
            torch.distributed.all_reduce(v)
        v /= world
    weights = None
    if rank == 0:
        path = work / f"weights-{engine}-{'resumed' if resume else 'full'}.pt"
        eng.save_complete_weights_from_checkpoint(work / f"step{STEPS}", path)
        weights = {k: v.tolist() for k, v in torch.load(path).items()}
    if world > 1:
        torch.distributed.destroy_process_group()
    # Plain Python values (float32 -> float is exact): tensors would travel through shared memory.
    return {
        "losses": {s: float(v) for s, v in losses.items()},
        "val": None if val is None else float(val),
        "compute_dtypes": [str(m.compute_dtype) for m in eng.model.modules() if isinstance(m, FSDP)],
        "weights": weights,
    }


def _scenarios(rank: int, world: int, workdir: str, ports: list):
    """Every engine run the tests check, in one spawned job (starting the ranks is most of the
    cost): DDP; the fairscale_c engine; a fresh engine resumed from the step-4 checkpoint of the
    one before (in the same processes: `make tango` resumes Tango in fresh ones); bf16 autocast with
    mixed precision. A new process group each, on its own port."""
    return {
        "ddp": _worker(rank, world, "torch", workdir + "/ddp", False, ports[0]),
        "full": _worker(rank, world, "fairscale_c", workdir + "/fsc", False, ports[1]),
        "resumed": _worker(rank, world, "fairscale_c", workdir + "/fsc", True, ports[2]),
        "bf16": _worker(rank, world, "fairscale_c", workdir + "/bf16", False, ports[3], amp=True),
    }


def _tensors(weights):
    return {k: torch.tensor(v, dtype=torch.float32) for k, v in weights.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("tango")
    before = orphaned_segments()
    result = run_ranks(_scenarios, 2, str(workdir), [free_port() for _ in range(4)])[0]
    assert orphaned_segments() - before == set(), "shared-memory segments left in /dev/shm"
    for r in result.values():
        r["weights"] = _tensors(r["weights"])
    result["files"] = sorted(os.listdir(workdir / "fsc" / f"step{CHECKPOINT_AT}"))
    return result


def test_engine_matches_ddp(runs):
    ddp, full = runs["ddp"], runs["full"]
    files = runs["files"]
    assert files[0] == "manifest.json" and len(files) == 3, files  # one shard per worker, one commit
    assert full["compute_dtypes"] == ["torch.float32"] * 4  # the engine's instance and 3 inner ones
    for step in range(1, STEPS + 1):
        assert abs(full["losses"][step] - ddp["losses"][step]) <= 1e-6, (step, full["losses"], ddp["losses"])
    assert abs(full["val"] - ddp["val"]) <= 1e-6, (full["val"], ddp["val"])
    assert full["weights"].keys() == ddp["weights"].keys()
    for k, v in ddp["weights"].items():
        torch.testing.assert_close(full["weights"][k], v, rtol=0, atol=1e-6)


def test_resume_is_bit_identical(runs):
    full, resumed = runs["full"], runs["resumed"]
    assert sorted(resumed["losses"]) == list(range(CHECKPOINT_AT + 1, STEPS + 1))
    for step, loss in resumed["losses"].items():
        assert loss == full["losses"][step], step
    for k, v in full["weights"].items():
        assert torch.equal(resumed["weights"][k], v), k


def test_consolidated_weights_in_an_unwrapped_model(runs):
    # The consolidated weights in an unwrapped model give the DDP model's outputs.
    sys.path.insert(0, STANDIN)
    try:
        Regressor = _model_class()
        plain, ref = Regressor(), Regressor()
        plain.load_state_dict(runs["full"]["weights"])
        ref.load_state_dict(runs["ddp"]["weights"])
        x = torch.randn(4, 8)
        torch.testing.assert_close(plain(x)["out"], ref(x)["out"], rtol=0, atol=1e-6)
    finally:
        sys.path.remove(STANDIN)
        for name in [n for n in sys.modules if n == "tango" or n.startswith(("tango.", "fairscale_c.integrations"))]:
            del sys.modules[name]


def test_bf16_autocast_with_mixed_precision_runs_on_cpu(runs):
    # Tango's AMP is bf16 on CPU; with mixed_precision and no compute_dtype the engine's FSDP and
    # the inner ones computes in bf16 too (Tango's own engine computes in fp16 there, and the
    # LayerNorm fails under bf16 autocast: "mixed dtype (CPU)").
    bf16, fp32 = runs["bf16"], runs["full"]
    assert bf16["compute_dtypes"] == ["torch.bfloat16"] * 4
    for step in range(1, STEPS + 1):  # bf16 keeps 8 bits of mantissa
        assert math.isclose(bf16["losses"][step], fp32["losses"][step], rel_tol=5e-2), (bf16["losses"], fp32["losses"])


@pytest.mark.parametrize(
    "kwargs, match",
    [(dict(compute_dtype="half"), "'compute_dtype' must be one of"), (dict(buffer_dtype=3), "'buffer_dtype'")],
)
def test_fsdp_config_bad_dtype(kwargs, match):
    sys.path.insert(0, STANDIN)
    try:
        from fairscale_c.integrations.tango import FSDPConfig

        with pytest.raises(ValueError, match=match):
            FSDPConfig(**kwargs)
    finally:
        sys.path.remove(STANDIN)
        for name in [n for n in sys.modules if n == "tango" or n.startswith(("tango.", "fairscale_c.integrations"))]:
            del sys.modules[name]
