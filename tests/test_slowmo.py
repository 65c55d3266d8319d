"""fairscale_c.experimental.nn.data_parallel.SlowMoDistributedDataParallel against plain torch.

Each rank trains on its slice of a batch; the parameters after every step must equal what
single-process torch computes on the same data through identities that hold for the algorithm
(FairScale's own test settings, on CPU ranks here):
- LocalSGD averaging every step is SGD on the whole batch; with slow momentum every step (base
  lr 1) it is SGD with momentum; every f steps it is SGD plus a momentum step on the f-step
  displacement.
- LocalSGD every 2 steps: each rank's SGD, averaged (by torch.distributed) every second step.
- SGP at world 2 averages the pair; at world 3 over a ring with 2 peers it averages all three;
  at world 4 it averages with the iteration's in-peer (1, then 2 ranks back); with a peer reached
  by two edges (world 2, 2 peers per iteration) it keeps 1/3 of its own and 2/3 of the other's.
- Two processes per node average their gradients every step.
Also: buffers broadcast from rank 0, SGP's state dict (also nested), float16 parameters with a
float32 master copy (error feedback), a dead peer, one process without torch.distributed, the
peer graphs against FairScale's (where FairScale is importable), and bad input."""

import copy
import os
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dist_utils import clean_dev_shm, join_gloo, run_ranks  # noqa: F401 (fixture)

pytestmark = pytest.mark.usefixtures("clean_dev_shm")

LOCAL_BATCH = 2
TOL = dict(rtol=1e-5, atol=1e-6)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(2, 10, bias=False)
        self.fc2 = nn.Linear(10, 50, bias=False)
        self.fc3 = nn.Linear(50, 4, bias=False)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return F.softmax(self.fc3(x), dim=1)


def _data(world):
    g = torch.Generator().manual_seed(7)
    return torch.randn(world * LOCAL_BATCH, 2, generator=g), torch.randn(world * LOCAL_BATCH, 4, generator=g)


def _step(model, x, y):
    model.train()
    F.mse_loss(model(x), y).backward()


def _update(opt):
    opt.step()
    opt.zero_grad()


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _reference(world, steps, lr_mom=None, slowmo=None):
    """Parameters after each step of single-process torch on the whole batch (shuffled as the ranks'
    batches are). lr_mom: (lr, momentum) of the SGD; slowmo: (frequency, slowmo_lr, momentum), a
    momentum step on the displacement every `frequency` steps."""
    torch.manual_seed(0)
    model = Net()
    x, y = _data(world)
    lr, mom = lr_mom or (1.0, 0.0)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=mom)
    slow = old = None
    if slowmo is not None:
        slow = torch.optim.SGD(model.parameters(), lr=slowmo[1], momentum=slowmo[2])
        old = _params(model)
    out = []
    for it in range(steps):
        _step(model, x, y)
        _update(opt)
        if slowmo is not None and (it + 1) % slowmo[0] == 0:
            for p, o in zip(model.parameters(), old):
                p.grad = -(p.detach() - o)
                with torch.no_grad():
                    p.copy_(o)
            _update(slow)
            old = _params(model)
        out.append(_params(model))
        torch.manual_seed(1337 + it)
        perm = torch.randperm(world * LOCAL_BATCH)
        x, y = x[perm], y[perm]
    return out


def _slowmo_run(rank, world, settings, steps, device="cpu", move=False, init_first=True):
    """Parameters after each step of the SlowMo model trained on this rank's slice. The wrapper
    keeps the parameters in one buffer per dtype (a shared tensor on CPU ranks); `move` gives them
    storage of their own again after wrapping, as a cast or a move would. `init_first`: make the
    slow momentum's state before training (FairScale's tests do); else the first perform_slowmo
    makes it, as in the documented loop."""
    import fairscale_c.distributed as fdist
    from fairscale_c.experimental.nn.data_parallel import SlowMoDistributedDataParallel

    torch.manual_seed(0)
    model = SlowMoDistributedDataParallel(Net().to(device), **settings)
    (flat,) = model._flats
    assert all(p.untyped_storage().data_ptr() == flat.flat.untyped_storage().data_ptr() for p in model.parameters())
    assert fdist.is_shared(flat.flat) == (device == "cpu" and world > 1)
    if move:
        for p in model.module.parameters():
            p.data = p.data.clone()
    opt = torch.optim.SGD(model.module.parameters(), lr=1, momentum=0)
    if init_first:
        model._init_global_momentum_buffers(opt)
    x, y = _data(world)
    mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    out = []
    for it in range(steps):
        _step(model, x[mine].to(device), y[mine].to(device))
        _update(opt)
        model.perform_slowmo(opt)
        out.append([p.cpu() for p in _params(model.module)])
        torch.manual_seed(1337 + it)
        perm = torch.randperm(world * LOCAL_BATCH)
        x, y = x[perm], y[perm]
    return out


def _compare(name, got, want, failures):
    for it, (g_step, w_step) in enumerate(zip(got, want)):
        for i, (g, w) in enumerate(zip(g_step, w_step)):
            if not torch.allclose(g, w, **TOL):
                failures.append(f"{name}: step {it} param {i}: max diff {(g - w).abs().max().item():.3g}")
                return


# (name, settings, steps, reference kwargs, worlds)
LOCALSGD = "localsgd"
SGP = "sgp"
CASES = [
    ("localsgd every step", dict(slowmo_base_algorithm=LOCALSGD, localsgd_frequency=1, slowmo_momentum=0.0), 3, {}),
    (
        "localsgd + slowmo every step, sharded",
        dict(slowmo_base_algorithm=LOCALSGD, localsgd_frequency=1, slowmo_momentum=0.5, slowmo_frequency=1),
        3,
        dict(lr_mom=(1.0, 0.5)),
    ),
    (
        "localsgd + slowmo every 2 steps, sharded",
        dict(slowmo_base_algorithm=LOCALSGD, localsgd_frequency=1, slowmo_momentum=0.5, slowmo_frequency=2),
        6,
        dict(slowmo=(2, 1.0, 0.5)),
    ),
    (
        "localsgd + slowmo every 2 steps, not sharded",
        dict(
            slowmo_base_algorithm=LOCALSGD,
            localsgd_frequency=1,
            slowmo_momentum=0.5,
            slowmo_frequency=2,
            slowmo_memory_efficient=False,
        ),
        6,
        dict(slowmo=(2, 1.0, 0.5)),
    ),
    (
        "localsgd + slowmo every 2 steps, one shard",
        dict(
            slowmo_base_algorithm=LOCALSGD,
            localsgd_frequency=1,
            slowmo_momentum=0.5,
            slowmo_frequency=2,
            slowmo_num_shards=1,
        ),
        6,
        dict(slowmo=(2, 1.0, 0.5)),
    ),
    (
        "localsgd + slowmo lr 0.7 every 3 steps, 3 shards",
        dict(
            slowmo_base_algorithm=LOCALSGD,
            localsgd_frequency=1,
            slowmo_momentum=0.3,
            slowmo_lr=0.7,
            slowmo_frequency=3,
            slowmo_num_shards=3,
        ),
        6,
        dict(slowmo=(3, 0.7, 0.3)),
    ),
]
SGP_PAIR_CASES = [
    (
        "sgp + slowmo every step",
        dict(slowmo_base_algorithm=SGP, slowmo_momentum=0.5, slowmo_frequency=1, slowmo_memory_efficient=False),
        3,
        dict(lr_mom=(1.0, 0.5)),
    ),
    (
        "sgp + slowmo every 2 steps, sharded",
        dict(slowmo_base_algorithm=SGP, slowmo_momentum=0.5, slowmo_frequency=2),
        6,
        dict(slowmo=(2, 1.0, 0.5)),
    ),
    (
        "sgp + slowmo every 2 steps, not sharded",
        dict(slowmo_base_algorithm=SGP, slowmo_momentum=0.5, slowmo_frequency=2, slowmo_memory_efficient=False),
        6,
        dict(slowmo=(2, 1.0, 0.5)),
    ),
    (
        "push-pull sgp every step",
        dict(slowmo_base_algorithm=SGP, slowmo_momentum=0.0, push_sum=False),
        3,
        {},
    ),
]


def _all_gather(t):
    import torch.distributed as dist

    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def _local_sgd_every_2(rank, world, failures, device="cpu"):
    """LocalSGD every 2 steps (slow momentum off) against each rank's own SGD averaged by torch."""
    import torch.distributed as dist

    torch.manual_seed(0)
    ref = Net()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1, momentum=0)
    x, y = _data(world)
    mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    want = []
    for it in range(6):
        _step(ref, x[mine], y[mine])
        _update(ref_opt)
        if (it + 1) % 2 == 0:
            for p in ref.parameters():
                dist.all_reduce(p.data)
                p.data /= world
        want.append(_params(ref))
        torch.manual_seed(1337 + it)
        perm = torch.randperm(world * LOCAL_BATCH)
        x, y = x[perm], y[perm]
    settings = dict(slowmo_base_algorithm=LOCALSGD, localsgd_frequency=2, slowmo_momentum=0.0, nprocs_per_node=1)
    _compare("localsgd every 2 steps", _slowmo_run(rank, world, settings, 6, device=device), want, failures)


def _sgp_against_gathered(name, rank, world, settings, in_peers, own, failures, device="cpu"):
    """SGP (slow momentum off): after step t each rank's parameters are own * its step result +
    (1 - own) / k * the step results of its k in-peers at step t (`in_peers(t, rank)`)."""

    torch.manual_seed(0)
    x, y = _data(world)
    mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    local = Net()
    opt = torch.optim.SGD(local.parameters(), lr=1, momentum=0)
    got = _slowmo_run(rank, world, dict(settings, nprocs_per_node=1), 4, device=device)
    prev = _params(local)
    for it in range(4):
        with torch.no_grad():
            for p, v in zip(local.parameters(), prev):
                p.copy_(v)
        _step(local, x[mine], y[mine])
        _update(opt)
        results = [_all_gather(p.detach()) for p in local.parameters()]
        peers = in_peers(it, rank)
        want = [own * r[rank] + sum(r[q] for q in peers) * ((1 - own) / len(peers)) for r in results]
        _compare(f"{name} step {it}", [got[it]], [want], failures)
        prev = got[it]
        torch.manual_seed(1337 + it)
        perm = torch.randperm(world * LOCAL_BATCH)
        x, y = x[perm], y[perm]


def _train_job(rank, world, device="cpu"):
    import torch.distributed as dist

    join_gloo(rank, world, device)
    failures = []
    try:
        for name, settings, steps, ref in CASES:
            if name.endswith("3 shards") and world < 3:
                continue
            want = _reference(world, steps, **ref)
            got = _slowmo_run(rank, world, dict(settings, nprocs_per_node=1), steps, device=device)
            _compare(f"{name} (world {world})", got, want, failures)
        _local_sgd_every_2(rank, world, failures, device)
        if world == 2:
            for name, settings, steps, ref in (CASES[2], CASES[3], SGP_PAIR_CASES[1]):
                got = _slowmo_run(rank, world, dict(settings, nprocs_per_node=1), steps, device=device, move=True)
                _compare(f"{name}, parameters moved after wrapping", got, _reference(world, steps, **ref), failures)
            for name, settings, steps, ref in SGP_PAIR_CASES:
                got = _slowmo_run(rank, world, dict(settings, nprocs_per_node=1), steps, device=device)
                _compare(name, got, _reference(world, steps, **ref), failures)
            # the state made by the first perform_slowmo, after a local step: from the parameters
            # of the first forward, the same on every rank
            for name, settings, steps, ref in (CASES[1], CASES[3], SGP_PAIR_CASES[0]):
                got = _slowmo_run(
                    rank, world, dict(settings, nprocs_per_node=1), steps, device=device, init_first=False
                )
                _compare(
                    f"{name}, state made by the first perform_slowmo", got, _reference(world, steps, **ref), failures
                )
            from fairscale_c.experimental.nn.data_parallel.gossip import DynamicDirectedExponentialGraph

            graph = DynamicDirectedExponentialGraph(rank, world, peers_per_itr=2)
            # the other rank is reached by two edges: 1/3 own, 2/3 the other's
            _sgp_against_gathered(
                "sgp, one peer twice", rank, world, dict(slowmo_base_algorithm=SGP, slowmo_momentum=0.0, graph=graph),
                lambda it, r: [1 - r], 1 / 3, failures, device,
            )  # fmt: skip
            # two processes on one node: gradients averaged every step, LocalSGD disabled
            settings = dict(slowmo_base_algorithm=LOCALSGD, localsgd_frequency=100, slowmo_momentum=0.0)
            got = _slowmo_run(rank, world, dict(settings, nprocs_per_node=2), 3, device=device)
            _compare("2 processes, 1 node", got, _reference(world, 3), failures)
        if world == 3:
            from fairscale_c.experimental.nn.data_parallel.gossip import RingGraph

            graph = RingGraph(rank, world, peers_per_itr=2)
            settings = dict(slowmo_base_algorithm=SGP, slowmo_momentum=0.0, graph=graph, nprocs_per_node=1)
            got = _slowmo_run(rank, world, settings, 3, device=device)
            _compare("sgp over a ring, 2 peers (world 3)", got, _reference(world, 3), failures)
        if world == 4:
            _sgp_against_gathered(
                "sgp (world 4)", rank, world, dict(slowmo_base_algorithm=SGP, slowmo_momentum=0.0),
                lambda it, r: [(r - (1 if it % 2 == 0 else 2)) % 4], 0.5, failures, device,
            )  # fmt: skip
            for name, settings, steps, ref in CASES[:3]:
                got = _slowmo_run(rank, world, dict(settings, nprocs_per_node=2), steps, device=device)
                _compare(f"{name} (2 nodes x 2 processes)", got, _reference(world, steps, **ref), failures)
    finally:
        dist.destroy_process_group()
    return failures


@pytest.mark.parametrize("world", [2, 3, 4])
def test_training_equals_single_process_torch(world):
    assert run_ranks(_train_job, world, timeout=400) == [[]] * world


def _features_job(rank, world):
    """Buffers, state dicts and float16 error feedback at world 2."""
    import torch.distributed as dist

    from fairscale_c.experimental.nn.data_parallel import SlowMoDistributedDataParallel as SlowMo

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    failures = []
    try:
        # buffers: rank 0's at every forward (or each rank's own with broadcast_buffers=False)
        for broadcast in (True, False):
            net = nn.BatchNorm1d(3)
            with torch.no_grad():
                net.running_mean.fill_(10.0 + rank)
            model = SlowMo(net, nprocs_per_node=1, broadcast_buffers=broadcast, slowmo_momentum=0.0)
            model.eval()
            out = model(torch.full((2, 3), 10.0))
            expect = 10.0 if broadcast else 10.0 + rank
            if not torch.equal(net.running_mean, torch.full((3,), expect)) or out.abs().max() > 10:
                failures.append(f"broadcast_buffers={broadcast}: running_mean {net.running_mean.tolist()}")
        # a parameter buffer of 1.2 MB: LocalSGD's all-reduce and the sharded slow momentum step's
        # reduce-scatter and all-gather run on the engine's mapped path (each byte copied once)
        big = SlowMo(nn.Linear(600, 500), nprocs_per_node=1, localsgd_frequency=1, slowmo_frequency=2)
        opt = torch.optim.SGD(big.parameters(), lr=0.1)
        shm = big._global_comm._shm
        for expected in (1, 2):  # step 1: the all-reduce; step 2: a reduce-scatter and an all-gather
            before = shm.mapped_ops
            big.perform_slowmo(opt)
            if shm.mapped_ops - before != expected:
                failures.append(f"mapped ops: {shm.mapped_ops - before}, expected {expected}")
        # SGP state dict: ps_weight and the numerator flag travel, also inside a parent module
        model = SlowMo(Net(), nprocs_per_node=1, slowmo_base_algorithm="sgp", slowmo_momentum=0.0)
        parent = nn.Sequential(model)
        state = parent.state_dict()
        if "0.ps_weight" not in state or "0.is_sgp_ps_numerator" not in state:
            failures.append(f"nested state dict keys: {sorted(state)}")
        state["0.ps_weight"] = torch.tensor([0.25])
        state["0.is_sgp_ps_numerator"] = True
        parent.load_state_dict(state)
        if model.ps_weight.item() != 0.25 or model.is_sgp_ps_numerator is not True:
            failures.append(f"load: ps_weight {model.ps_weight} numerator {model.is_sgp_ps_numerator}")
        top = model.state_dict()
        if not torch.equal(top["ps_weight"], torch.tensor([0.25])) or top["is_sgp_ps_numerator"] is not True:
            failures.append("state_dict after load")
        missing = dict(top)
        del missing["ps_weight"]
        try:
            model.load_state_dict(missing)
            failures.append("a state dict without ps_weight loaded under strict=True")
        except RuntimeError as exc:
            if "ps_weight" not in str(exc):
                failures.append(f"missing ps_weight: {exc}")
        # float16 parameters with a float32 master copy: the averaging's rounding goes to the copy
        torch.manual_seed(0)
        net = Net().half()
        model = SlowMo(net, nprocs_per_node=1, localsgd_frequency=1, slowmo_momentum=0.0)
        master = torch.cat([p.detach().float().reshape(-1) for p in net.parameters()])
        master += 1e-3 * torch.randn(master.shape, generator=torch.Generator().manual_seed(rank))  # differ per rank
        with torch.no_grad():
            offset = 0
            for p in net.parameters():
                p.copy_(master[offset : offset + p.numel()].view_as(p))
                offset += p.numel()
        opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1)
        p16 = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        lost = (p16 / world) * world  # what is left of p16 after the division the average makes
        average = sum(_all_gather(lost / world))
        expect = master - lost.float() + average.float()
        model.perform_slowmo(opt, fp32_params=master)
        after16 = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
        if not torch.equal(master, expect):
            failures.append(f"fp32 master: max diff {(master - expect).abs().max().item():.3g}")
        if not torch.equal(after16, master.half()):
            failures.append("float16 parameters are not the master copy rounded")
    finally:
        dist.destroy_process_group()
    return failures


def test_buffers_state_dict_and_float16_error_feedback():
    assert run_ranks(_features_job, 2, timeout=200) == [[]] * 2


def _dead_peer_job(rank, world):
    import torch.distributed as dist

    import fairscale_c
    from fairscale_c.experimental.nn.data_parallel import SlowMoDistributedDataParallel as SlowMo

    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = SlowMo(Net(), nprocs_per_node=1, localsgd_frequency=1, slowmo_momentum=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, *(t[:LOCAL_BATCH] for t in _data(world)))
    model.perform_slowmo(opt)  # everyone alive: one round completes
    if rank == 1:
        os._exit(1)
    start = time.perf_counter()
    try:
        model.perform_slowmo(opt)
    except fairscale_c.DistributedError as exc:
        assert "rank 1" in str(exc), str(exc)
        return time.perf_counter() - start
    raise AssertionError("no DistributedError raised")


@pytest.mark.serial  # kills a rank; times how soon the peer knows
def test_dead_peer_is_reported():
    elapsed, _ = run_ranks(_dead_peer_job, 2, env={"FAIRSCALE_C_TIMEOUT": "30"}, may_die=[1])
    assert elapsed < 10, f"dead peer found after {elapsed:.1f} s; expected well before the 30 s timeout"


def test_single_process_trains_like_the_plain_module():
    from fairscale_c.experimental.nn.data_parallel import SlowMoDistributedDataParallel as SlowMo

    torch.manual_seed(0)
    plain = Net()
    model = SlowMo(
        copy.deepcopy(plain), nprocs_per_node=1, process_rank=0, process_world_size=1, slowmo_frequency=2
    )  # slow momentum on (0.5) over one process
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (plain, model.module)]
    slow = torch.optim.SGD(plain.parameters(), lr=0.5, momentum=0.5)  # slowmo_lr 1 x the base lr
    old = _params(plain)  # the slow start: the parameters of the first forward
    x, y = _data(1)
    for it in range(4):
        for m, opt in zip((plain, model), opts):
            _step(m, x, y)
            _update(opt)
        model.perform_slowmo(opts[1])
        if (it + 1) % 2 == 0:  # the slow momentum step on the displacement, in units of the base lr
            for p, o in zip(plain.parameters(), old):
                p.grad = -(p.detach() - o) / 0.5
                with torch.no_grad():
                    p.copy_(o)
            _update(slow)
            old = _params(plain)
        for a, b in zip(plain.parameters(), model.module.parameters()):
            assert torch.allclose(a, b, **TOL), (it, (a - b).abs().max())


def test_bad_arguments_are_named():
    from fairscale_c.experimental.nn.data_parallel import SlowMoDistributedDataParallel as SlowMo

    one = dict(process_rank=0, process_world_size=1)
    cases = [
        (lambda: SlowMo("net", 1, **one), TypeError, "'module'"),
        (lambda: SlowMo(nn.ReLU(), 1, **one), ValueError, "no parameters"),
        (lambda: SlowMo(Net(), 0, **one), ValueError, "'nprocs_per_node'"),
        (lambda: SlowMo(Net(), 1, slowmo_base_algorithm="adam", **one), ValueError, "'slowmo_base_algorithm'"),
        (lambda: SlowMo(Net(), 1, overlap=True, **one), ValueError, "'overlap'"),
        (lambda: SlowMo(Net(), 1, slowmo_frequency=0, **one), ValueError, "'slowmo_frequency'"),
        (lambda: SlowMo(Net(), 1, localsgd_frequency=1.5, **one), ValueError, "'localsgd_frequency'"),
        (lambda: SlowMo(Net(), 1, process_rank=1, process_world_size=1), ValueError, "'process_rank'"),
        (lambda: SlowMo(Net(), 1, process_rank=0, process_world_size=2), RuntimeError, "not initialised"),
        (lambda: SlowMo(Net(), 1), RuntimeError, "not initialised"),
    ]
    for make, exc, words in cases:
        with pytest.raises(exc, match=words):
            make()
    model = SlowMo(Net().half(), 1, slowmo_frequency=1, **one)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="float32"):
        model.perform_slowmo(opt)
    with pytest.raises(TypeError, match="'optimizer'"):
        SlowMo(Net(), 1, **one).perform_slowmo(None)


def test_graphs_reject_what_they_cannot_build():
    from fairscale_c.experimental.nn.data_parallel.gossip import DynamicBipartiteLinearGraph, RingGraph

    with pytest.raises(ValueError, match="'world_size'"):
        RingGraph(0, 1)
    with pytest.raises(ValueError, match="'rank'"):
        RingGraph(4, 4)
    with pytest.raises(ValueError, match="'peers_per_itr'"):
        RingGraph(0, 4, peers_per_itr=3)  # a ring has two out-edges per rank
    with pytest.raises(ValueError, match="'peers_per_itr'"):
        DynamicBipartiteLinearGraph(0, 3)  # an odd world leaves a rank without a peer of the other side


GRAPHS = [
    "DynamicDirectedExponentialGraph",
    "NPeerDynamicDirectedExponentialGraph",
    "DynamicBipartiteExponentialGraph",
    "DynamicDirectedLinearGraph",
    "DynamicBipartiteLinearGraph",
    "RingGraph",
]


@pytest.mark.parametrize("name", GRAPHS)
def test_graphs_equal_fairscales(name, monkeypatch):
    """Same phone books and the same peers, iteration after iteration (FairScale's edges build a
    process group each; that is stubbed out here)."""
    fs = pytest.importorskip("fairscale.experimental.nn.data_parallel.gossip.graph_manager")
    if fs.__spec__.name.startswith("fairscale_c"):
        pytest.skip("fairscale is this package's alias here, not FairScale")
    from fairscale_c.experimental.nn.data_parallel.gossip import graph_manager as ours

    class _NoDist:
        @staticmethod
        def new_group(ranks):
            return None

        @staticmethod
        def all_reduce(*args, **kwargs):
            pass

    monkeypatch.setattr(fs, "dist", _NoDist)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    compared = 0
    for world in (2, 4, 5, 8, 9):
        for peers in (1, 2):
            for rank in range(world):
                try:
                    theirs = getattr(fs, name)(rank, world, peers_per_itr=peers)
                    theirs.get_edges()
                except (IndexError, ValueError):
                    with pytest.raises(ValueError):
                        getattr(ours, name)(rank, world, peers_per_itr=peers)
                    continue
                mine = getattr(ours, name)(rank, world, peers_per_itr=peers)
                assert [[e.dest for e in b] for b in mine.phone_book] == [
                    [e.dest for e in b] for b in theirs.phone_book
                ]
                for rotate in (False, True, True, True, False, True):
                    if rotate and not mine.is_dynamic_graph():
                        continue
                    assert mine.get_peers(rotate) == theirs.get_peers(rotate), (world, peers, rank)
                    o, i = mine.get_edges(), theirs.get_edges()
                    assert [(e.src, e.dest) for e in o[0]] == [(e.src, e.dest) for e in i[0]]
                    assert [(e.src, e.dest) for e in o[1]] == [(e.src, e.dest) for e in i[1]]
                compared += 1
    assert compared > 0


def _fairscale_job(rank, world):
    """FairScale's SlowMo and ours side by side on each rank's own slice, slow momentum every 2
    steps (LocalSGD off: FairScale's LocalSGD and SGP call torch.cuda.synchronize, so only its slow
    momentum runs on CPU ranks)."""
    import torch.distributed as dist
    from fairscale.experimental.nn.data_parallel import SlowMoDistributedDataParallel as Theirs

    from fairscale_c.experimental.nn.data_parallel import SlowMoDistributedDataParallel as Ours

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    failures = []
    try:
        for efficient in (True, False):
            settings = dict(
                nprocs_per_node=1,
                localsgd_frequency=100,
                slowmo_frequency=2,
                slowmo_momentum=0.5,
                slowmo_memory_efficient=efficient,
                global_group=dist.group.WORLD,
            )
            torch.manual_seed(0)
            net = Net()
            models = [cls(copy.deepcopy(net), **settings) for cls in (Theirs, Ours)]
            opts = [torch.optim.SGD(m.module.parameters(), lr=0.5) for m in models]
            for m, opt in zip(models, opts):  # the same start for both (docs/experimental.md)
                m._init_global_momentum_buffers(opt)
            x, y = _data(world)
            mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
            for it in range(6):
                for m, opt in zip(models, opts):
                    _step(m, x[mine], y[mine])
                    _update(opt)
                    m.perform_slowmo(opt)
                for a, b in zip(*(m.module.parameters() for m in models)):
                    same = torch.equal(a, b) if world == 2 else torch.allclose(a, b, **TOL)
                    if not same:
                        failures.append(f"efficient={efficient} step {it}: max diff {(a - b).abs().max().item():.3g}")
                        break
    finally:
        dist.destroy_process_group()
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_slow_momentum_equals_fairscales(world):
    """Bit for bit at world 2 (the reductions add two numbers), to rounding at world 3."""
    fs = pytest.importorskip("fairscale.experimental.nn.data_parallel")
    if fs.__spec__.name.startswith("fairscale_c"):
        pytest.skip("fairscale is this package's alias here, not FairScale")
    assert run_ranks(_fairscale_job, world, timeout=200) == [[]] * world


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_training_on_cuda_ranks_equals_single_process_torch():
    from test_cuda import _nccl_devices

    _, nccl_env = _nccl_devices()
    assert run_ranks(_train_job, 2, "cuda", env=nccl_env, timeout=300) == [[]] * 2


def test_helpers_and_timers():
    import functools

    from fairscale_c.experimental.nn.data_parallel.gossip import CudaEventRecorder, communicate
    from fairscale_c.experimental.nn.data_parallel.gossip.utils import (
        flatten_tensors,
        group_by_dtype,
        unflatten_tensors,
    )

    ts = [torch.arange(6.0).view(2, 3), torch.tensor([7], dtype=torch.int64), torch.tensor([8.0, 9.0])]
    groups = group_by_dtype(ts)
    assert list(groups) == [torch.float32, torch.int64] and len(groups[torch.float32]) == 2
    flat = flatten_tensors(groups[torch.float32])
    assert flat.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 8.0, 9.0]
    views = unflatten_tensors(flat, groups[torch.float32])
    assert [v.shape for v in views] == [(2, 3), (2,)] and views[1].data_ptr() == flat[6:].data_ptr()
    with pytest.raises(ValueError, match="'flat'"):
        unflatten_tensors(flat[:3], groups[torch.float32])

    def double(tensor, calls):
        calls.append(tensor.dtype)
        tensor.mul_(2)

    calls = []
    communicate(ts, functools.partial(double, calls=calls))  # one call per dtype, copied back
    assert calls == [torch.float32, torch.int64]
    assert ts[0].tolist() == [[0, 2, 4], [6, 8, 10]] and ts[1].item() == 14 and ts[2].tolist() == [16, 18]

    CudaEventRecorder.reset()
    for _ in range(3):
        rec = CudaEventRecorder("section")
        time.sleep(0.002)
        rec.stop()
    report = CudaEventRecorder.get_timings()
    assert "section: Time taken: avg: " in report and "count: 3" in report
    avg = float(report.split("avg: ")[1].split(",")[0])
    assert 1.5 < avg < 500, report  # milliseconds
    with pytest.raises(RuntimeError, match="stop"):
        CudaEventRecorder("unfinished").find_time_elapsed()
    CudaEventRecorder.reset()
