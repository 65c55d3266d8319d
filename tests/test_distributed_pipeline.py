"""fairscale_c.experimental.nn.distributed_pipeline on CPU RPC workers (FairScale's own tests of
it are gated on CUDA: "CPU tests fail right now"): a pipeline of RemoteModules on 2 workers, in
micro-batches and every checkpoint mode, gives the plain model's output, and one step of
distributed autograd and DistributedOptimizer gives the plain model's parameters; a graph with
two branches and a tuple output, built by hand or traced from a module (make_graph); FairScale's
forward examples; bad input."""

import pytest
import torch
from torch import nn

from dist_utils import clean_dev_shm, join_gloo, run_ranks  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("clean_dev_shm")
TOL = dict(rtol=1e-12, atol=1e-12)


class Split(nn.Module):
    def forward(self, x):
        return x.tanh(), x.sigmoid()


class Merge(nn.Module):
    def forward(self, a, b):
        return a * b


def _fetch_params(remote_modules):
    return [[p.to_here() for p in m.remote_parameters()] for m in remote_modules]


def _sequence_case(failures, chunks, checkpoint, last="worker0/cpu", rows=10):
    """Linear, Tanh on worker0; Linear, ReLU on worker1; the last Linear on `last`: worker1 puts
    the loss on another worker than the one that calls backward. A batch of `rows`."""
    import torch.distributed.autograd as dist_autograd
    from torch.distributed import rpc
    from torch.distributed.nn import RemoteModule
    from torch.distributed.optim import DistributedOptimizer

    from fairscale_c.experimental.nn.distributed_pipeline import (
        DistributedLoss,
        DistributedPipeline,
        PipelineModulesGraph,
    )

    specs = [(nn.Linear, (4, 6)), (nn.Tanh, ()), (nn.Linear, (6, 6)), (nn.ReLU, ()), (nn.Linear, (6, 2))]
    places = ["worker0/cpu", "worker0/cpu", "worker1/cpu", "worker1/cpu", last]
    remote = [RemoteModule(on, cls, args=args, kwargs={"dtype": torch.float64} if cls is nn.Linear else {})
              for (cls, args), on in zip(specs, places)]  # fmt: skip
    graph = PipelineModulesGraph()
    graph.add_sequence(remote, [0])
    pipe = DistributedPipeline(graph, chunks=chunks, checkpoint=checkpoint)
    runs = 3 if last == "worker0/cpu" else 2
    if len(pipe.partitions) != runs:
        failures.append(f"{len(pipe.partitions)} partitions, expected {runs} (one per run of modules on a worker)")
    plain = nn.Sequential(
        *[cls(*args, **({"dtype": torch.float64} if cls is nn.Linear else {})) for cls, args in specs]
    )
    with torch.no_grad():
        for mine, theirs in zip([plain[i] for i in (0, 2, 4)], _fetch_params([remote[i] for i in (0, 2, 4)])):
            for p, q in zip(mine.parameters(), theirs):
                p.copy_(q)
    g = torch.Generator().manual_seed(1)
    x, t = (
        torch.randn(rows, 4, generator=g, dtype=torch.float64),
        torch.randn(rows, 2, generator=g, dtype=torch.float64),
    )
    opt = DistributedOptimizer(torch.optim.SGD, pipe.parameter_rrefs(), lr=0.5)
    # Fetched outside the autograd context: inside it, fetching a value from another worker records
    # a send there that backward then waits to receive a gradient for (torch's distributed autograd)
    if not torch.allclose(pipe(x).to_here(), plain(x), **TOL):
        failures.append(f"chunks {chunks} {checkpoint} last {last}: output differs")
    with dist_autograd.context() as ctx:
        y = pipe(x)
        loss = DistributedLoss(nn.MSELoss)(y, rpc.RRef(t))
        loss.backward(ctx)
        opt.step(ctx)
    nn.MSELoss()(plain(x), t).backward()
    torch.optim.SGD(plain.parameters(), lr=0.5).step()
    for i, params in zip((0, 2, 4), _fetch_params([remote[i] for i in (0, 2, 4)])):
        if not all(torch.allclose(p, q, **TOL) for p, q in zip(params, plain[i].parameters())):
            failures.append(f"chunks {chunks} {checkpoint} last {last}: layer {i} after one step differs")


def _branches_case(failures):
    """Input 0 -> Linear (worker0) -> Split (worker1, two outputs) -> Merge (worker0) of both."""
    import torch.distributed.autograd as dist_autograd
    from torch.distributed.nn import RemoteModule

    from fairscale_c.experimental.nn.distributed_pipeline import DistributedPipeline, PipelineModulesGraph

    lin = RemoteModule("worker0/cpu", nn.Linear, args=(3, 3), kwargs={"dtype": torch.float64})
    split = RemoteModule("worker1/cpu", Split)
    merge = RemoteModule("worker0/cpu", Merge)
    graph = PipelineModulesGraph()
    graph.add_layer(lin, [0])
    graph.add_layer(split, [lin], num_outputs=2)
    graph.add_layer(merge, [(split, 0), (split, 1)])
    pipe = DistributedPipeline(graph, chunks=3, checkpoint="never")
    plain = nn.Linear(3, 3, dtype=torch.float64)
    with torch.no_grad():
        for p, q in zip(plain.parameters(), _fetch_params([lin])[0]):
            p.copy_(q)
    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64, requires_grad=True)
    with dist_autograd.context() as ctx:
        y = pipe(x)
        out = y.to_here()
        want = plain(x).tanh() * plain(x).sigmoid()
        if not torch.allclose(out, want, **TOL):
            failures.append("branches: output differs")
        dist_autograd.backward(ctx, [out.sum()])
        grad_x = dist_autograd.get_gradients(ctx)[x]
    want.sum().backward()
    if not torch.allclose(grad_x, x.grad, **TOL):
        failures.append("branches: input gradient differs")


def _traced_case(failures):
    """make_graph of a module that calls RemoteModules (one with a tuple output) gives the same
    pipeline as the graph built by hand."""
    from torch.distributed.nn import RemoteModule

    from fairscale_c.experimental.nn.distributed_pipeline import DistributedPipeline
    from fairscale_c.experimental.nn.distributed_pipeline.trace import make_graph

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = RemoteModule("worker0/cpu", nn.Linear, args=(3, 3), kwargs={"dtype": torch.float64})
            self.split = RemoteModule("worker1/cpu", Split)
            self.merge = RemoteModule("worker0/cpu", Merge)

        def forward(self, x):
            parts = self.split(self.lin(x))
            return self.merge(parts[0], parts[1])

    net = Net()
    graph = make_graph(net)
    if [n.num_outputs for n in graph.nodes] != [None, 2, None]:
        failures.append(f"traced graph: outputs {[n.num_outputs for n in graph.nodes]}")
    plain = nn.Linear(3, 3, dtype=torch.float64)
    with torch.no_grad():
        for p, q in zip(plain.parameters(), _fetch_params([net.lin])[0]):
            p.copy_(q)
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    y = DistributedPipeline(graph, chunks=2)(x).to_here()
    if not torch.allclose(y, plain(x).tanh() * plain(x).sigmoid(), **TOL):
        failures.append("traced graph: output differs")


def _fairscale_examples(failures):
    """FairScale's own forward checks (its tests forward and forward_chunks)."""
    from torch.distributed.nn import RemoteModule

    from fairscale_c.experimental.nn.distributed_pipeline import DistributedPipeline, PipelineModulesGraph

    for chunks, x, yh in [
        (1, torch.tensor([1.0, -1.0]), torch.tensor([1.0, 0.0])),
        (4, torch.tensor([1.0, -1.0, 2.0, -2.0, 3.0, -3.0, 4.0, -4.0]), torch.tensor([1.0, 0, 2, 0, 3, 0, 4, 0])),
    ]:
        graph = PipelineModulesGraph()
        graph.add_sequence([RemoteModule("worker1/cpu", nn.ReLU)], [0])
        y = DistributedPipeline(graph, chunks=chunks)(x).to_here()
        if not torch.equal(y, yh):
            failures.append(f"FairScale's forward example with {chunks} chunks: {y}")


def _job(rank, world):
    import torch.distributed as dist

    from dist_utils import rpc_workers

    join_gloo(rank, world)
    failures = []
    try:
        with rpc_workers(rank, world):
            if rank == 0:
                for chunks, checkpoint in [(1, "never"), (2, "except_last"), (4, "always"), (3, "except_last")]:
                    _sequence_case(failures, chunks, checkpoint)
                _sequence_case(failures, 2, "except_last", last="worker1/cpu")  # the loss on worker1
                _branches_case(failures)
                _traced_case(failures)
                _fairscale_examples(failures)
    finally:
        dist.destroy_process_group()
    return failures


def test_pipeline_on_two_workers_equals_the_plain_model():
    assert run_ranks(_job, 2, timeout=240) == [[], []]


def _many_forwards_case(failures):
    """40 pipe(x) calls in flight before their outputs are fetched: each output's join waits on
    worker1 (in an RPC thread) for its micro-batches."""
    from torch.distributed.nn import RemoteModule

    from fairscale_c.experimental.nn.distributed_pipeline import DistributedPipeline, PipelineModulesGraph

    lin = RemoteModule("worker0/cpu", nn.Linear, args=(3, 3), kwargs={"dtype": torch.float64})
    relu = RemoteModule("worker1/cpu", nn.ReLU)
    graph = PipelineModulesGraph()
    graph.add_sequence([lin, relu], [0])
    pipe = DistributedPipeline(graph, chunks=1, checkpoint="never")
    plain = nn.Linear(3, 3, dtype=torch.float64)
    with torch.no_grad():
        for p, q in zip(plain.parameters(), _fetch_params([lin])[0]):
            p.copy_(q)
    xs = [torch.randn(2, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(i)) for i in range(40)]
    outs = [pipe(x) for x in xs]
    if not all(torch.allclose(o.to_here(), plain(x).relu(), **TOL) for o, x in zip(outs, xs)):
        failures.append("40 forwards in flight: an output differs")


def _many_chunks_job(rank, world, threads):
    import torch.distributed as dist

    from dist_utils import rpc_workers

    join_gloo(rank, world)
    failures = []
    try:
        with rpc_workers(rank, world, threads=threads):
            if rank == 0:
                # worker0 runs two partitions: 2 x chunks requests that wait for their inputs
                _sequence_case(failures, 32, "except_last", rows=32)
                _many_forwards_case(failures)
    finally:
        dist.destroy_process_group()
    return failures


@pytest.mark.parametrize("threads", [None, 5])
def test_more_micro_batches_than_rpc_threads(threads):
    """More waiting (micro-batch, partition) requests than a worker has RPC threads: each would
    hold a thread while it waits for its inputs, and with every thread held no reply could wake
    them (a hang past the RPC timeout). The pipeline keeps enough threads free; same results."""
    assert run_ranks(_many_chunks_job, 2, threads, timeout=240) == [[], []]


def _few_threads_job(rank, world):
    import torch.distributed as dist
    from torch.distributed.nn import RemoteModule

    from dist_utils import rpc_workers
    from fairscale_c.experimental.nn.distributed_pipeline import DistributedPipeline, PipelineModulesGraph

    join_gloo(rank, world)
    message = ""
    try:
        with rpc_workers(rank, world, threads=4):
            if rank == 0:
                graph = PipelineModulesGraph()
                graph.add_sequence([RemoteModule("worker1/cpu", nn.ReLU)], [0])
                try:
                    DistributedPipeline(graph, chunks=2)
                except ValueError as e:
                    message = str(e)
    finally:
        dist.destroy_process_group()
    return message


def test_too_few_rpc_threads_is_a_value_error():
    message = run_ranks(_few_threads_job, 2, timeout=120)[0]
    assert "worker1 has 4 RPC threads" in message and "num_worker_threads" in message, message


def _bad_input_job(rank, world):
    import torch.distributed as dist
    from torch.distributed.nn import RemoteModule

    from dist_utils import rpc_workers
    from fairscale_c.experimental.nn.distributed_pipeline import (
        DistributedLoss,
        DistributedPipeline,
        PipelineModulesGraph,
    )

    join_gloo(rank, world)
    try:
        with rpc_workers(rank, world):
            graph = PipelineModulesGraph()
            lin = RemoteModule("worker0/cpu", nn.Linear, args=(2, 2))
            graph.add_layer(lin, [0])
            cases = [
                (lambda: DistributedPipeline(graph, chunks=0), ValueError, "chunks"),
                (lambda: DistributedPipeline(graph, checkpoint="sometimes"), ValueError, "checkpoint"),
                (lambda: DistributedPipeline("graph"), TypeError, "'graph'"),
                (lambda: DistributedPipeline(PipelineModulesGraph()), ValueError, "no modules"),
                (lambda: graph.add_layer(nn.Linear(2, 2), [0]), TypeError, "RemoteModule"),
                (lambda: graph.add_layer(lin, ["x"]), TypeError, "an input must be"),
                (lambda: PipelineModulesGraph().add_layer(lin, [lin]), ValueError, "not in the graph"),
                (lambda: DistributedPipeline(graph).cuda(), TypeError, "denied"),
                (lambda: DistributedPipeline(graph).to("cpu"), TypeError, "denied"),
                (lambda: DistributedPipeline(graph)("x"), TypeError, "input 0"),
                (lambda: DistributedLoss(lambda a, b: a), TypeError, "'loss'"),
            ]  # fmt: skip
            for make, exc, words in cases:
                with pytest.raises(exc, match=words):
                    make()
            DistributedPipeline(graph).to(torch.float64)  # a dtype-only move is allowed, as in FairScale
    finally:
        dist.destroy_process_group()
    return []


def test_bad_input():
    assert run_ranks(_bad_input_job, 1, timeout=120) == [[]]
