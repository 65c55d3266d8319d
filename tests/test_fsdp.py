"""FullyShardedDataParallel against single-process PyTorch, at world sizes 1, 2 and 4 (CPU)."""

import os
import tempfile

import pytest
import torch.multiprocessing as mp

import fsdp_scenarios


def spawn(world, names, fn=fsdp_scenarios.worker, extra=()):
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(fn, args=(world, init_file, names, tmp) + tuple(extra), nprocs=world, join=True)
        failures = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.txt")) as f:
                text = f.read()
            if text:
                failures.append(text)
    assert not failures, "\n\n".join(failures)


ALL = sorted(fsdp_scenarios.NUMERICS)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fsdp_matches_pytorch(world):
    spawn(world, ALL)


@pytest.fixture(scope="module")
def world2_checkpoint(tmp_path_factory):
    """The files of state_save at world 2 (full, local shards + metadata, optimizer), made once;
    the same job checks the state methods' bad-input errors (state_errors)."""
    ckpt = str(tmp_path_factory.mktemp("world2"))
    spawn(2, ["state_save", "state_errors"], extra=(ckpt,))
    return ckpt


def test_checkpoints_across_world_sizes(world2_checkpoint):
    """Full state saved at world 2 loads at 1 and 4 with identical outputs; local shards consolidate;
    optimizer state gathers and shards back; a local state refuses another world size."""
    import torch

    from fairscale_c.nn import FullyShardedDataParallel as FSDP

    ckpt = world2_checkpoint
    for world in (1, 4):
        spawn(world, ["state_load"], extra=(ckpt,))
    shards = [torch.load(os.path.join(ckpt, f"rank{r}_local.pt")) for r in range(2)]
    merged = FSDP.consolidate_shard_weights([s["weights"] for s in shards], [s["metadata"] for s in shards])
    full = torch.load(os.path.join(ckpt, "full.pt"))
    assert set(merged) == set(full)
    for k in full:
        torch.testing.assert_close(merged[k], full[k], atol=0, rtol=0)
    assert merged["head.weight"] is merged["embed.weight"]  # shared parameter restored
    osd = torch.load(os.path.join(ckpt, "optim_full.pt"))
    names = [n for n in merged if n != "head.weight"]
    assert len(osd["state"]) == len(names) and all("exp_avg" in s for s in osd["state"].values())


def test_consolidation_orders_shards_by_rank_and_refuses_bad_sets(world2_checkpoint):
    """Worker files listed out of order (an unsorted glob: worker1 before worker0) consolidate to
    the same weights, not permuted ones; a set with a missing, duplicate or out-of-range rank,
    mixed world sizes or metadata whose names and numels disagree is a ValueError."""
    import copy

    import torch

    from fairscale_c.nn import FullyShardedDataParallel as FSDP

    ckpt = world2_checkpoint
    shards = [torch.load(os.path.join(ckpt, f"rank{r}_local.pt")) for r in range(2)]
    full = torch.load(os.path.join(ckpt, "full.pt"))
    weights, metas = [s["weights"] for s in shards], [s["metadata"] for s in shards]
    assert [m["rank"] for m in metas] == [0, 1] and all(m["world_size"] == 2 for m in metas)
    merged = FSDP.consolidate_shard_weights(weights[::-1], metas[::-1])
    for k in full:
        torch.testing.assert_close(merged[k], full[k], atol=0, rtol=0, msg=k)

    def edited(i, **changes):
        m = copy.deepcopy(metas)
        m[i].update(changes)
        return m

    cases = [
        ([weights[0], weights[0]], [metas[0], metas[0]], r"rank\(s\) \[0\] appear more than once.*\[1\] are missing"),
        ([weights[0]], [metas[0]], r"rank\(s\) \[1\] are missing"),
        (weights, edited(1, rank=2), "rank 2; expected 0 <= rank < world_size"),
        (weights, edited(1, world_size=4), r"different world sizes \[2, 4\]"),
        (weights, [metas[0], {k: v for k, v in metas[1].items() if k != "rank"}], "carry no 'rank'"),
    ]
    short = copy.deepcopy(metas)
    for m in short:
        info = m["param_metadata"][0]["params"]["flat_param_0"]
        info["names"] = info["names"][:-1]  # one name fewer than numels: a parameter would be dropped
    cases.append((weights, short, "names, .* shapes and .* numels; expected one of each"))
    foreign = copy.deepcopy(metas)
    foreign[1]["param_metadata"][0]["params"]["flat_param_0"]["numels"][0] += 1
    cases.append((weights, foreign, "shard 1 describes other parameters than shard 0"))
    for w, m, match in cases:
        with pytest.raises(ValueError, match=match):
            FSDP.consolidate_shard_weights(w, m)


def test_consolidation_with_missing_keys_strict_or_not_and_bad_padding(world2_checkpoint):
    """A shard missing a flat parameter is a KeyError naming the shard and the key (strict or
    not, when shard 0 has it); strict=False skips a flat parameter or buffer missing from every
    shard, and the tied names that alias a skipped parameter;
    padding that leaves the wrong number of elements is a ValueError."""
    import copy

    import torch

    from fairscale_c.nn import FullyShardedDataParallel as FSDP

    shards = [torch.load(os.path.join(world2_checkpoint, f"rank{r}_local.pt")) for r in range(2)]
    weights, metas = [s["weights"] for s in shards], [s["metadata"] for s in shards]
    full = FSDP.consolidate_shard_weights(weights, metas)
    meta0 = metas[0]["param_metadata"][0]
    key = f"{meta0['fsdp_path']}.flat_param_0" if meta0["fsdp_path"] else "flat_param_0"
    names = meta0["params"]["flat_param_0"]["names"]
    assert key in weights[0] and key in weights[1]

    def without(i, k):
        w = [dict(x) for x in weights]
        for j in [i] if i is not None else range(len(w)):
            del w[j][k]
        return w

    for strict in (True, False):
        with pytest.raises(KeyError, match=f"shard 1 has no '{key}'"):
            FSDP.consolidate_shard_weights(without(1, key), metas, strict=strict)
    with pytest.raises(KeyError, match=f"shard 0 has no '{key}'"):
        FSDP.consolidate_shard_weights(without(None, key), metas)
    partial = FSDP.consolidate_shard_weights(without(None, key), metas, strict=False)
    prefix = f"{meta0['fsdp_path']}." if meta0["fsdp_path"] else ""
    assert not any(prefix + n in partial for n in names) and set(partial) < set(full)
    shared = meta0["shared_param_info"]  # the tied head: an alias of a skipped parameter is skipped too
    assert shared and not any(prefix + dst in partial for _, dst in shared)
    buffers = metas[0]["buffer_names"]
    if buffers:
        assert buffers[0] in FSDP.consolidate_shard_weights(weights, metas)
        got = FSDP.consolidate_shard_weights(without(0, buffers[0]), metas, strict=False)
        assert buffers[0] not in got
    no_buffers = FSDP.consolidate_shard_weights(weights, metas, with_module_buffers=False)
    assert not any(b in no_buffers for b in buffers)
    padded = copy.deepcopy(metas)
    for m in padded:  # both shards alike, so the layouts agree; one element too many cut off
        m["param_metadata"][0]["params"]["flat_param_0"]["padding"] += 1
    with pytest.raises(ValueError, match="elements after unpadding, metadata says"):
        FSDP.consolidate_shard_weights(weights, padded)


def test_tango_style_engine_resumes_exactly(tmp_path):
    """A Tango-style training engine (pattern-wrapped blocks, micro-batches, autocast, clip, AdamW
    over the flat shards, per-worker local checkpoints written atomically): resuming from the
    checkpoint gives bit-identical weights, and the worker files consolidate into the plain model."""
    spawn(2, ["tango_engine"], extra=(str(tmp_path),))


@pytest.mark.parametrize("world", [1, 2])
def test_cpu_shards_are_shared_tensors(world):
    spawn(world, ["shards_shared"])


def test_dataloader_workers_forked_from_a_training_rank():
    spawn(2, ["dataloader_fork_workers"])


def test_outputs_of_any_type_train():
    spawn(2, ["outputs_of_any_type"])


def test_no_sync_gradients_are_on_the_parameters():
    spawn(2, ["no_sync_grads_on_params"])


@pytest.mark.parametrize("world", [1, 2])
def test_a_backward_that_raises_leaves_no_gradient(world):
    spawn(world, ["backward_that_raises"])


@pytest.mark.parametrize("world", [1, 2])
def test_a_gradient_penalty_trains(world):
    spawn(world, ["gradient_penalty"])


@pytest.mark.parametrize("world", [1, 2])
def test_a_gradient_inside_forward_with_a_penalty_on_the_parameters(world):
    spawn(world, ["gradient_inside_forward"])


def test_a_refusal_found_in_a_later_flat_parameter_leaves_the_module_as_it_was():
    spawn(2, ["later_layout_mismatch"])


def test_a_result_the_parent_reads_from_an_attribute():
    spawn(2, ["result_in_an_attribute"])


@pytest.mark.parametrize("world", [1, 2])
def test_a_forward_between_the_backward_and_the_step(world):
    spawn(world, ["forward_between_backward_and_step"])


def test_clip_grad_norm_of_every_norm_type():
    spawn(2, ["clip_norm_types"])


@pytest.mark.parametrize("world", [1, 2])
def test_full_gradients_do_not_pile_up_in_backward(world):
    spawn(world, ["reduce_scatters_in_flight"])


def test_training_steps_hold_nothing_new():
    spawn(2, ["steady_state"])


@pytest.mark.parametrize("world", [2, 4])
def test_memory_per_rank_is_one_over_world(world):
    spawn(world, ["memory_per_rank"])


def test_launched_by_torchrun():
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = os.path.join(os.path.dirname(__file__), "torchrun_fsdp.py")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={port}",
        script,
    ]
    env = dict(os.environ, FAIRSCALE_C_TIMEOUT="60", OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "rank 0 ok" in r.stdout and "rank 1 ok" in r.stdout


def test_diverging_ranks_raise_instead_of_hanging():
    spawn(2, ["divergent_ranks"])


@pytest.mark.serial  # kills a rank; times how soon the peer knows
def test_dead_peer_is_reported_not_hung():
    from dist_utils import run_ranks, shm_segments

    before = shm_segments()
    results = run_ranks(fsdp_scenarios.dead_peer, 2, may_die=[1], timeout=120)
    message, seconds = results[0]
    assert "rank 1" in message and ("died" in message or "dead" in message or "exited" in message), message
    assert seconds < 10, seconds
    assert shm_segments() <= before


def _reinit_job(rank, world, tmp):
    import torch
    import torch.distributed as dist
    from torch import nn

    from fairscale_c.nn import FullyShardedDataParallel as FSDP

    def held():
        with open("/proc/self/maps") as f:
            maps = sum(1 for line in f if "/dev/shm/fsc-" in line)
        ours = 0  # the engine's progress threads (torch's gloo keeps threads of its own per init)
        for t in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{t}/comm") as f:
                ours += f.read().strip() == "fsc_progress"
        return ours, maps

    counts = []
    for cycle in range(4):
        init = f"file://{os.path.join(tmp, f'init{cycle}')}"
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        model = FSDP(nn.Sequential(FSDP(nn.Linear(8, 8)), nn.Linear(8, 2)))
        model(torch.randn(2, 8)).sum().backward()
        dist.destroy_process_group()
        counts.append(held())
    return counts


def test_reinitialised_process_groups_do_not_pile_up(tmp_path):
    """Four init/train/destroy cycles of torch.distributed in one process: the engine groups of a
    destroyed process group are released when the next one is built, so threads and shared-memory
    mappings stay flat."""
    from dist_utils import run_ranks

    for counts in run_ranks(_reinit_job, 2, str(tmp_path), env={"FAIRSCALE_C_TIMEOUT": "60"}):
        assert counts[-1] == counts[0] and counts[0][0] > 0 and counts[0][1] > 0, counts


# ------------------------------------------------------------------------------------ run_ranks jobs


def _wrap_reduce_scatters(root, calls):
    """Record (input dtype, output dtype) of every reduce-scatter the instances under `root` issue
    (each instance's comm_rs, wrapped once however many instances share it)."""
    from fairscale_c.nn.data_parallel.fully_sharded_data_parallel import get_fsdp_instances

    wrapped = set()
    for inst in get_fsdp_instances(root):
        comm = inst.comm_rs
        if id(comm) in wrapped:
            continue
        wrapped.add(id(comm))
        orig = comm.reduce_scatter

        def reduce_scatter(out, inp, *a, _orig=orig, **k):
            calls.append((inp.dtype, out.dtype))
            return _orig(out, inp, *a, **k)

        comm.reduce_scatter = reduce_scatter


def _padding_job(rank, world):
    """A flat parameter of 5 elements at world 4: shards of 2, rank 2 holds 1 real element and
    rank 3 none."""
    import torch
    import torch.distributed as dist
    from torch import nn

    from fairscale_c.nn import FullyShardedDataParallel as FSDP

    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        plain = nn.Sequential(nn.Linear(4, 1))  # 4 weights + 1 bias
        m = FSDP(nn.Sequential(nn.Linear(4, 1)))
        m.load_state_dict(plain.state_dict())
        shards = [None] * world
        dist.all_gather_object(shards, (m.local_state_dict(), m.local_metadata_dict()))
        merged = FSDP.consolidate_shard_weights([s[0] for s in shards], [s[1] for s in shards])
        full = plain.state_dict()
        assert set(merged) == set(full), (sorted(merged), sorted(full))
        for k, v in full.items():
            torch.testing.assert_close(merged[k], v, atol=0, rtol=0, msg=k)
        return list(m.numel_padded_per_param)
    finally:
        dist.destroy_process_group()


def test_padding_per_rank_at_world_4_matches_fairscale():
    """FairScale pads each rank's shard to the same size: with 5 elements over 4 ranks (shards of
    2) ranks 0 and 1 are full, rank 2 has 1 padding element and rank 3 has 2
    (numel_padded_per_param); the 4 local shards consolidate to the full state dict."""
    from dist_utils import run_ranks

    padded = run_ranks(_padding_job, 4, env={"FAIRSCALE_C_TIMEOUT": "60"}, timeout=120)
    assert padded == [[0], [0], [1], [2]], padded


def _two_level(seed=0):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _wrap_two_level(plain, **kw):
    import copy

    from fairscale_c.nn import FullyShardedDataParallel as FSDP

    model = copy.deepcopy(plain)
    model[2] = FSDP(model[2], **kw)
    return FSDP(model, **kw)


def _rank_input(r):
    import torch

    return torch.randn(4, 6, generator=torch.Generator().manual_seed(50 + r))


def _assert_state_close(model, ref):
    """The FSDP model's full state dict equals the plain reference model's."""
    import torch

    got = model.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, atol=1e-6, rtol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


def _divide_factors_job(rank, world):
    """set_gradient_divide_factors(pre, post, recursive): FairScale divides each rank's gradient
    by `pre` before the sum over ranks and the sum by `post`: grad = sum over ranks / (pre * post).
    One SGD step (lr 1) against plain torch with that gradient."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        plain = _two_level()
        # recursive=False: the root only
        model = _wrap_two_level(plain)
        inner = model.module[2]
        before = (inner.gradient_predivide_factor, inner.gradient_postdivide_factor)
        model.set_gradient_divide_factors(3.0, 5.0, recursive=False)
        assert (model.gradient_predivide_factor, model.gradient_postdivide_factor) == (3.0, 5.0)
        assert (inner.gradient_predivide_factor, inner.gradient_postdivide_factor) == before
        # recursive=True: every instance, and the gradients are divided by pre * post = 4 (not world 2)
        model = _wrap_two_level(plain)
        model.set_gradient_divide_factors(2.0, 2.0, recursive=True)
        inner = model.module[2]
        assert (inner.gradient_predivide_factor, inner.gradient_postdivide_factor) == (2.0, 2.0)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        model(_rank_input(rank)).pow(2).sum().backward()
        opt.step()
        ref = _two_level()
        sum(ref(_rank_input(r)).pow(2).sum() for r in range(world)).backward()
        with torch.no_grad():
            for p in ref.parameters():
                p -= p.grad / 4
        _assert_state_close(model, ref)
        # in fp16, each rank's 40000 is divided before the sum (80000 would overflow), as FairScale's
        from fairscale_c.nn import FullyShardedDataParallel as FSDP

        lin = torch.nn.Linear(1, 1, bias=False)
        torch.nn.init.ones_(lin.weight)
        model = FSDP(lin, mixed_precision=True, compute_dtype=torch.float16)
        model.set_gradient_divide_factors(2.0, 2.0, recursive=True)
        model(torch.full((1, 1), 40000.0)).sum().backward()
        got = model.params[0].grad.max()
        dist.all_reduce(got, op=dist.ReduceOp.MAX)
        assert got.item() == 20000.0, got
        # a factor below 1 is not applied, as in FairScale (4 x 0.5 is the world size, but the
        # gradient is the sum over ranks / 4, not their mean)
        for pre, post in ((4.0, 0.5), (0.5, 4.0)):
            lin = torch.nn.Linear(1, 1, bias=False)
            torch.nn.init.ones_(lin.weight)
            model = FSDP(lin)
            model.set_gradient_divide_factors(pre, post, recursive=True)
            model(torch.ones(1, 1)).sum().backward()
            got = model.params[0].grad.max()
            dist.all_reduce(got, op=dist.ReduceOp.MAX)
            assert got.item() == 0.5, (pre, post, got)
    finally:
        dist.destroy_process_group()


def test_set_gradient_divide_factors():
    from dist_utils import run_ranks

    run_ranks(_divide_factors_job, 2, env={"FAIRSCALE_C_TIMEOUT": "60"}, timeout=120)


def _fp32_reduce_scatter_job(rank, world):
    """mixed_precision with bfloat16 compute: fp32_reduce_scatter=True reduce-scatters float32
    gradients; False reduce-scatters them in the compute dtype (FairScale's behaviour). The grad
    shards are float32 either way."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        seen = {}
        for fp32_rs in (True, False):
            model = _wrap_two_level(
                _two_level(), mixed_precision=True, compute_dtype=torch.bfloat16, fp32_reduce_scatter=fp32_rs
            )
            model(_rank_input(rank)).float().pow(2).sum().backward()  # lazy init
            model.zero_grad()
            calls = []
            _wrap_reduce_scatters(model, calls)
            model(_rank_input(rank)).float().pow(2).sum().backward()
            assert calls, "no reduce-scatter"
            seen[fp32_rs] = sorted({str(d) for c in calls for d in c})
            assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
        assert seen == {True: ["torch.float32"], False: ["torch.bfloat16"]}, seen
    finally:
        dist.destroy_process_group()


def test_fp32_reduce_scatter_sets_the_reduce_scatter_dtype():
    from dist_utils import run_ranks

    run_ranks(_fp32_reduce_scatter_job, 2, env={"FAIRSCALE_C_TIMEOUT": "60"}, timeout=120)


def _no_sync_nested_job(rank, world):
    """root.no_sync() on nested instances: no reduce-scatter at all inside the context (the inner
    instances' gradients accumulate locally too); the synced backward after it reduces everything,
    and one SGD step equals plain torch on the gradients of both backwards averaged over ranks."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        plain = _two_level(1)
        model = _wrap_two_level(plain)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        model(_rank_input(rank)).pow(2).sum().backward()  # lazy init (not counted)
        opt.zero_grad()
        calls = []
        _wrap_reduce_scatters(model, calls)
        with model.no_sync():
            model(_rank_input(rank)).pow(2).sum().backward()
        assert calls == [], f"{len(calls)} reduce-scatters inside no_sync"
        model(_rank_input(rank + world)).pow(2).sum().backward()
        assert calls, "the synced backward reduced nothing"
        opt.step()
        ref = _two_level(1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        for r in range(world):
            (ref(_rank_input(r)).pow(2).sum() / world).backward()
            (ref(_rank_input(r + world)).pow(2).sum() / world).backward()
        ref_opt.step()
        _assert_state_close(model, ref)
    finally:
        dist.destroy_process_group()


def test_no_sync_on_nested_instances_reduces_nothing():
    from dist_utils import run_ranks

    run_ranks(_no_sync_nested_job, 2, env={"FAIRSCALE_C_TIMEOUT": "60"}, timeout=120)


class _PartlyCheckpointed:
    """A model whose layers `ckpt` run under torch.utils.checkpoint(use_reentrant=True) inside one
    FSDP instance (built lazily: the class needs torch)."""

    @staticmethod
    def build(ckpt, seed=0):
        import torch
        import torch.utils.checkpoint as tck
        from torch import nn

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(4))

            def forward(self, x):
                for i, layer in enumerate(self.layers):
                    x = tck.checkpoint(layer, x, use_reentrant=True) if i in ckpt else layer(x)
                    x = torch.tanh(x)
                return x

        torch.manual_seed(seed)
        return Net()


def _reentrant_job(rank, world, ckpt, flatten, nested):
    import torch
    import torch.distributed as dist

    from fairscale_c.nn import FullyShardedDataParallel as FSDP

    dist.init_process_group("gloo")
    try:
        plain = _PartlyCheckpointed.build(ckpt)
        ref = _PartlyCheckpointed.build(ckpt)
        if nested:  # the checkpoint around a whole nested instance (its input requires grad)
            plain.layers[1] = FSDP(plain.layers[1], flatten_parameters=flatten)
        model = FSDP(plain, flatten_parameters=flatten)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
        for _step in range(2):
            opt.zero_grad()
            model(_rank_input(rank)).pow(2).sum().backward()
            opt.step()
            ref_opt.zero_grad()
            (sum(ref(_rank_input(r)).pow(2).sum() for r in range(world)) / world).backward()
            ref_opt.step()
        _assert_state_close(model, ref)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "ckpt, flatten, nested",
    [((1,), True, False), ((1, 3), False, False), ((0, 2), True, False), ((1,), True, True), ((1,), False, True)],
    ids=str,
)
def test_a_reentrant_checkpoint_inside_an_instance(ckpt, flatten, nested):
    # torch.utils.checkpoint(use_reentrant=True) around some layers of an instance: the recomputed
    # layers' gradient completes in a nested backward of its own, before the rest: both parts are
    # reduced, and the recomputed layers get their gradient, flattened or not.
    from dist_utils import run_ranks

    run_ranks(_reentrant_job, 2, ckpt, flatten, nested, env={"FAIRSCALE_C_TIMEOUT": "60"}, timeout=120)


def _lbfgs_gather_job(rank, world):
    import torch
    import torch.distributed as dist

    from fairscale_c.nn import FullyShardedDataParallel as FSDP

    dist.init_process_group("gloo")
    try:
        model = FSDP(_two_level())
        opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=2)

        def closure():
            opt.zero_grad()
            loss = model(_rank_input(rank)).pow(2).sum()
            loss.backward()
            return loss

        opt.step(closure)
        try:
            model.gather_full_optim_state_dict(opt)
        except ValueError as e:
            return str(e)
        return "gathered"
    finally:
        dist.destroy_process_group()


def test_per_rank_list_state_is_refused_by_the_gather():
    # LBFGS's history lists differ per rank; the format holds one copy, which rank 0's would fill.
    from dist_utils import run_ranks

    for message in run_ranks(_lbfgs_gather_job, 2, env={"FAIRSCALE_C_TIMEOUT": "60"}, timeout=120):
        assert "is a list" in message and "LBFGS" in message, message


def _uncollected_job(rank, world):
    import torch
    import torch.distributed as dist
    from torch import nn

    from fairscale_c.nn import FullyShardedDataParallel as FSDP

    dist.init_process_group("gloo")
    try:
        torch.manual_seed(0)
        expert = FSDP(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), no_broadcast_optim_state=True)
        m = FSDP(nn.Sequential(nn.Linear(4, 4), expert))
        opt = torch.optim.Adam(m.parameters(), lr=0.1)
        m(_rank_input(rank)[:, :4]).sum().backward()
        opt.step()
        full = m.gather_full_optim_state_dict(opt)
        if full is None:
            return None
        ids = [g for g, lid in full["param_id_map"].items() if lid in full["uncollected_local_ids"]]
        return len(ids), len({full["state"][g]["exp_avg"].untyped_storage().data_ptr() for g in ids})
    finally:
        dist.destroy_process_group()


def test_uncollected_optimizer_state_is_not_copied_per_parameter():
    # An instance with no_broadcast_optim_state keeps each rank's shard state as it is: its
    # parameters' entries refer to that state rather than each holding a copy of all of it.
    from dist_utils import run_ranks

    assert run_ranks(_uncollected_job, 2, env={"FAIRSCALE_C_TIMEOUT": "60"}, timeout=120) == [(4, 1), None]
