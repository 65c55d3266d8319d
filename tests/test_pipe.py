"""fairscale_c.nn.Pipe in one process: numerics against the plain nn.Sequential, skip connections,
deferred BatchNorm, balance helpers, failures, and argument errors as FairScale raises them."""

import copy
import gc
import importlib.util
import threading
import time
import warnings

import numpy
import pytest
import torch
from torch import nn

from fairscale_c.nn import Pipe
from fairscale_c.nn.pipe import is_checkpointing, is_recomputing
from fairscale_c.nn.pipe.balance import balance_by_size, balance_by_time
from fairscale_c.nn.pipe.balance.blockpartition import solve
from fairscale_c.nn.pipe.batchnorm import DeferredBatchNorm
from fairscale_c.nn.pipe.skip import Namespace, pop, skippable, stash, verify_skippables
from fairscale_c.nn.pipe.threads import _load_setters

HAS_FAIRSCALE = importlib.util.find_spec("fairscale") is not None
MODES = ["always", "except_last", "never"]


def mlp(seed=0, width=16, depth=5, dropout=0.0):
    torch.manual_seed(seed)
    layers = [nn.Linear(8, width)]
    for _ in range(depth - 2):
        layers += [nn.Tanh(), nn.Linear(width, width)]
        if dropout:
            layers.append(nn.Dropout(dropout))
    layers += [nn.ReLU(), nn.Linear(width, 4)]
    return nn.Sequential(*layers)


def grads(module):
    return [p.grad for p in module.parameters()]


def run_both(ref, pipe, x, weight=None):
    """Forward and backward through both; returns (ref out, pipe out, ref x.grad, pipe x.grad)."""
    xa = x.detach().clone().requires_grad_()
    xb = x.detach().clone().requires_grad_()
    ya, yb = ref(xa), pipe(xb)
    w = weight if weight is not None else torch.linspace(-1, 1, ya.numel()).view_as(ya)
    (ya * w).sum().backward()
    (yb * w.to(yb.device)).sum().backward()
    return ya, yb, xa.grad, xb.grad


def assert_same_training(ref, pipe, x):
    ya, yb, ga, gb = run_both(ref, pipe, x)
    torch.testing.assert_close(yb.to(ya.device), ya, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(gb.to(ga.device), ga, atol=1e-6, rtol=1e-5)
    for pa, pb in zip(ref.parameters(), pipe.parameters()):
        torch.testing.assert_close(pb.grad.to(pa.device), pa.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunks,batch", [(1, 8), (2, 8), (4, 8), (4, 10), (3, 10)])
def test_matches_sequential(mode, chunks, batch):
    ref = mlp()
    pipe = Pipe(mlp(), balance=[3, 3, 3], devices=["cpu"] * 3, chunks=chunks, checkpoint=mode)
    assert_same_training(ref, pipe, torch.randn(batch, 8))


def test_two_partitions_and_repeated_steps_with_optimizer():
    ref, model = mlp(), mlp()
    pipe = Pipe(model, balance=[5, 4], devices=["cpu", "cpu"], chunks=4)
    opt_a = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(12, 8, generator=torch.Generator().manual_seed(step))
        opt_a.zero_grad()
        opt_b.zero_grad()
        assert_same_training(ref, pipe, x)
        opt_a.step()
        opt_b.step()
    for pa, pb in zip(ref.parameters(), pipe.parameters()):
        torch.testing.assert_close(pb, pa, atol=1e-6, rtol=1e-5)


def test_batch_smaller_than_chunks_and_eval_and_no_grad():
    ref, pipe = mlp(), Pipe(mlp(), [4, 5], devices=["cpu", "cpu"], chunks=8)
    assert_same_training(ref, pipe, torch.randn(3, 8))  # 3 micro-batches of one row, as FairScale
    x = torch.randn(6, 8)
    with torch.no_grad():
        y = pipe(x)
    assert not y.requires_grad
    torch.testing.assert_close(y, ref(x))
    pipe.eval()
    ref.eval()
    assert_same_training(ref, pipe, x)  # eval mode: no checkpointing, gradients still flow


class GradMode(nn.Module):
    """Records the grad mode its forward ran under (on whichever thread)."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append(torch.is_grad_enabled())
        return x


@pytest.mark.parametrize("chunks", [1, 2])
def test_partitions_run_under_callers_grad_mode(chunks):
    probes = [GradMode(), GradMode()]
    pipe = Pipe(
        nn.Sequential(nn.Linear(8, 8), probes[0], nn.Linear(8, 8), probes[1]),
        [2, 2],
        devices=["cpu", "cpu"],
        chunks=chunks,
        checkpoint="never",
    )
    x = torch.randn(4, 8)
    with torch.no_grad():
        pipe(x)
    assert [p.seen for p in probes] == [[False] * chunks] * 2  # no graph is built on the workers
    for p in probes:
        p.seen.clear()
    pipe(x).sum().backward()
    assert [p.seen for p in probes] == [[True] * chunks] * 2


class ThreadCount(nn.Module):
    """Records the operator threads of each call; can hold its first call until the event `wait`
    is set, or set the event `signal` on its second call."""

    def __init__(self, wait=None, signal=None):
        super().__init__()
        self.seen, self.wait, self.signal = [], wait, signal

    def forward(self, x):
        self.seen.append(torch.get_num_threads())
        if self.signal is not None and len(self.seen) == 2:
            self.signal.set()
        if self.wait is not None and len(self.seen) == 1:
            assert self.wait.wait(timeout=30), "partition 0 never ran its second micro-batch"
        return x


def test_partitions_computing_at_once_share_the_callers_threads():
    if not _load_setters():
        pytest.skip("torch's CPU library exports no per-thread OpenMP/MKL thread setters")
    gate = threading.Event()
    first, second = ThreadCount(signal=gate), ThreadCount(wait=gate)
    model = nn.Sequential(nn.Linear(8, 8), first, nn.Linear(8, 8), second)
    pipe = Pipe(model, [2, 2], devices=["cpu", "cpu"], chunks=4, checkpoint="never")
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        out = pipe(torch.randn(8, 8))
        # Micro-batch 0: partition 0 alone has work, so it gets all 4 threads. Micro-batch 1:
        # partition 1 holds micro-batch 0 (it waits for this call), so each gets 4 // 2.
        assert first.seen[:2] == [4, 2]
        assert len(first.seen) == len(second.seen) == 4
        out.sum().backward()
        pipe(torch.randn(1, 8)).sum().backward()  # one micro-batch: partition 0's worker alone again
        assert first.seen[-1] == second.seen[-1] == 4
        assert torch.get_num_threads() == 4  # the caller's setting is not touched
        elsewhere = []
        t = threading.Thread(target=lambda: elsewhere.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert elsewhere == [4]  # nor is the default other threads take
    finally:
        torch.set_num_threads(before)


class Split(nn.Module):
    def forward(self, x):
        return x[:, :4], x[:, 4:].relu(), (x[:, 0] > 0).long()


class Join(nn.Module):
    def forward(self, xs):
        a, b, flags = xs
        return a * b + flags.unsqueeze(1).float(), flags


@pytest.mark.parametrize("mode", MODES)
def test_tuple_inputs_and_outputs(mode):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 8), Split(), Join())
    pipe = Pipe(
        nn.Sequential(nn.Linear(8, 8), Split(), Join()), [2, 1], devices=["cpu", "cpu"], chunks=3, checkpoint=mode
    )
    pipe[0].load_state_dict(ref[0].state_dict())
    x = torch.randn(7, 8)
    ya, fa = ref(x)
    yb, fb = pipe(x)
    assert torch.equal(fa, fb) and fb.dtype == torch.long and not fb.requires_grad
    ya.sum().backward()
    yb.sum().backward()
    torch.testing.assert_close(yb, ya)
    torch.testing.assert_close(pipe[0].weight.grad, ref[0].weight.grad)
    # A tuple given as the input is split element-wise.
    two = Pipe(nn.Sequential(Join()), [1], devices=["cpu"], chunks=2)
    out, flags = two((torch.ones(4, 2), torch.full((4, 2), 3.0), torch.arange(4)))
    assert torch.equal(out, torch.full((4, 2), 3.0) + torch.arange(4).unsqueeze(1).float())


@skippable(stash=["skip"])
class StashLayer(nn.Module):
    def forward(self, x):
        yield stash("skip", x)
        return x * 2


@skippable(pop=["skip"])
class PopLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        skip = yield pop("skip")
        return self.lin(x) + skip


def skip_model(seed=0):
    torch.manual_seed(seed)
    ns1, ns2 = Namespace(), Namespace()
    return nn.Sequential(
        nn.Linear(8, 8),
        StashLayer().isolate(ns1),
        nn.Tanh(),
        StashLayer().isolate(ns2),
        nn.Linear(8, 8),
        PopLayer().isolate(ns2),  # same partition as its stash with balance [2, 4, 2]: ns2 stays local
        PopLayer().isolate(ns1),  # crosses from partition 0 to partition 1... or 2
        nn.Linear(8, 8),
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("balance", [[2, 4, 2], [2, 2, 4], [4, 3, 1]])
def test_skip_connections_across_partitions(mode, balance):
    ref = skip_model()  # skippable modules work without a Pipe too
    pipe = Pipe(skip_model(), balance, devices=["cpu"] * 3, chunks=3, checkpoint=mode)
    assert_same_training(ref, pipe, torch.randn(9, 8))


def nested_skip_model(seed=0):
    """Stash and pop inside sub-Sequentials, not layers of the Pipe's Sequential."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Sequential(nn.Linear(8, 8), StashLayer(), nn.Tanh()),
        nn.Linear(8, 8),
        nn.Sequential(nn.Linear(8, 8), PopLayer()),
    )


@pytest.mark.parametrize("mode", MODES)
def test_nested_skip_connections_across_partitions(mode):
    # FairScale runs these only where nothing is recomputed; here every checkpoint mode trains
    ref = nested_skip_model()
    pipe = Pipe(nested_skip_model(), [1, 2], devices=["cpu"] * 2, chunks=3, checkpoint=mode)
    assert_same_training(ref, pipe, torch.randn(9, 8))


def test_verify_skippables_and_missing_pop():
    with pytest.raises(TypeError, match="no module declared 'skip' as poppable but stashed"):
        verify_skippables(nn.Sequential(StashLayer(), nn.Linear(8, 8)))
    with pytest.raises(TypeError, match="declared 'skip' as poppable but it was not stashed"):
        Pipe(nn.Sequential(PopLayer(), nn.Linear(8, 8)), [1, 1], devices=["cpu", "cpu"])
    with pytest.raises(TypeError, match="redeclared 'skip' as stashable but not isolated"):
        verify_skippables(nn.Sequential(StashLayer(), StashLayer(), PopLayer()))


@pytest.mark.parametrize("mode", ["always", "never"])
def test_deferred_batch_norm_has_full_batch_statistics(mode):
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(3, momentum=0.3)
    conv = nn.Conv2d(3, 3, 1)
    ref = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3, momentum=0.3), nn.ReLU())
    model = nn.Sequential(conv, bn, nn.ReLU())
    model.load_state_dict(ref.state_dict())
    pipe = Pipe(model, [1, 2], devices=["cpu", "cpu"], chunks=4, checkpoint=mode, deferred_batch_norm=True)
    assert isinstance(pipe[1], DeferredBatchNorm)
    for step in range(2):
        x = torch.randn(16, 3, 4, 4) * (step + 1) + step
        ref(x)
        pipe(x).sum().backward()  # backward recomputes under "always": counted once
    torch.testing.assert_close(pipe[1].running_mean, ref[1].running_mean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pipe[1].running_var, ref[1].running_var, atol=1e-5, rtol=1e-5)
    assert pipe[1].num_batches_tracked.item() == 2
    pipe.eval()
    ref.eval()
    x = torch.randn(4, 3, 4, 4)
    torch.testing.assert_close(pipe(x), ref(x), atol=1e-5, rtol=1e-5)


def test_deferred_batch_norm_cumulative_average_with_momentum_none():
    """momentum=None: BatchNorm's cumulative moving average (factor 1 / num_batches_tracked), of
    the statistics of each whole mini-batch, as nn.BatchNorm2d(momentum=None) gives over 3 steps."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3, momentum=None), nn.ReLU())
    model = copy.deepcopy(ref)
    pipe = Pipe(model, [1, 2], devices=["cpu", "cpu"], chunks=4, deferred_batch_norm=True)
    assert isinstance(pipe[1], DeferredBatchNorm) and pipe[1].momentum is None
    for step in range(3):
        x = torch.randn(16, 3, 4, 4) * (step + 1) + 2 * step
        ref(x)
        pipe(x).sum().backward()
        torch.testing.assert_close(pipe[1].running_mean, ref[1].running_mean, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pipe[1].running_var, ref[1].running_var, atol=1e-5, rtol=1e-5)
    assert pipe[1].num_batches_tracked.item() == ref[1].num_batches_tracked.item() == 3


class FailOnSecondCall(nn.Module):
    """Once armed, raises on its second call: a mini-batch whose forward stops part way, after
    the layers before it in the partition have seen one micro-batch."""

    def __init__(self):
        super().__init__()
        self.calls = None

    def forward(self, x):
        if self.calls is not None:
            self.calls += 1
            if self.calls == 2:
                self.calls = None
                raise ValueError("stopped part way")
        return x


@pytest.mark.parametrize("mode", ["always", "never"])
def test_deferred_batch_norm_commits_once_per_mini_batch_of_fewer_rows_than_chunks(mode):
    # Batches of 3 and 2 rows in chunks=4 give 3 and 2 micro-batches; a forward that raised
    # after the BatchNorm saw one of its micro-batches leaves no partial sums behind.
    ref = nn.BatchNorm1d(2)
    pipe = Pipe(
        nn.Sequential(nn.BatchNorm1d(2), FailOnSecondCall(), nn.Identity()),
        [2, 1],
        devices=["cpu", "cpu"],
        chunks=4,
        checkpoint=mode,
        deferred_batch_norm=True,
    )
    torch.manual_seed(0)
    for step, rows in enumerate([3, 2, 8, 5]):
        x = torch.randn(rows, 2, 5) + 10 * step
        if step == 2:
            pipe[1].calls = 0
            with pytest.raises(ValueError, match="stopped part way"):
                pipe(torch.randn(8, 2, 5) * 100)
        ref(x)
        pipe(x).sum().backward()
        assert pipe[0].num_batches_tracked.item() == step + 1
        torch.testing.assert_close(pipe[0].running_mean, ref.running_mean, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(pipe[0].running_var, ref.running_var, atol=1e-4, rtol=1e-5)


def test_blockpartition_solve():
    assert solve([1, 2, 3, 4, 5, 6], partitions=2) == [[1, 2, 3, 4], [5, 6]]
    assert solve([1, 1, 1, 1], partitions=4) == [[1], [1], [1], [1]]
    with pytest.raises(ValueError):
        solve([1, 2], partitions=3)


class Sleep(nn.Module):
    def __init__(self, seconds):
        super().__init__()
        self.seconds = seconds
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        time.sleep(self.seconds)
        return self.lin(x)


def test_balance_helpers_on_uneven_layers():
    # Two slow layers first: by time one of them gets a partition to itself (FairScale's
    # heuristic stops once blocks differ by at most one layer's normalised cost).
    model = nn.Sequential(Sleep(0.05), Sleep(0.05), *[Sleep(0) for _ in range(6)])
    nn.Linear(8, 8)(torch.randn(4, 8)).sum().backward()  # autograd's first backward is slow: not here
    assert balance_by_time(2, model, torch.randn(4, 8), timeout=0.3, device="cpu") == [1, 7]
    assert all(p.grad is None for p in model.parameters())  # profiled on copies
    # Two big layers last (activations 2048 wide): by size each goes to its own partition.
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2048), nn.ReLU())
    model.append(nn.Linear(2048, 8))
    assert balance_by_size(2, model, torch.randn(64, 8), chunks=4, device="cpu") == [5, 2]
    with pytest.raises(ValueError):
        balance_by_size(8, model, torch.randn(64, 8), device="cpu")
    if HAS_FAIRSCALE:  # the same partitioning heuristic as FairScale's
        from fairscale.nn.pipe.balance.blockpartition import solve as fs_solve

        for costs in ([5, 1, 1, 1, 9, 2, 2], [1, 2, 3, 4, 5, 6, 7, 8], [3, 3, 3]):
            for k in range(1, len(costs) + 1):
                assert solve(list(costs), k) == fs_solve(list(costs), k)


class Boom(nn.Module):
    def __init__(self, on_backward=False):
        super().__init__()
        self.on_backward = on_backward

    def forward(self, x):
        if self.on_backward:
            return _FailingBackward.apply(x)
        if x[0, 0] > -1e9:
            raise ValueError("boom in a partition")
        return x


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, g):
        raise ArithmeticError("boom in backward")


@pytest.mark.parametrize("where", [0, 1, 2])
def test_exception_in_a_partition_reaches_the_caller(where):
    layers = [nn.Linear(8, 8) for _ in range(3)]
    layers.insert(where + 1, Boom())
    pipe = Pipe(nn.Sequential(*layers), [1, 2, 1] if where < 2 else [1, 1, 2], devices=["cpu"] * 3, chunks=4)
    start = time.monotonic()
    with pytest.raises(ValueError, match="boom in a partition"):
        pipe(torch.randn(8, 8))
    assert time.monotonic() - start < 10
    # The pipe still works afterwards: no worker was left waiting.
    pipe[where + 1].forward = lambda x: x
    assert pipe(torch.randn(8, 8)).shape == (8, 8)


def test_a_failed_run_starts_no_more_micro_batches():
    """As FairScale's Pipe: once a partition has raised, the others start nothing new, even
    when their next input is already there."""
    raised, calls, armed = threading.Event(), [], [False]

    class Counter(nn.Module):
        def forward(self, x):
            if armed[0]:
                calls.append(len(calls))
                if len(calls) == 2:  # busy with micro-batch 1 while the next partition fails on 0
                    assert raised.wait(10)
                    time.sleep(0.1)
            return x

    class Raise(nn.Module):
        def forward(self, x):
            if armed[0]:
                raised.set()
                raise ValueError("boom in the last partition")
            return x

    pipe = Pipe(nn.Sequential(nn.Identity(), Counter(), Raise()), [1, 1, 1], devices=["cpu"] * 3, chunks=3)
    pipe(torch.randn(3, 2))  # the first run takes turns while it learns which partitions draw random numbers
    armed[0] = True
    with pytest.raises(ValueError, match="boom in the last partition"):
        pipe(torch.randn(3, 2))
    # Partition 1 may or may not have started micro-batch 1 before partition 2 failed (FairScale
    # runs them in the same clock cycle); micro-batch 2 had arrived, and must not start.
    assert calls in ([0], [0, 1])


def test_a_failed_first_run_starts_no_more_micro_batches():
    """The same in a Pipe's first run, whose tasks take turns in clock order while it learns which
    partitions draw random numbers: the failure is recorded before the next task's turn comes."""

    class Counter(nn.Module):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return x

    class Raise(nn.Module):
        def forward(self, x):
            raise ValueError("boom in the last partition")

    for _ in range(200):  # a fresh Pipe each time: only a Pipe's first run takes turns
        counter = Counter()
        pipe = Pipe(nn.Sequential(nn.Identity(), counter, Raise()), [1, 1, 1], devices=["cpu"] * 3, chunks=3)
        with pytest.raises(ValueError, match="boom in the last partition"):
            pipe(torch.randn(3, 2))
        # turns: ... (1, 1) counter, (0, 2) raises, (2, 1) counter must not run
        assert counter.calls == 2


def test_exception_in_backward_reaches_the_caller():
    pipe = Pipe(nn.Sequential(nn.Linear(8, 8), Boom(on_backward=True), nn.Linear(8, 8)), [1, 2], devices=["cpu"] * 2)
    y = pipe(torch.randn(4, 8, requires_grad=True))
    with pytest.raises(ArithmeticError, match="boom in backward"):
        y.sum().backward()


class Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 3

    @staticmethod
    def backward(ctx, g):
        return g * 3


class ScaleLayer(nn.Module):
    def forward(self, x):
        return Scale.apply(x)


class Flags(nn.Module):
    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append((is_checkpointing(), is_recomputing()))
        return x


@pytest.mark.parametrize("mode", MODES)
def test_autograd_functions_and_inplace_ops_in_partitions(mode):
    def build():
        torch.manual_seed(0)
        relu = nn.ReLU(inplace=True)
        return nn.Sequential(nn.Linear(8, 8), relu, ScaleLayer(), nn.ReLU(inplace=True), nn.Linear(8, 4))

    ref = build()
    pipe = Pipe(build(), [1, 2, 2], devices=["cpu"] * 3, chunks=2, checkpoint=mode)  # in-place ops open partitions
    assert_same_training(ref, pipe, torch.randn(6, 8))


class AddOne(nn.Module):
    def forward(self, x):
        return x.add_(1.0)


class ExpInPlace(nn.Module):
    def forward(self, x):
        return x.mul_(0.1).exp_()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_inplace_ops_that_are_not_idempotent_opening_partitions(mode, chunks):
    """A checkpointed partition's recomputation starts from its inputs as they were, whatever its
    first pass did to them in place; an in-place op on one micro-batch (a view of the batch)
    leaves what another saved for backward alone, and so does a recomputation what a later
    partition saved. The first partition's in-place op acts on a non-leaf input, as plain torch
    allows."""

    def build():
        torch.manual_seed(0)
        return nn.Sequential(AddOne(), nn.Linear(8, 8), AddOne(), nn.Linear(8, 8), ExpInPlace(), nn.Linear(8, 4))

    ref = build()
    pipe = Pipe(build(), [2, 2, 2], devices=["cpu"] * 3, chunks=chunks, checkpoint=mode)
    x = torch.randn(8, 8)
    wa, wb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = ref(wa * 2), pipe(wb * 2)
    w = torch.linspace(-1, 1, ya.numel()).view_as(ya)
    (ya * w).sum().backward()
    (yb * w).sum().backward()
    torch.testing.assert_close(yb, ya, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(wb.grad, wa.grad, atol=1e-6, rtol=1e-5)
    for pa, pb in zip(ref.parameters(), pipe.parameters()):
        torch.testing.assert_close(pb.grad, pa.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("chunks", [1, 2])
def test_a_popped_skip_changed_in_place_in_a_checkpointed_partition(mode, chunks):
    """A partition changes a popped skip tensor in place: its recomputation starts from the tensor
    as it arrived (FairScale's recomputes from the changed one)."""
    from fairscale_c.nn.pipe.skip import pop, skippable, stash

    @skippable(stash=["s"])
    class Stash(nn.Module):
        def forward(self, x):
            yield stash("s", x * 3)
            return x * 1

    @skippable(pop=["s"])
    class Pop(nn.Module):
        def forward(self, x):
            s = yield pop("s")
            s.mul_(2)
            return x * s * s

    def build():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 3), Stash(), nn.Linear(3, 3), Pop(), nn.Linear(3, 3))

    ref = build()
    pipe = Pipe(build(), [2, 2, 1], devices=["cpu"] * 3, chunks=chunks, checkpoint=mode)
    assert_same_training(ref, pipe, torch.randn(4, 3))


def test_checkpointing_flags():
    flags = Flags()
    pipe = Pipe(nn.Sequential(nn.Linear(2, 2), flags), [1, 1], devices=["cpu"] * 2, chunks=2, checkpoint="except_last")
    pipe(torch.randn(4, 2)).sum().backward()
    assert sorted(flags.seen) == [(False, False), (False, True), (True, False)]


@pytest.mark.parametrize("mode", ["always", "except_last"])
def test_no_checkpointing_in_eval_mode_with_grad_enabled(mode):
    """FairScale checkpoints nothing in eval mode (checkpoint_stop 0), even with autograd on:
    no micro-batch runs checkpointed or is recomputed, and gradients are still those of the
    plain model."""
    flags = Flags()
    pipe = Pipe(nn.Sequential(nn.Linear(2, 2), flags), [1, 1], devices=["cpu"] * 2, chunks=2, checkpoint=mode)
    pipe.eval()
    assert torch.is_grad_enabled()
    pipe(torch.randn(4, 2)).sum().backward()
    assert flags.seen == [(False, False), (False, False)], flags.seen
    ref = mlp()
    pipe = Pipe(mlp(), [3, 2, 4], devices=["cpu"] * 3, chunks=3, checkpoint=mode).eval()
    assert_same_training(ref.eval(), pipe, torch.randn(6, 8))


def dropout_model():
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.Dropout(0.5), nn.Tanh(), nn.Linear(16, 8), nn.Dropout(0.3), nn.Linear(8, 4)]
    return nn.Sequential(*layers)


@pytest.mark.parametrize("mode", MODES)
def test_dropout_with_checkpointing_matches_sequential_for_one_chunk(mode):
    ref, pipe = dropout_model(), Pipe(dropout_model(), [2, 3, 1], devices=["cpu"] * 3, chunks=1, checkpoint=mode)
    x = torch.randn(8, 8)
    for _ in range(2):  # the second step runs with the drawing partitions already known
        torch.manual_seed(7)
        xa, ya = x.clone().requires_grad_(), None
        ya = ref(xa)
        ya.sum().backward()
        after_ref = torch.rand(1)
        torch.manual_seed(7)
        xb = x.clone().requires_grad_()
        yb = pipe(xb)
        yb.sum().backward()
        assert torch.equal(torch.rand(1), after_ref)  # the generator advanced as in the plain model
        torch.testing.assert_close(yb, ya)
        torch.testing.assert_close(xb.grad, xa.grad)
        for pa, pb in zip(ref.parameters(), pipe.parameters()):
            torch.testing.assert_close(pb.grad, pa.grad)
            pa.grad = pb.grad = None


@pytest.mark.parametrize("mode", ["always", "except_last"])
def test_recomputation_replays_the_dropout_masks(mode):
    # y = x * mask / (1 - p) twice over: d(sum y)/dx is y / x exactly when backward used the
    # masks of the forward, whichever micro-batch ran when.
    pipe = Pipe(nn.Sequential(nn.Dropout(0.5), nn.Dropout(0.5)), [1, 1], devices=["cpu"] * 2, chunks=4, checkpoint=mode)
    for _ in range(3):
        x = (torch.rand(16, 32) + 0.5).requires_grad_()
        y = pipe(x)
        y.sum().backward()
        torch.testing.assert_close(x.grad, y.detach() / x.detach())


@pytest.mark.skipif(not HAS_FAIRSCALE, reason="fairscale 0.4.13 is not installed")
@pytest.mark.parametrize("mode", MODES)
def test_dropout_masks_equal_fairscales_under_the_same_seed(mode):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from fairscale.nn import Pipe as FairScalePipe

        results = []
        for cls in (FairScalePipe, Pipe):
            pipe = cls(dropout_model(), [2, 2, 2], devices=["cpu"] * 3, chunks=3, checkpoint=mode)
            for _ in range(2):
                torch.manual_seed(3)
                x = torch.randn(10, 8, requires_grad=True)
                y = pipe(x)
                y.sum().backward()
            results.append((y.detach(), x.grad, grads(pipe), torch.rand(1)))
    (ya, ga, pa, ra), (yb, gb, pb, rb) = results
    torch.testing.assert_close(yb, ya)
    torch.testing.assert_close(gb, ga)
    assert torch.equal(ra, rb)
    for a, b in zip(pa, pb):
        torch.testing.assert_close(b, a)


def test_module_protocol_and_attributes():
    model = mlp()
    layers = list(model)
    pipe = Pipe(model, [3, 6], devices=["cpu", torch.device("cpu")], chunks=4, checkpoint="always")
    assert len(pipe) == 9 and list(pipe) == layers
    assert pipe[0] is layers[0] and pipe[4] is layers[4] and pipe[-1] is layers[-1] and pipe[-9] is layers[0]
    assert pipe[numpy.int64(4)] is layers[4] and pipe[torch.tensor(-1)] is layers[-1]  # as nn.Sequential
    with pytest.raises(TypeError, match="Pipe indices must be integers, not str"):
        pipe["0"]
    assert pipe.pipeline is pipe._pipeline  # FairScale's attribute
    with pytest.raises(IndexError):
        pipe[9]
    with pytest.raises(IndexError):
        pipe[-10]
    assert pipe.balance == [3, 6] and pipe.devices == [torch.device("cpu")] * 2
    assert pipe.chunks == 4 and pipe.checkpoint == "always"
    assert isinstance(pipe.partitions, nn.ModuleList) and [len(p) for p in pipe.partitions] == [3, 6]
    assert "partitions.0.0.weight" in pipe.state_dict()
    for call in (pipe.cuda, pipe.cpu, lambda: pipe.to("cpu"), lambda: pipe.to(torch.device("cpu")), lambda: pipe.to(0)):
        with pytest.raises(TypeError, match="denied to move parameters"):
            call()
    with pytest.raises(TypeError):
        pipe.to(device="cpu")
    with pytest.raises(TypeError):
        pipe.to(torch.zeros(1))
    assert pipe.to(torch.float64) is pipe and pipe[0].weight.dtype == torch.float64
    # any whole number is a balance entry, as in FairScale (numpy's, e.g. from an array, and 2.0)
    np = pytest.importorskip("numpy")
    assert Pipe(mlp(), np.array([3, 6]), devices=["cpu", "cpu"]).balance == [3, 6]
    assert Pipe(mlp(), [4.0, 5], devices=["cpu", "cpu"]).balance == [4, 5]
    with pytest.raises(ValueError, match=r"balance must be a list of positive integers \(balance: \[4.5, 4.5\]\)"):
        Pipe(mlp(), [4.5, 4.5], devices=["cpu", "cpu"])
    empty = Pipe(nn.Sequential(), [], devices=[])
    x = torch.randn(2)
    assert empty(x) is x and len(empty) == 0


def test_bad_arguments_raise_fairscales_exception_types():
    model = mlp()  # 9 layers
    with pytest.raises(ValueError, match="module and sum of balance have different length"):
        Pipe(model, [3, 3], devices=["cpu", "cpu"])
    with pytest.raises(ValueError, match="all balance numbers must be positive integer"):
        Pipe(model, [9, 0], devices=["cpu", "cpu"])
    with pytest.raises(IndexError, match="too few devices to hold given partitions"):
        Pipe(model, [3, 3, 3], devices=["cpu", "cpu"])
    with pytest.raises(TypeError, match="module must be nn.Sequential"):
        Pipe(nn.Linear(2, 2), [1], devices=["cpu"])
    with pytest.raises(ValueError, match="balance is required"):
        Pipe(model, devices=["cpu"])
    with pytest.raises(ValueError, match="number of chunks must be positive integer"):
        Pipe(model, [9], devices=["cpu"], chunks=0)
    with pytest.raises(ValueError, match="checkpoint is not one of"):
        Pipe(model, [9], devices=["cpu"], checkpoint="sometimes")
    # FairScale's types where its own code fails (not iterable, int(), torch.device), the argument named
    with pytest.raises(TypeError, match="argument 'balance': expected a sequence of positive ints, got int"):
        Pipe(model, 9, devices=["cpu"])
    with pytest.raises(TypeError, match="argument 'devices': expected a sequence of devices"):
        Pipe(model, [9], devices="cpu")
    with pytest.raises(RuntimeError, match="argument 'devices': 'bogus' is not a device"):
        Pipe(model, [9], devices=["bogus"])
    with pytest.raises(TypeError, match="argument 'chunks': expected a positive int, got None"):
        Pipe(model, [9], devices=["cpu"], chunks=None)
    with pytest.raises(ValueError, match="argument 'chunks': expected a positive int, got 'many'"):
        Pipe(model, [9], devices=["cpu"], chunks="many")
    with pytest.raises(TypeError, match="argument 'balance': expected a sequence of positive ints, got '4'"):
        Pipe(model, ["4", "5"], devices=["cpu", "cpu"])
    # what int() would truncate or read is refused (FairScale takes 2.5 as 2, "2" as 2, True as 1)
    for value, exc in ((2.5, ValueError), ("2", ValueError), (True, TypeError), (torch.tensor(2.5), TypeError)):
        with pytest.raises(exc, match=f"argument 'chunks': expected a positive int, got {value!r}"[:40]):
            Pipe(model, [9], devices=["cpu"], chunks=value)
    with pytest.raises(ValueError, match=r"checkpoint is not one of .* \(got None\)"):
        Pipe(model, [9], devices=["cpu"], checkpoint=None)
    for value in (3.0, torch.tensor(3)):
        assert Pipe(mlp(), [9], devices=["cpu"], chunks=value).chunks == 3

    class Named:  # FairScale takes str(checkpoint)
        def __str__(self):
            return "always"

    assert Pipe(mlp(), [9], devices=["cpu"], checkpoint=Named()).checkpoint == "always"
    pipe = Pipe(model, [4, 5], devices=["cpu", "cpu"])
    with pytest.raises(TypeError, match="expected Tensor, but got list"):
        pipe([torch.randn(2, 8)])
    with pytest.raises(TypeError, match="expected Tensor, but got str"):
        pipe((torch.randn(2, 8), "x"))
    with pytest.raises(ValueError, match=r"same size in dimension 0 .*\(sizes \[8, 6\]\)"):
        Pipe(nn.Sequential(nn.Identity()), [1], devices=["cpu"], chunks=2)((torch.randn(8, 8), torch.randn(6, 8)))

    class ReturnsList(nn.Module):
        def forward(self, x):
            return [x]

    bad = Pipe(nn.Sequential(ReturnsList(), nn.Identity()), [1, 1], devices=["cpu", "cpu"])
    with pytest.raises(TypeError, match="output of partition 0"):
        bad(torch.randn(2, 2))


def test_worker_threads_end_with_the_pipe():
    before = set(threading.enumerate())
    pipe = Pipe(mlp(), [4, 5], devices=["cpu", "cpu"], chunks=2)
    pipe(torch.randn(4, 8)).sum().backward()
    threads = [t for t in threading.enumerate() if t.name.startswith("fsc-pipe-") and t not in before]
    assert len(threads) == 2
    del pipe
    gc.collect()
    for t in threads:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in threads)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("devices", [["cuda:0", "cuda:0"], ["cpu", "cuda:0"], ["cuda:0", "cpu"]])
@pytest.mark.parametrize("mode", MODES)
def test_cuda_matches_sequential(devices, mode):
    ref = mlp()
    pipe = Pipe(mlp(), [4, 5], devices=devices, chunks=4, checkpoint=mode)
    assert_same_training(ref, pipe, torch.randn(10, 8))


@pytest.mark.gpu
@cuda
def test_cuda_skips_and_dropout_replay():
    ref = skip_model()
    pipe = Pipe(skip_model(), [2, 4, 2], devices=["cuda:0", "cpu", "cuda:0"], chunks=3)
    assert_same_training(ref, pipe, torch.randn(9, 8))
    pipe = Pipe(nn.Sequential(nn.Dropout(0.5), nn.Dropout(0.5)), [1, 1], devices=["cuda:0"] * 2, chunks=4)
    x = (torch.rand(16, 32, device="cuda") + 0.5).requires_grad_()
    y = pipe(x)
    y.sum().backward()
    torch.testing.assert_close(x.grad, y.detach() / x.detach())


@pytest.mark.parametrize("chunks", [1, 3])
def test_thread_sharing_off_matches_sequential(chunks):
    # Partitions that share no threads (as CUDA partitions) are counted the same way.
    model = mlp()
    pipe = Pipe(copy.deepcopy(model), [4, 5], devices=["cpu", "cpu"], chunks=chunks)
    pipe._pipeline.share_threads = False
    x = torch.randn(6, 8)
    pipe(x).square().sum().backward()
    model(x).square().sum().backward()
    for got, want in zip(pipe.parameters(), model.parameters()):
        torch.testing.assert_close(got.grad, want.grad)


@pytest.mark.parametrize("mode", MODES)
def test_one_micro_batch_on_cpu_is_one_autograd_graph(mode):
    model = mlp()
    pipe = Pipe(copy.deepcopy(model), [4, 5], devices=["cpu", "cpu"], chunks=1, checkpoint=mode)
    x = torch.randn(4, 8, requires_grad=True)
    y = pipe(x)
    if mode == "always":  # checkpointed: the pipeline's node, recomputing in its backward
        assert type(y.grad_fn).__name__ == "PipeFunctionBackward"
        return
    # Not checkpointed: the layers' own graph, so torch.autograd.grad reaches the parameters
    # (FairScale's Pipe allows that too without checkpointing).
    assert type(y.grad_fn).__name__ != "PipeFunctionBackward"
    grads = torch.autograd.grad(y.square().sum(), [x, *pipe.parameters()])
    x2 = x.detach().clone().requires_grad_()
    expected = torch.autograd.grad(model(x2).square().sum(), [x2, *model.parameters()])
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want)


def test_second_backward_is_a_clear_error():
    pipe = Pipe(mlp(), [4, 5], devices=["cpu", "cpu"], chunks=2)
    y = pipe(torch.randn(4, 8))
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="once per forward"):
        y.sum().backward()
    x = torch.randn(4, 8, requires_grad=True)
    with pytest.raises(RuntimeError, match="create_graph=True .* is not supported"):
        torch.autograd.grad(pipe(x).sum(), x, create_graph=True)


@pytest.mark.parametrize("chunks", [1, 3])
def test_callers_autocast_applies_in_partitions(chunks):
    ref, pipe = mlp(), Pipe(mlp(), [4, 5], devices=["cpu", "cpu"], chunks=chunks, checkpoint="always")
    x = torch.randn(6, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ya, yb = ref(x), pipe(x)
    assert yb.dtype == ya.dtype == torch.bfloat16
    torch.testing.assert_close(yb, ya)
    yb.float().sum().backward()  # recomputation runs under the same autocast state
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in pipe.parameters())


@pytest.mark.parametrize("chunks", [1, 4])
def test_weights_shared_by_two_partitions_on_one_device(chunks):
    def build():
        torch.manual_seed(0)
        a, b = nn.Linear(8, 8), nn.Linear(8, 8)
        b.weight = a.weight  # tied across the partition boundary
        return nn.Sequential(a, nn.Tanh(), b, nn.Tanh(), nn.Linear(8, 4))

    ref, pipe = build(), Pipe(build(), [2, 3], devices=["cpu", "cpu"], chunks=chunks, checkpoint="except_last")
    assert_same_training(ref, pipe, torch.randn(8, 8))
    with pytest.raises(ValueError, match="module with duplicate children"):
        layer = nn.Linear(2, 2)
        Pipe(nn.Sequential(layer, layer), [1, 1], devices=["cpu", "cpu"])


@pytest.mark.skipif(not hasattr(__import__("os"), "fork"), reason="needs os.fork")
def test_a_forked_child_gets_its_own_worker_threads():
    import os

    pipe = Pipe(mlp(), [4, 5], devices=["cpu", "cpu"], chunks=2)
    pipe(torch.randn(4, 8))  # threads started in the parent
    pid = os.fork()
    if pid == 0:  # the child: the parent's worker threads do not exist here
        code = 1
        try:
            with torch.no_grad():
                code = 0 if pipe(torch.randn(4, 8)).shape == (4, 4) else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    pytest.fail("the forked child's Pipe did not finish")
