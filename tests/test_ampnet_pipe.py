"""fairscale_c.experimental.nn.ampnet_pipe.AMPnetPipe: one epoch of asynchronous pipeline
training over a data loader. With no optimizer step inside the epoch, each stage's accumulated
gradients equal the plain model's summed over the batches (2 and 3 stages); one stage trains as
the plain loop; with a step after every gradient, parameters equal FairScale's AMPnetPipe's
(where FairScale is importable); weight prediction's hooks and bad input."""

import pytest
import torch
from torch import nn
from torch.optim.optimizer import Optimizer

from dist_utils import OneRankGroup, clean_dev_shm, join_gloo, run_ranks  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("clean_dev_shm")


class DataSGD(Optimizer):
    """FairScale's test optimizer: updates ``p.data``, so that a backward of a micro-batch whose
    forward ran before the step can still run (AMPnet's stale activations need that)."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, dict(lr=lr))
        self.predictions = []

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad.data, alpha=-group["lr"])

    def update_weight_using_future_predictions(self, rank, stages, count, chunks, forward):
        self.predictions.append((count, forward))


class Hooks:
    def __init__(self):
        self.losses, self.saves = [], []

    def transform_input(self, batch):
        return batch["input"]

    def transform_target(self, batch):
        return batch["target"]

    def transform_output_before_loss(self, output):
        return output

    def log_loss(self, batch, loss, count):
        self.losses.append((count, loss.item()))

    def check_and_save_weights(self, num_gradients):
        self.saves.append(num_gradients)


def _loader(batches=7):
    g = torch.Generator().manual_seed(3)
    return [
        {
            "input": torch.randn(4, 6, generator=g, dtype=torch.float64),
            "target": torch.randn(4, 6, generator=g, dtype=torch.float64),
        }
        for _ in range(batches)
    ]


def _model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 6), nn.Linear(6, 6)
    ).double()


BALANCES = {2: [3, 3], 3: [2, 2, 2]}


def _job(rank, world):
    import torch.distributed as dist

    from fairscale_c.experimental.nn.ampnet_pipe import AMPnetPipe

    join_gloo(rank, world)
    failures = []
    try:
        balance = BALANCES[world]
        loader = _loader()
        # no step inside the epoch: gradients accumulate at the initial weights
        pipe = AMPnetPipe(module=_model(), balance=balance, group=dist.group.WORLD, chunks=3, checkpoint="except_last")
        opt = DataSGD(pipe.parameters(), lr=0.1)
        hooks = Hooks()
        pipe.interleave(loader, nn.MSELoss(), opt, hooks, min_update_interval=len(loader) + 1)
        ref = _model()
        for batch in loader:
            nn.MSELoss()(ref(batch["input"]), batch["target"]).backward()
        start = sum(balance[:rank])
        mine = dict(pipe.named_parameters())
        for name, p in ref.named_parameters():
            index, rest = name.split(".", 1)
            if start <= int(index) < start + balance[rank]:
                got = mine.pop(f"0.{index}.{rest}")
                if not torch.allclose(got.grad, p.grad, rtol=1e-12, atol=1e-12):
                    failures.append(f"{name}: accumulated gradient differs")
        if mine:
            failures.append(f"unexpected parameters {sorted(mine)}")
        if pipe.final_stage and [c for c, _ in hooks.losses] != list(range(1, len(loader) + 1)):
            failures.append(f"losses logged: {hooks.losses}")
        if hooks.saves:
            failures.append(f"weights saved without a step: {hooks.saves}")
        # a step after every gradient: every stage steps once per batch
        pipe = AMPnetPipe(module=_model(), balance=balance, group=dist.group.WORLD, chunks=3, checkpoint="never")
        hooks = Hooks()
        pipe.interleave(loader, nn.MSELoss(), DataSGD(pipe.parameters(), lr=0.1), hooks)
        if hooks.saves != list(range(1, len(loader) + 1)):
            failures.append(f"steps: {hooks.saves}")
        # weight prediction: the hook before every forward and backward, a step every `chunks`
        pipe = AMPnetPipe(module=_model(), balance=balance, group=dist.group.WORLD, chunks=3)
        opt, hooks = DataSGD(pipe.parameters(), lr=0.1), Hooks()
        pipe.interleave(loader, nn.MSELoss(), opt, hooks, weight_prediction=True)
        if sorted(opt.predictions) != sorted([(i, True) for i in range(7)] + [(i, False) for i in range(7)]):
            failures.append(f"predictions: {opt.predictions}")
        if hooks.saves != [3, 6]:
            failures.append(f"weight-prediction steps: {hooks.saves}")
    finally:
        dist.destroy_process_group()
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_epoch_without_steps_accumulates_the_plain_gradients(world):
    assert run_ranks(_job, world, timeout=200) == [[]] * world


def test_one_stage_trains_as_the_plain_loop():
    from fairscale_c.experimental.nn.ampnet_pipe import AMPnetPipe

    loader = _loader()
    pipe = AMPnetPipe(module=_model(), balance=[6], group=OneRankGroup(), chunks=2, checkpoint="always")
    hooks = Hooks()
    pipe.interleave(loader, nn.MSELoss(), DataSGD(pipe.parameters(), lr=0.1), hooks, min_update_interval=2)
    ref = _model()
    opt = DataSGD(ref.parameters(), lr=0.1)
    losses = []
    for i, batch in enumerate(loader):
        loss = nn.MSELoss()(ref(batch["input"]), batch["target"])
        loss.backward()
        losses.append((i + 1, loss.item()))
        if (i + 1) % 2 == 0:
            opt.step()
            opt.zero_grad()
    assert hooks.losses == losses and hooks.saves == [2, 4, 6]
    for a, b in zip(pipe.parameters(), ref.parameters()):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="'min_update_interval'"):
        pipe.interleave(loader, nn.MSELoss(), None, hooks, min_update_interval=0)


def _fairscale_job(rank, world):
    import torch.distributed as dist
    from fairscale.experimental.nn.ampnet_pipe.pipe import AMPnetPipe as Theirs

    from dist_utils import fairscale_pipeline_rpc
    from fairscale_c.experimental.nn.ampnet_pipe import AMPnetPipe as Ours

    join_gloo(rank, world)
    failures = []
    try:
        with fairscale_pipeline_rpc(rank, world) as workers:
            params = []
            for cls, extra in ((Theirs, dict(worker_map=workers)), (Ours, dict(group=dist.group.WORLD))):
                pipe = cls(module=_model(), balance=BALANCES[world], chunks=3, checkpoint="never", **extra)
                pipe.interleave(_loader(), nn.MSELoss(), DataSGD(pipe.parameters(), lr=0.1), Hooks())
                params.append([p.detach().clone() for p in pipe.parameters()])
        if not all(torch.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(*params)):
            failures.append("parameters after the epoch differ from FairScale's")
    finally:
        dist.destroy_process_group()
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_equals_fairscales_ampnet_pipe(world):
    fs = pytest.importorskip("fairscale.experimental.nn.ampnet_pipe.pipe")
    if fs.__spec__.name.startswith("fairscale_c"):
        pytest.skip("fairscale is this package's alias here, not FairScale")
    assert run_ranks(_fairscale_job, world, timeout=200) == [[]] * world
