"""fairscale_c.integrations.tango's engine against a minimal stand-in of Tango's TrainingEngine
contract (tests/tango_standin; `make tango` runs the real Tango): 2 workers with FSDP, inner FSDP
instances and activation checkpointing match Tango's torch (DDP) engine, a checkpoint taken
mid-run resumes bit-identically in fresh processes, the consolidated weights load into an
unwrapped model, and bf16 autocast with mixed precision runs on CPU."""

import math
import os
import sys
from pathlib import Path

import pytest
import torch

from dist_utils import run_ranks

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
            self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(3)])
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


def _worker(rank: int, world: int, engine: str, workdir: str, resume: bool, amp: bool = False):
    tt, Lazy, ft = _tango()
    Regressor = _model_class()
    config = tt.TrainConfig(worker_id=rank, world_size=world, distributed_port=int(os.environ["MASTER_PORT"]))
    kwargs = {}
    if engine == "fairscale_c":
        fsdp = ft.FSDPConfig(mixed_precision=amp)
        model = Lazy(
            lambda: ft.with_wrapped_modules(Regressor(), {r"blocks\.[0-9]+"}, fsdp, activation_checkpointing=True)
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
        "compute_dtype": str(getattr(eng.model, "compute_dtype", None)),  # FSDP only
        "weights": weights,
    }


def _tensors(weights):
    return {k: torch.tensor(v, dtype=torch.float32) for k, v in weights.items()}


def test_engine_matches_ddp_and_resumes_bit_identically(tmp_path):
    ddp = run_ranks(_worker, 2, "torch", str(tmp_path / "ddp"), False)[0]
    full = run_ranks(_worker, 2, "fairscale_c", str(tmp_path / "fsc"), False)[0]
    ddp["weights"], full["weights"] = _tensors(ddp["weights"]), _tensors(full["weights"])
    files = sorted(os.listdir(tmp_path / "fsc" / f"step{CHECKPOINT_AT}"))
    assert files[0] == "manifest.json" and len(files) == 3, files  # one shard per worker, one commit
    for step in range(1, STEPS + 1):
        assert abs(full["losses"][step] - ddp["losses"][step]) <= 1e-6, (step, full["losses"], ddp["losses"])
    assert abs(full["val"] - ddp["val"]) <= 1e-6, (full["val"], ddp["val"])
    assert full["weights"].keys() == ddp["weights"].keys()
    for k, v in ddp["weights"].items():
        torch.testing.assert_close(full["weights"][k], v, rtol=0, atol=1e-6)

    resumed = run_ranks(_worker, 2, "fairscale_c", str(tmp_path / "fsc"), True)[0]
    resumed["weights"] = _tensors(resumed["weights"])
    assert sorted(resumed["losses"]) == list(range(CHECKPOINT_AT + 1, STEPS + 1))
    for step, loss in resumed["losses"].items():
        assert loss == full["losses"][step], step
    for k, v in full["weights"].items():
        assert torch.equal(resumed["weights"][k], v), k

    # The consolidated weights in an unwrapped model give the DDP model's outputs.
    sys.path.insert(0, STANDIN)
    try:
        Regressor = _model_class()
        plain, ref = Regressor(), Regressor()
        plain.load_state_dict(full["weights"])
        ref.load_state_dict(ddp["weights"])
        x = torch.randn(4, 8)
        torch.testing.assert_close(plain(x)["out"], ref(x)["out"], rtol=0, atol=1e-6)
    finally:
        sys.path.remove(STANDIN)
        for name in [n for n in sys.modules if n == "tango" or n.startswith(("tango.", "fairscale_c.integrations"))]:
            del sys.modules[name]


def _bf16_worker(rank: int, world: int, workdir: str):
    bf16 = _worker(rank, world, "fairscale_c", workdir + "/bf16", False, amp=True)
    fp32 = _worker(rank, world, "fairscale_c", workdir + "/fp32", False, amp=False)
    return bf16, fp32


def test_bf16_autocast_with_mixed_precision_runs_on_cpu(tmp_path):
    # Tango's AMP is bf16 on CPU; with mixed_precision and no compute_dtype the engine computes
    # in bf16 too (Tango's own engine computes in fp16 there and autocast fails). One worker.
    bf16, fp32 = run_ranks(_bf16_worker, 1, str(tmp_path))[0]
    assert bf16["compute_dtype"] == "torch.bfloat16" and fp32["compute_dtype"] == "torch.float32"
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
