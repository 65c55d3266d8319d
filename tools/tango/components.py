"""Tango components of `make tango`'s run (tools/tango/config.jsonnet): a small regression model
with LayerNorm, its data, and a TrainCallback that records what tools/tango/run.py compares and
injects a failure.

The callback (``fsc_tango::recorder``), on the main worker, writes ``$FSC_TANGO_OUT/<step>.json``
(the all-reduced training loss of every step, every validation loss, the step's work folder) and
``$FSC_TANGO_OUT/<step>.final.pt`` (the full weights at the end of training, gathered from every
worker's shard by FSDP's ``state_dict()``). The losses are part of its state, so they survive a
checkpoint and a resume. With ``FSC_TANGO_CRASH_AT=N`` in the environment every worker raises
before training step N (1-based), as a crash would stop it.
"""

import json
import os
from pathlib import Path
from typing import Any, Dict, List

import torch
from tango import Step
from tango.common import DatasetDict
from tango.integrations.torch import Model, TrainCallback
from tango.integrations.torch.util import set_seed_all
from torch import nn

WIDTH = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.norm = nn.LayerNorm(WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.norm(self.linear(x)))


@Model.register("fsc_tango::regressor")
class Regressor(Model):
    """Three Linear+LayerNorm+ReLU blocks and a linear head; MSE loss. The LayerNorm is what makes
    bf16 autocast meet FSDP's float16 mixed precision on CPU (issue 12, item 2)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block() for _ in range(3)])
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> Dict[str, torch.Tensor]:
        out = self.head(self.blocks(x))
        return {"out": out, "loss": nn.functional.mse_loss(out.float(), y)}


@Step.register("fsc_tango::data")
class RegressionData(Step):
    DETERMINISTIC = True
    CACHEABLE = False

    def run(self, seed: int = 317, train_size: int = 96, dev_size: int = 16) -> DatasetDict:  # type: ignore[override]
        set_seed_all(seed)
        w = torch.randn(WIDTH, 1)

        def split(n: int) -> List[Dict[str, torch.Tensor]]:
            x = torch.randn(n, WIDTH)
            y = torch.tanh(x @ w) + 0.1 * torch.randn(n, 1)
            return [{"x": x[i], "y": y[i]} for i in range(n)]

        return DatasetDict(splits={"train": split(train_size), "dev": split(dev_size)})


@TrainCallback.register("fsc_tango::recorder")
class Recorder(TrainCallback):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.losses: Dict[int, float] = {}
        self.val: Dict[int, float] = {}
        self.restored_steps = 0
        self.crash_at = int(os.environ.get("FSC_TANGO_CRASH_AT", "0"))

    def state_dict(self) -> Dict[str, Any]:
        return {"losses": dict(self.losses), "val": dict(self.val)}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        self.losses, self.val = dict(state_dict["losses"]), dict(state_dict["val"])
        self.restored_steps = len(self.losses)

    def pre_batch(self, step: int, epoch: int, batch: Any) -> None:
        if step + 1 == self.crash_at:
            raise RuntimeError(f"fsc_tango::recorder: failure injected before step {self.crash_at}")

    def log_batch(self, step: int, epoch: int, batch_loss: float, batch_outputs: Any) -> None:
        self.losses[step + 1] = batch_loss  # Tango's all-reduced mean over the workers

    def post_val_loop(self, step: int, epoch: int, val_metric: float, best_val_metric: float) -> None:
        self.val[step + 1] = val_metric

    def post_train_loop(self, step: int, epoch: int) -> None:
        model = self.training_engine.model
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        full = {k: v.detach().float().cpu().clone() for k, v in model.state_dict().items()}  # FSDP: collective
        if not self.is_local_main_process:
            return
        out = Path(os.environ["FSC_TANGO_OUT"])
        out.mkdir(parents=True, exist_ok=True)
        torch.save(full, out / f"{self.step_name}.final.pt")
        record = {
            "losses": self.losses,
            "val": self.val,
            "restored_steps": self.restored_steps,
            "work_dir": str(self.work_dir),
            "engine": type(self.training_engine).__name__,
            "compute_dtype": str(getattr(self.training_engine.model, "compute_dtype", None)),
        }
        (out / f"{self.step_name}.json").write_text(json.dumps(record, indent=1))
