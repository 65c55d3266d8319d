"""Tango's torch integration contract: TrainConfig, Model, TrainingEngine, TorchTrainingEngine
(DDP over gloo on CPU), as Tango 1.3.2 documents them."""

import os
import tempfile
from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

import torch
import torch.distributed as dist
from torch import nn

from tango.common import Lazy, Registrable

Optimizer = torch.optim.Optimizer
LRScheduler = torch.optim.lr_scheduler.LRScheduler


class Model(nn.Module, Registrable):
    pass


@dataclass
class TrainConfig:
    worker_id: int = 0
    world_size: int = 1
    distributed_address: str = "127.0.0.1"
    distributed_port: int = 0
    device_type: str = "cpu"

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def worker_local_default_device(self) -> torch.device:
        return torch.device("cpu")


class TrainingEngine(Registrable):
    default_implementation = "torch"

    def __init__(self, train_config: TrainConfig, model: Any, optimizer: Lazy, *, lr_scheduler: Optional[Lazy] = None):
        self.train_config = train_config
        self.model = self._construct_model(model)
        self.optimizer = optimizer.construct(params=self.model.parameters())
        self.lr_scheduler = lr_scheduler.construct(optimizer=self.optimizer) if lr_scheduler is not None else None

    def _construct_model(self, model: Any) -> Model:
        if isinstance(model, Lazy):
            model = model.construct()
        return model.to(self.train_config.worker_local_default_device)

    @abstractmethod
    def forward_train(self, micro_batch: Dict[str, Any], micro_batch_idx: int, num_micro_batches: int):
        raise NotImplementedError

    @abstractmethod
    def forward_eval(self, batch: Dict[str, Any]) -> Dict[str, Any]:
        raise NotImplementedError

    @abstractmethod
    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    @abstractmethod
    def step(self) -> None:
        raise NotImplementedError

    @abstractmethod
    def save_checkpoint(self, checkpoint_dir: Path, client_state: Dict[str, Any]) -> None:
        raise NotImplementedError

    @abstractmethod
    def load_checkpoint(self, checkpoint_dir: Path) -> Dict[str, Any]:
        raise NotImplementedError

    @abstractmethod
    def save_complete_weights_from_checkpoint(self, checkpoint_dir: Path, weights_path: Path) -> None:
        raise NotImplementedError


@TrainingEngine.register("torch")
class TorchTrainingEngine(TrainingEngine):
    def __init__(
        self,
        train_config: TrainConfig,
        model: Any,
        optimizer: Lazy,
        *,
        lr_scheduler: Optional[Lazy] = None,
        amp: bool = False,
        max_grad_norm: Optional[float] = None,
        amp_use_bfloat16: Optional[bool] = None,
    ) -> None:
        self.device = train_config.worker_local_default_device
        if amp_use_bfloat16 is None:
            amp_use_bfloat16 = train_config.device_type == "cpu"
        self.amp = amp
        self.amp_dtype = torch.bfloat16 if amp_use_bfloat16 else torch.float16
        self.max_grad_norm = max_grad_norm
        self.grad_scaler: Any = None if not amp else torch.amp.GradScaler("cpu", enabled=False)
        if train_config.is_distributed:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://{train_config.distributed_address}:{train_config.distributed_port}",
                world_size=train_config.world_size,
                rank=train_config.worker_id,
            )
        super().__init__(train_config, model, optimizer, lr_scheduler=lr_scheduler)

    def _construct_model(self, model: Any) -> Model:
        if isinstance(model, Lazy):
            model = model.construct()
        model.to(self.train_config.worker_local_default_device)
        if self.train_config.is_distributed:
            model = nn.parallel.DistributedDataParallel(model)
        return model

    def forward_train(self, micro_batch: Dict[str, Any], micro_batch_idx: int, num_micro_batches: int):
        if micro_batch_idx == 0:
            self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(self.train_config.device_type, enabled=self.amp, dtype=self.amp_dtype):
            outputs = self.model(**micro_batch)
            loss = outputs["loss"] / num_micro_batches
        return loss, outputs

    def forward_eval(self, batch: Dict[str, Any]) -> Dict[str, Any]:
        with torch.autocast(self.train_config.device_type, enabled=self.amp, dtype=self.amp_dtype):
            with torch.inference_mode():
                return self.model(**batch)

    def backward(self, loss: torch.Tensor) -> None:
        if self.grad_scaler is not None:
            self.grad_scaler.scale(loss).backward()
        else:
            loss.backward()

    def clip_grad_norm(self) -> None:
        if self.max_grad_norm is not None:
            nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)

    def step(self) -> None:
        if self.grad_scaler is not None:
            self.grad_scaler.unscale_(self.optimizer)
        self.clip_grad_norm()
        if self.grad_scaler is not None:
            self.grad_scaler.step(self.optimizer)
            self.grad_scaler.update()
        else:
            self.optimizer.step()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    def get_model_state(self) -> Dict[str, torch.Tensor]:
        return (self.model.module if self.train_config.is_distributed else self.model).state_dict()

    def load_model_state(self, state_dict: Dict[str, torch.Tensor]) -> None:
        (self.model.module if self.train_config.is_distributed else self.model).load_state_dict(state_dict)

    def save_checkpoint(self, checkpoint_dir: Path, client_state: Dict[str, Any]) -> None:
        checkpoint_dir.mkdir(exist_ok=True)

        def save(state: Any, name: str) -> None:
            fd, tmp = tempfile.mkstemp(dir=checkpoint_dir, suffix=".pt")
            with os.fdopen(fd, "wb") as f:
                torch.save(state, f)
            os.replace(tmp, checkpoint_dir / f"worker{self.train_config.worker_id}_{name}.pt")

        save(self.get_model_state(), "model")
        save(self.optimizer.state_dict(), "optimizer")
        if self.lr_scheduler is not None:
            save(self.lr_scheduler.state_dict(), "lr_scheduler")
        save(client_state, "trainer")

    def load_checkpoint(self, checkpoint_dir: Path) -> Dict[str, Any]:
        w = self.train_config.worker_id
        self.load_model_state(torch.load(checkpoint_dir / f"worker{w}_model.pt"))
        self.optimizer.load_state_dict(torch.load(checkpoint_dir / f"worker{w}_optimizer.pt"))
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(torch.load(checkpoint_dir / f"worker{w}_lr_scheduler.pt"))
        return torch.load(checkpoint_dir / f"worker{w}_trainer.pt")

    def save_complete_weights_from_checkpoint(self, checkpoint_dir: Path, weights_path: Path) -> None:
        os.link(checkpoint_dir.resolve() / "worker0_model.pt", weights_path)
