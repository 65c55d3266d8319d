"""AMPnet's event loops, FairScale's schedule over AsyncPipe's messages.

With N stages and one data-loader batch per micro-batch:
- the first stage runs N - 1 forwards ahead, then alternates: a forward (its result held), the
  backward of its oldest micro-batch when that gradient arrives, then the held result sent on;
  then it takes the remaining gradients;
- a middle stage runs (N - 1 - its index) forwards ahead, then alternates a forward (held), a
  backward (its input gradient sent back) and the held result sent on; then the remaining
  backwards;
- the last stage runs, per micro-batch, the forward, the loss on the batch's target and its
  backward (which sends the input gradient back).
Each stage steps its optimizer after every ``min_update_interval`` gradients (every ``chunks``
with weight prediction), so later forwards see weights updated by earlier micro-batches.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, Tuple

import torch
from torch import Tensor, nn

from .... import distributed as fdist
from ....nn.pipe import microbatch
from ....nn.pipe.async_pipe import ACTIVATIONS, GRADIENTS, AsyncPipe, StageStep


class AMPnetEventLoop:
    def __init__(
        self,
        pipe: AsyncPipe,
        criterion: nn.Module,
        optimizer: Any,
        hooks: Any,
        min_update_interval: int,
        weight_prediction: bool,
    ) -> None:
        self.pipe = pipe
        self.step = StageStep(pipe, [], True)
        self.criterion = criterion
        self.optimizer = optimizer
        self.hooks = hooks
        self.min_update_interval = min_update_interval
        self.weight_prediction = weight_prediction
        self.stages = len(pipe.balance)
        self.rank = pipe.stage
        self.gradients = 0
        self.activations: Dict[int, tuple] = {}

    # ------------------------------------------------------------------ the three loops
    def head(self, loader: Any) -> None:
        batches = iter(loader)
        count = 0
        for _ in range(self.stages - 1):  # fill the pipeline
            x = self._next_input(batches)
            if x is None:
                break
            self._predict(count, forward=True)
            self._send(self._forward((x,), True, count), count)
            count += 1
        while True:
            x = self._next_input(batches)
            if x is None:
                break
            self._predict(count, forward=True)
            held = self._forward((x,), True, count)
            self._backward_one()
            self._send(held, count)
            count += 1
            self._after_gradient()
        for _ in range(len(self.activations)):
            self._backward_one()
            self._after_gradient()

    def trunk(self, loader: Any) -> None:
        total = len(loader)
        done = 0
        for _ in range(self.stages - 1 - self.rank):  # fill the pipeline
            self._predict(done, forward=True)
            index, held = self._receive_and_forward()
            self._send(held, index)
            done += 1
        while done < total:
            self._predict(done, forward=True)
            index, held = self._receive_and_forward()
            done += 1
            self._backward_one()
            self._after_gradient()
            self._send(held, index)
        for _ in range(len(self.activations)):
            self._backward_one()
            self._after_gradient()

    def tail(self, loader: Any) -> None:
        for count, batch in enumerate(loader):
            target = self.hooks.transform_target(batch).to(self.step.device)
            if self.rank == 0:  # a single stage: the input is this rank's own
                xs, atomic = (self.hooks.transform_input(batch).to(self.step.device),), True
            else:
                xs, atomic = self.step.receive_activations(count)
            self._predict(count, forward=True)
            ys = self.step.compute(xs, atomic, count)
            self._predict(self.gradients, forward=False)
            out = self.hooks.transform_output_before_loss(ys)
            loss = self.criterion(out, target)
            loss.backward()
            self.gradients += 1
            self._maybe_step()
            self.hooks.log_loss(batch, loss, count + 1)
            del loss

    # ------------------------------------------------------------------ pieces
    def _next_input(self, batches: Iterator[Any]) -> Any:
        try:
            batch = next(batches)
        except StopIteration:
            return None
        return self.hooks.transform_input(batch).to(self.step.device)

    def _forward(self, xs: tuple, atomic: bool, index: int) -> Tuple[tuple, bool]:
        """This stage's partition on micro-batch ``index``: (outputs, whether one tensor), held
        until their gradients come back."""
        out = self.step.compute(xs, atomic, index)
        ys = microbatch.as_tuple(out)
        self.activations[index] = ys
        return ys, isinstance(out, Tensor)

    def _receive_and_forward(self) -> Tuple[int, Tuple[tuple, bool]]:
        index = len(self.activations) + self.gradients  # micro-batches arrive in order
        xs, atomic = self.step.receive_activations(index)
        return index, self._forward(xs, atomic, index)

    def _send(self, held: Tuple[tuple, bool], index: int) -> None:
        ys, atomic = held
        self.step.send(ACTIVATIONS, index, [y.detach() for y in ys], atomic, self.rank + 1)

    def _backward_one(self) -> None:
        """Receive one micro-batch's output gradients from the next stage and run its backward."""
        kind, index, _, metas = self.step.receive_header(self.rank + 1)
        if kind != GRADIENTS or index not in self.activations:
            raise fdist.DistributedError(
                f"AMPnetPipe stage {self.rank}: expected gradients of a held micro-batch from stage {self.rank + 1}, "
                f"got a message of kind {kind} for micro-batch {index}"
            )
        grads = self.step.receive_tensors(metas, self.rank + 1)
        ys = self.activations.pop(index)
        if len(grads) != len(ys):
            raise RuntimeError("different number of tensors and gradients")
        self._predict(self.gradients, forward=False)
        pairs = [(y, g) for y, g in zip(ys, grads) if g is not None and isinstance(y, Tensor) and y.requires_grad]
        if pairs:
            torch.autograd.backward([y for y, _ in pairs], [g for _, g in pairs])

    def _after_gradient(self) -> None:
        self.gradients += 1
        self._maybe_step()

    def _maybe_step(self) -> None:
        if self.optimizer is None:
            return
        if self.weight_prediction:
            due = self.gradients % self.pipe.chunks == 0
        else:
            due = self.gradients % self.min_update_interval == 0
        if due:
            self.optimizer.step()
            self.optimizer.zero_grad()
            self.hooks.check_and_save_weights(self.gradients)

    def _predict(self, count: int, forward: bool) -> None:
        if self.weight_prediction:
            self.optimizer.update_weight_using_future_predictions(
                self.rank, self.stages, count, self.pipe.chunks, forward=forward
            )
