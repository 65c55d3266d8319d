"""FairScaleCTrainingEngine: Tango's TrainingEngine contract over fairscale_c's FSDP, with
checkpoints saved all-or-nothing across workers and consolidated by rank."""

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any, Dict, Optional, Union

import torch
from tango.common import Lazy
from tango.integrations.torch import LRScheduler, Model, Optimizer, TorchTrainingEngine, TrainConfig, TrainingEngine

from fairscale_c.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale_c.optim.grad_scaler import ShardedGradScaler
from fairscale_c.utils.checkpoint import load_all_shards, load_sharded, save_sharded

from .fsdp_config import FSDPConfig, amp_dtype_while_constructing


@TrainingEngine.register("fairscale_c")
class FairScaleCTrainingEngine(TorchTrainingEngine):
    """A Tango TrainingEngine that trains the model in fairscale_c's FullyShardedDataParallel.

    Registered as ``"fairscale_c"``. Configured as Tango's ``"fairscale"`` engine (``amp``,
    ``max_grad_norm``, ``amp_use_bfloat16``, ``fsdp_config``), with these differences:

    - ``fsdp_config`` is this package's :class:`FSDPConfig`, which has ``compute_dtype``; with
      ``mixed_precision`` and ``amp`` and no ``compute_dtype``, FSDP computes in the AMP dtype
      (bfloat16 on CPU), where Tango's engine computes in float16 and bf16 autocast fails (a
      LayerNorm meets float16 parameters); so do the inner instances that
      ``fairscale_c::with_wrapped_modules`` builds while this engine constructs the model;
    - it also runs with one worker (FSDP over a group of one, no torch.distributed needed);
    - the loss scaler is a ShardedGradScaler for float16 AMP only (bfloat16 needs none);
    - a checkpoint is one :func:`fairscale_c.utils.checkpoint.save_sharded` per directory: every
      worker's model shard, optimizer, LR scheduler, scaler and trainer state in one file per
      worker, committed together (a crash during a save leaves no partial checkpoint), and
      checked on load;
    - :meth:`save_complete_weights_from_checkpoint` consolidates the shards in the order of the
      ranks recorded in them, never in the order the files are listed.
    """

    def __init__(
        self,
        train_config: TrainConfig,
        model: Union[Model, Lazy[Model]],
        optimizer: Lazy[Optimizer],
        *,
        lr_scheduler: Optional[Lazy[LRScheduler]] = None,
        amp: bool = False,
        max_grad_norm: Optional[float] = None,
        amp_use_bfloat16: Optional[bool] = None,
        fsdp_config: Optional[FSDPConfig] = None,
    ) -> None:
        if fsdp_config is not None and not isinstance(fsdp_config, FSDPConfig):
            raise TypeError(
                "FairScaleCTrainingEngine: argument 'fsdp_config' must be a "
                f"fairscale_c.integrations.tango.FSDPConfig or None, got {type(fsdp_config).__name__}"
            )
        self.fsdp_config = fsdp_config or FSDPConfig()
        if amp and self.fsdp_config.mixed_precision and self.fsdp_config.compute_dtype is None:
            use_bf16 = train_config.device_type == "cpu" if amp_use_bfloat16 is None else amp_use_bfloat16
            self.fsdp_config = replace(self.fsdp_config, compute_dtype="bfloat16" if use_bf16 else "float16")
        self.logger = logging.getLogger(self.__class__.__name__)
        super().__init__(
            train_config,
            model,
            optimizer,
            lr_scheduler=lr_scheduler,
            amp=amp,
            max_grad_norm=max_grad_norm,
            amp_use_bfloat16=amp_use_bfloat16,
        )
        self.grad_scaler = ShardedGradScaler() if amp and self.amp_dtype is torch.float16 else None

    def _construct_model(self, model: Union[Model, Lazy[Model]]) -> Model:
        if isinstance(model, Lazy):
            amp_dtype = None
            if self.amp:
                amp_dtype = "bfloat16" if self.amp_dtype is torch.bfloat16 else "float16"
            with amp_dtype_while_constructing(amp_dtype):
                model = model.construct()
        if not self.fsdp_config.move_params_to_cpu:
            model.to(self.train_config.worker_local_default_device)
        return FSDP(model, **self.fsdp_config.as_kwargs())

    def clip_grad_norm(self) -> None:
        if self.max_grad_norm is not None:
            self.model.clip_grad_norm_(self.max_grad_norm)

    def get_model_state(self) -> Dict[str, Any]:
        return {"weights": self.model.local_state_dict(), "metadata": self.model.local_metadata_dict()}

    def load_model_state(self, state_dict: Dict[str, Any]) -> None:
        self.model.load_local_state_dict(state_dict["weights"])

    def save_checkpoint(self, checkpoint_dir: Path, client_state: Dict[str, Any]) -> None:
        """Collective: every worker calls it with the same directory."""
        state: Dict[str, Any] = {
            "model": self.get_model_state(),
            "optimizer": self.optimizer.state_dict(),
            "trainer": client_state,
        }
        if self.lr_scheduler is not None:
            state["lr_scheduler"] = self.lr_scheduler.state_dict()
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        step = client_state.get("training_steps") if isinstance(client_state, dict) else None
        save_sharded(state, str(checkpoint_dir), step=step if isinstance(step, int) else None)

    def load_checkpoint(self, checkpoint_dir: Path) -> Dict[str, Any]:
        state = load_sharded(str(checkpoint_dir))
        self.load_model_state(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        if self.grad_scaler is not None:
            self.grad_scaler.load_state_dict(state["grad_scaler"])
        return state["trainer"]

    def save_complete_weights_from_checkpoint(self, checkpoint_dir: Path, weights_path: Path) -> None:
        """The full weights (keys of the unwrapped model) of the checkpoint in ``checkpoint_dir``,
        consolidated from every worker's shard in rank order, saved to ``weights_path``."""
        self.logger.info("Consolidating sharded checkpoint weights...")
        shards = load_all_shards(str(Path(checkpoint_dir).resolve()))
        full = FSDP.consolidate_shard_weights(
            [s["model"]["weights"] for s in shards], [s["model"]["metadata"] for s in shards]
        )
        del shards
        torch.save(full, weights_path)
