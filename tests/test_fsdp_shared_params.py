"""Parameters shared (tied) across FSDP instances: FairScale's append_shared_param, siblings and
nested instances, flattened or not, against the same model trained in one process."""

import copy

import pytest
import torch
from torch import nn

from dist_utils import join_gloo, not_close, run_ranks
from fairscale_c.nn.data_parallel import FullyShardedDataParallel as FSDP


class Four(nn.Module):
    """FairScale's shared-weights test model: four Linear(4, 4), l1 and l3 tied by weight or bias."""

    def __init__(self, sharing=None, wrap=False, outer_flat=True, inner_flat=True, call_append=True):
        super().__init__()
        torch.manual_seed(0)
        self.l0, self.l1, self.l2, self.l3 = (nn.Linear(4, 4) for _ in range(4))
        if sharing == "weight":
            self.l1.weight = self.l3.weight
        elif sharing == "bias":
            self.l1.bias = self.l3.bias
        if wrap:
            self.l1 = FSDP(self.l1, flatten_parameters=False)
            self.l2 = FSDP(self.l2, flatten_parameters=inner_flat)
            self.l3 = FSDP(self.l3, flatten_parameters=False)
            if sharing and call_append:
                self.l3.append_shared_param(getattr(self.l1.module, sharing))

    def forward(self, x):
        return self.l3(self.l2(self.l1(self.l0(x))))


class TiedLM(nn.Module):
    """Embedding, two blocks and an output layer tied to the embedding (no bias)."""

    def __init__(self, vocab=11, d=6):
        super().__init__()
        torch.manual_seed(1)
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(nn.Linear(d, d), nn.Tanh(), nn.Linear(d, d))
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.blocks(self.emb(ids)))


def _batch(world):
    g = torch.Generator().manual_seed(7)
    return torch.rand(2 * world, 4, generator=g)


def _train(model, x, steps=3, make_opt=lambda ps: torch.optim.SGD(ps, lr=0.1)):
    """`steps` optimizer steps on a loss that is a mean over the batch (so the ranks' halves
    average to the whole batch's gradient); returns the optimizer."""
    opt = make_opt(model.parameters())
    for _ in range(steps):
        out = model(x)
        (out if out.dim() == 0 else out.square().mean()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return opt


def _compare(got, want, what):
    if list(got) != list(want):
        return f"{what}: keys {list(got)} != {list(want)}"
    for k in want:
        bad = not_close(got[k], want[k], rtol=1e-5, atol=1e-6)
        if bad:
            return f"{what}: {k}: {bad}"
    return ""


def _four_job(rank, world):
    join_gloo(rank, world)
    x = _batch(world)
    rows = slice(2 * rank, 2 * rank + 2)
    failures = []
    for sharing in (None, "weight", "bias"):
        ref = Four(sharing)
        _train(ref, x)
        for outer_flat in (True, False):
            for inner_flat in (True, False):
                for call_append in (True, False) if sharing else (True,):
                    model = FSDP(
                        Four(sharing, True, outer_flat, inner_flat, call_append), flatten_parameters=outer_flat
                    )
                    _train(model, x[rows])
                    case = f"sharing={sharing} outer_flat={outer_flat} inner_flat={inner_flat} append={call_append}"
                    failures.append(_compare(model.state_dict(), ref.state_dict(), case))
                    n_params = len(list(model.parameters()))
                    flattened = int(outer_flat) + int(inner_flat)  # l0's and l2's two parameters become one each
                    if n_params != len(list(ref.parameters())) - flattened:
                        failures.append(f"{case}: {n_params} parameters")
        if sharing:  # tied inside one unflattened instance: both names hold one shard
            model = FSDP(Four(sharing), flatten_parameters=False)
            _train(model, x[rows])
            failures.append(_compare(model.state_dict(), ref.state_dict(), f"sharing={sharing} in one unflattened"))
            if [n for n, _ in model.named_parameters()] != [n for n, _ in ref.named_parameters()]:
                failures.append(f"sharing={sharing} in one unflattened: names {list(model.named_parameters())}")
            meta = model.local_metadata_dict()["param_metadata"][0]
            if meta["shared_param_info"] != [(f"l1.{sharing}", f"l3.{sharing}")]:
                failures.append(f"sharing={sharing} in one unflattened: {meta['shared_param_info']}")
    # an instance over another process group cannot share
    other = torch.distributed.new_group([0, 1])
    m = Four("weight")
    m.l1 = FSDP(m.l1, flatten_parameters=False)
    try:
        FSDP(m.l3, process_group=other, flatten_parameters=False)
        failures.append("a share over another process group was accepted")
    except ValueError as e:
        if "parameter 'weight'" not in str(e) or "same process group" not in str(e):
            failures.append(f"unexpected message: {e}")
        if any(getattr(p, "_fsc_fsdp_managed", False) for p in m.l3.parameters()):  # refused before sharding
            failures.append("the refused instance sharded its module's own parameters")
    return [f for f in failures if f]


def test_fairscale_shared_weight_cases_match_one_process():
    """FairScale's test_shared_weight matrix (tie none / weight / bias, outer and inner flat or
    not), plus each tie without calling append_shared_param and each tie inside one unflattened
    instance: every rank trains on its half of the batch, and the full state after three SGD steps
    equals the one-process model's."""
    for failures in run_ranks(_four_job, 2, timeout=180):
        assert not failures, "\n".join(failures)


def _lm_job(rank, world, layout):
    from fairscale_c.nn.wrap import auto_wrap, enable_wrap

    join_gloo(rank, world)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 11, (2 * world, 5), generator=g)
    rows = slice(2 * rank, 2 * rank + 2)
    ref = TiedLM()
    ref_opt = _train(ref, ids, make_opt=lambda ps: torch.optim.Adam(ps, lr=0.01))
    model = TiedLM()
    if layout == "nested":  # the embedding in an instance of its own, the head in the root
        model.emb = FSDP(model.emb)
        model.blocks = FSDP(model.blocks)
        model = FSDP(model)
    elif layout == "siblings":  # the head alone in an instance: it owns nothing, shares the weight
        model.emb = FSDP(model.emb)
        model.head = FSDP(model.head)
        model = FSDP(model)
    else:  # auto_wrap: the embedding and the blocks' layers wrapped, the head left to the root
        with enable_wrap(wrapper_cls=FSDP):
            model.emb = auto_wrap(model.emb, auto_wrap_policy=lambda *a, **k: True)
            model.blocks = auto_wrap(model.blocks, auto_wrap_policy=_layers_only)
        model = FSDP(model)
    opt = _train(model, ids[rows], make_opt=lambda ps: torch.optim.Adam(ps, lr=0.01))
    failures = [_compare(model.state_dict(), ref.state_dict(), f"{layout} state_dict")]
    sd = model.state_dict()
    if not torch.equal(sd["head.weight"], sd["emb.weight"]):
        failures.append("the tied keys differ")
    # a full state loads into a fresh wrapping and gives the same outputs
    fresh = FSDP(_wrapped_like(layout))
    fresh.load_state_dict(sd)
    with torch.no_grad():
        failures.append(_compare({"out": fresh(ids)}, {"out": ref(ids)}, f"{layout} reloaded output"))
    # local shards consolidate into the full state, the tied key an alias of its source
    local = {k: v.clone() for k, v in model.local_state_dict().items()}
    meta = model.local_metadata_dict()
    # optimizer state: gathered unflattened (the tied weight once), then sharded back
    full_osd = model.gather_full_optim_state_dict(opt)
    objs = [None] * world
    torch.distributed.all_gather_object(objs, (local, meta, full_osd))
    if rank == 0:
        merged = FSDP.consolidate_shard_weights([o[0] for o in objs], [o[1] for o in objs])
        failures.append(_compare(dict(sorted(merged.items())), dict(sorted(ref.state_dict().items())), "consolidated"))
        if merged.get("head.weight") is not merged.get("emb.weight"):
            failures.append("consolidated: head.weight is not emb.weight")
        # global ids follow the instances' flattening order, which the metadata lists
        names = [
            f"{entry['fsdp_path']}.{n}" if entry["fsdp_path"] else n
            for entry in meta["param_metadata"]
            for info in entry["params"].values()
            for n in info["names"]
        ]
        ref_index = {n: i for i, (n, _) in enumerate(ref.named_parameters())}
        ref_state = ref_opt.state_dict()["state"]
        if sorted(full_osd["state"]) != list(range(len(ref_state))) or sorted(names) != sorted(ref_index):
            failures.append(f"optimizer state for {sorted(full_osd['state'])} ({names}), expected {list(ref_index)}")
        else:
            for gid, name in enumerate(names):
                got, want = full_osd["state"][gid], ref_state[ref_index[name]]
                failures.append(_compare({"exp_avg": got["exp_avg"]}, {"exp_avg": want["exp_avg"]}, f"optim {name}"))
    sharded = model.get_shard_from_optim_state_dict(objs[0][2])
    before = {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}
    opt.load_state_dict(sharded)
    for i, s in opt.state_dict()["state"].items():
        failures.append(_compare(s, before[i], f"optimizer shard {i} after the round trip"))
    return [f for f in failures if f]


def _layers_only(module, recurse, unwrapped_params=0, **kwargs):
    return recurse or isinstance(module, nn.Linear)


def _wrapped_like(layout):
    m = TiedLM()
    m.emb = FSDP(m.emb)
    if layout == "siblings":
        m.head = FSDP(m.head)
    else:
        m.blocks = FSDP(m.blocks)
    return m


@pytest.mark.parametrize("layout", ["nested", "siblings", "auto_wrap"])
def test_tied_embedding_across_instances(layout):
    """A language model whose output layer is tied to its embedding, with the embedding wrapped in
    an instance of its own: the head in the root (nested), in an instance of its own (siblings),
    or left to the root by auto_wrap. Adam's three steps, the full and the consolidated state, a
    reload and the optimizer state all equal (or round-trip to) the one-process model's."""
    for failures in run_ranks(_lm_job, 2, layout, timeout=180):
        assert not failures, "\n".join(failures)


def test_one_process_equals_the_plain_model_and_keeps_parameter_order():
    x = _batch(1)
    for sharing in ("weight", "bias"):
        ref = Four(sharing)
        _train(ref, x)
        model = FSDP(Four(sharing, wrap=True, inner_flat=False), flatten_parameters=False)
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
        _train(model, x)
        assert not _compare(model.state_dict(), ref.state_dict(), sharing)
        assert [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
        assert model.l3.params[-1] is model.l1.non_shared_params()[0 if sharing == "weight" else 1]
        assert len(model.l3.non_shared_params()) == 1 and model.l3._has_shared_params


def test_bad_shares_raise_clear_errors():
    model = Four("weight", wrap=True, call_append=False)
    with pytest.raises(ValueError, match="argument 'p' must be a parameter sharded by another"):
        model.l3.append_shared_param(torch.zeros(4, 4))
    with pytest.raises(ValueError, match="argument 'p' is this instance's own parameter"):
        model.l3.append_shared_param(model.l3.module.bias)
    with pytest.raises(ValueError, match="argument 'p' is not a parameter of this instance's module"):
        model.l3.append_shared_param(model.l1.module.bias)
    root = FSDP(model)
    root(torch.rand(1, 4))
    with pytest.raises(RuntimeError, match="before the first forward"):
        model.l3.append_shared_param(model.l1.module.weight)

    # the owner outside the root that runs the sharer
    owner_outside = Four("weight")
    owner = FSDP(owner_outside.l1, flatten_parameters=False)
    sharer_root = FSDP(nn.Sequential(owner_outside.l3))
    with pytest.raises(RuntimeError, match="parameter '0.weight' is shared with an instance that is not under"):
        sharer_root(torch.rand(1, 4))
    assert owner is not None

    # owner and sharer computing in different dtypes
    mixed = Four("weight")
    mixed.l1 = FSDP(mixed.l1, flatten_parameters=False, mixed_precision=True)
    mixed.l3 = FSDP(mixed.l3, flatten_parameters=False)
    with pytest.raises(ValueError, match="'weight' is shared with an instance that computes in torch.float16"):
        FSDP(mixed)(torch.rand(1, 4))


def test_summoned_shared_parameter_is_one_tensor_and_edits_persist():
    model = FSDP(Four("weight", wrap=True), flatten_parameters=False)
    with model.summon_full_params():
        assert model.l1.module.weight is model.l3.module.weight
        with torch.no_grad():
            model.l3.module.weight.fill_(0.5)
    with model.summon_full_params():
        assert torch.all(model.l1.module.weight == 0.5)
    with model.l3.summon_full_params(recurse=False):  # the owner not summoned: the sharer gathers it
        assert model.l3.module.weight.shape == (4, 4) and torch.all(model.l3.module.weight == 0.5)
    plain = copy.deepcopy(Four("weight"))
    plain.load_state_dict(model.state_dict())
    assert torch.all(plain.l1.weight == 0.5) and plain.l1.weight is plain.l3.weight


class MevoLM(nn.Module):
    """FairScale's shared-weights MEVO model (embedding, LayerNorms, a middle Linear, MEVO tied to
    the embedding), small and in fp32 on CPU."""

    def __init__(self, wrap=False, wrap_middle="none", vocab=40, d=8):
        from fairscale_c.experimental.nn import MEVO

        super().__init__()
        torch.manual_seed(2)
        self.l0 = nn.Embedding(vocab, d)
        nn.init.uniform_(self.l0.weight, -0.1, 0.1)
        self.l1 = MEVO(self.l0.weight, tile_factor=2, reduction="mean")
        self.middle = nn.Linear(d, d)
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        if wrap:
            self.l0 = FSDP(self.l0, flatten_parameters=False)
            self.l1 = FSDP(self.l1, flatten_parameters=False)
            self.l1.append_shared_param(self.l0.module.weight)
            if wrap_middle != "none":
                self.middle = FSDP(self.middle, flatten_parameters=wrap_middle == "flat")

    def forward(self, ids):
        return self.l1(self.ln2(self.middle(self.ln1(self.l0(ids)))), (ids + 1) % 40)


def _mevo_job(rank, world):
    join_gloo(rank, world)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 40, (2 * world, 5), generator=g)
    rows = slice(2 * rank, 2 * rank + 2)
    ref = MevoLM()
    _train(ref, ids, make_opt=lambda ps: torch.optim.SGD(ps, lr=0.5))
    failures = []
    for wrap_middle in ("none", "flat", "nonflat"):
        for root_flat in (True, False):
            model = FSDP(MevoLM(True, wrap_middle), flatten_parameters=root_flat)
            opt = _train(model, ids[rows], make_opt=lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9))
            case = f"wrap_middle={wrap_middle} root_flat={root_flat}"
            osd = model.gather_full_optim_state_dict(opt)
            if rank == 0 and len(osd["state"]) != 8:  # FairScale's test: 8 buffers, the tied weight once
                failures.append(f"{case}: {len(osd['state'])} optimizer states")
            model.eval()  # FairScale's eval case: forwards with and without autograd
            losses = [model(ids).item() for _ in range(2)]
            with torch.no_grad():
                losses += [model(ids).item() for _ in range(2)]
            if len(set(losses)) != 1 or not all(map(torch.isfinite, torch.tensor(losses))):
                failures.append(f"{case}: eval losses {losses}")
        model = FSDP(MevoLM(True, wrap_middle))
        _train(model, ids[rows], make_opt=lambda ps: torch.optim.SGD(ps, lr=0.5))
        failures.append(_compare(model.state_dict(), ref.state_dict(), f"trained, wrap_middle={wrap_middle}"))
    return [f for f in failures if f]


def test_mevo_sharing_the_embedding_weight_as_fairscale_tests_it():
    """FairScale's test_shared_weight_mevo on CPU: the embedding and MEVO in instances of their own,
    tied through append_shared_param, the middle Linear unwrapped, flat or not: three SGD steps on
    half the batch per rank equal the one-process model's; eval forwards agree; the gathered
    optimizer state has 8 entries (the tied weight once)."""
    for failures in run_ranks(_mevo_job, 2, timeout=180):
        assert not failures, "\n".join(failures)
