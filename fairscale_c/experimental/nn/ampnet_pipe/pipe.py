"""The AMPnetPipe interface: an AsyncPipe whose ``interleave`` trains over a whole data loader."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.optim.optimizer import Optimizer

from ....nn.pipe import AsyncPipe
from .ampnet import AMPnetEventLoop
from ....internal.args import as_int

__all__ = ["AMPnetPipe"]


class AMPnetPipe(AsyncPipe):
    """AMPnet (https://arxiv.org/abs/1705.09786) on AsyncPipe's stages: every batch of a data
    loader is one micro-batch, each stage steps its optimizer every ``min_update_interval``
    gradients without waiting for the pipeline to drain, so forward passes use weights a few
    updates old. FairScale's constructor (AsyncPipe's arguments, as keywords) and ``interleave``."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)

    def interleave(
        self,
        lm_dataloader: Any,
        criterion: nn.Module,
        optimizer: Optimizer,
        transform_logger_object: Any,
        min_update_interval: int = 1,
        weight_prediction: bool = False,
    ) -> None:
        """One epoch over ``lm_dataloader`` (every rank passes one of the same length; the first
        stage reads inputs from it, the last targets). ``transform_logger_object`` provides
        FairScale's hooks: transform_input, transform_target, transform_output_before_loss,
        log_loss and check_and_save_weights. ``weight_prediction``: the optimizer's
        ``update_weight_using_future_predictions`` is called before each forward and backward
        and it steps every ``chunks`` gradients."""
        interval = min_update_interval
        if as_int(interval) is None or interval < 1:
            raise ValueError(
                f"AMPnetPipe.interleave: argument 'min_update_interval' must be an int >= 1, got {interval!r}"
            )
        interval = as_int(interval)
        if self.partition is None:
            return
        loop = AMPnetEventLoop(
            self, criterion, optimizer, transform_logger_object, min_update_interval, weight_prediction
        )
        if self.final_stage:
            loop.tail(lm_dataloader)
        elif self.stage == 0:
            loop.head(lm_dataloader)
        else:
            loop.trunk(lm_dataloader)
