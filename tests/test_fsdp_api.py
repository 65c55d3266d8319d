"""FSDP's API surface and bad input, in one process (world size 1, no process group needed)."""

import copy
import pickle
import re
import time

import pytest
import torch
from torch import nn

import fairscale_c.nn as fnn
from fairscale_c.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale_c.nn.data_parallel import TrainingState, get_fsdp_instances


class TorchCheckpointed(nn.Module):
    """``inner`` under torch.utils.checkpoint, reentrant or not."""

    def __init__(self, inner, reentrant):
        super().__init__()
        self.inner, self.reentrant = inner, reentrant

    def forward(self, x):
        import torch.utils.checkpoint as tck

        return tck.checkpoint(self.inner, x, use_reentrant=self.reentrant)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_import_paths_mirror_fairscale():
    assert fnn.FullyShardedDataParallel is FSDP
    from fairscale_c.nn.wrap import auto_wrap, config_auto_wrap_policy, default_auto_wrap_policy, enable_wrap, wrap

    assert all(callable(f) for f in (auto_wrap, config_auto_wrap_policy, default_auto_wrap_policy, enable_wrap, wrap))
    assert [s.name for s in TrainingState] == ["IDLE", "FORWARD", "BACKWARD_PRE", "BACKWARD_POST", "SUMMON_FULL_PARAMS"]


# docs/migration.md's table: each FairScale 0.4.13 name it lists as available, under fairscale_c.
MIGRATION_TABLE = {
    "fairscale_c.nn": "FullyShardedDataParallel checkpoint_wrapper auto_wrap config_auto_wrap_policy "
    "default_auto_wrap_policy enable_wrap wrap",
    "fairscale_c.nn.data_parallel": "FullyShardedDataParallel TrainingState get_fsdp_instances auto_wrap_bn "
    "no_pre_load_state_dict_hook",
    "fairscale_c.nn.wrap": "enable_wrap wrap auto_wrap default_auto_wrap_policy config_auto_wrap_policy "
    "transformer_auto_wrap_policy",
    "fairscale_c.nn.checkpoint": "checkpoint_wrapper is_checkpointing is_recomputing",
    "fairscale_c.nn.checkpoint.checkpoint_activations": "disable_checkpointing",
    "fairscale_c.nn.misc": "checkpoint_wrapper",
    "fairscale_c.optim": "GradScaler",
    "fairscale_c.optim.grad_scaler": "ShardedGradScaler GradScaler",
}


@pytest.mark.parametrize("module", sorted(MIGRATION_TABLE))
def test_migration_table_names_import(module):
    import importlib

    mod = importlib.import_module(module)
    missing = [name for name in MIGRATION_TABLE[module].split() if not hasattr(mod, name)]
    assert not missing, f"{module} lacks {missing} (docs/migration.md lists them)"


def test_constructor_defaults_follow_fairscale():
    m = FSDP(mlp())
    assert m.reshard_after_forward and not m.mixed_precision and m.compute_dtype is torch.float32
    assert m.buffer_dtype is torch.float32 and m.move_grads_to_cpu is False and m.bucket_cap_mb == 25
    mp = FSDP(mlp(), mixed_precision=True)
    assert mp.compute_dtype is torch.float16 and mp.buffer_dtype is torch.float16
    off = FSDP(mlp(), cpu_offload=True)
    assert off.move_params_to_cpu and off.move_grads_to_cpu
    assert FSDP._get_gradient_predivide_factor(8) == 4.0 and FSDP._get_gradient_predivide_factor(1) == 1.0


def test_optimizer_sees_only_the_flat_shard():
    m = FSDP(mlp())
    names = [n for n, _ in m.named_parameters()]
    assert names == ["flat_param_0"]
    assert m.flat_param_0.numel() == 4 * 8 + 8 + 8 * 2 + 2


def test_summon_full_params_exposes_original_names_and_writes_back():
    m = FSDP(mlp())
    with m.summon_full_params():
        # FairScale's named_parameters(): the unwrapped model's names while summoned
        assert [n for n, _ in m.named_parameters()] == ["0.weight", "0.bias", "2.weight", "2.bias"]
        assert [n for n, _ in m.named_parameters()] == [n for n, _ in mlp().named_parameters()]
        assert [n for n, _ in m.named_parameters(prefix="model")][0] == "model.0.weight"
        m.module[0].bias.data.fill_(7.0)
    assert torch.all(m.state_dict()["0.bias"] == 7.0)
    with m.summon_full_params(volatile=True):
        m.module[0].bias.data.fill_(1.0)
    assert torch.all(m.state_dict()["0.bias"] == 7.0)


def test_apply_runs_on_full_params():
    m = FSDP(mlp())
    m.apply(lambda mod: nn.init.zeros_(mod.weight) if isinstance(mod, nn.Linear) else None)
    sd = m.state_dict()
    assert torch.all(sd["0.weight"] == 0) and torch.all(sd["2.weight"] == 0)


def test_mixed_dtypes_under_mixed_precision_raise():
    model = mlp()
    model[2].half()
    with pytest.raises(ValueError, match=r"parameter '2.weight' is torch.float16; mixed precision mode expects"):
        FSDP(model, mixed_precision=True)


def test_fp32_reduce_scatter_needs_mixed_precision():
    with pytest.raises(ValueError, match="fp32_reduce_scatter requires mixed_precision"):
        FSDP(mlp(), fp32_reduce_scatter=True)


def test_bad_module_and_compute_dtype():
    with pytest.raises(TypeError, match="argument 'module' must be an nn.Module"):
        FSDP(lambda x: x)
    with pytest.raises(ValueError, match="argument 'compute_dtype'"):
        FSDP(mlp(), compute_dtype=torch.int8)
    sparse = nn.Sequential(nn.Linear(3, 3), nn.EmbeddingBag(10, 3, sparse=True))
    with pytest.raises(ValueError, match="argument 'module' holds EmbeddingBag '1' with sparse=True"):
        FSDP(sparse)


# fmt: off
BAD_ARGS = [
    # (keyword arguments, exception, message naming the argument)
    (dict(bucket_cap_mb="x"), TypeError, "'bucket_cap_mb' must be a number of MiB, got str"),
    (dict(bucket_cap_mb=True), TypeError, "'bucket_cap_mb' must be a number of MiB, got bool"),
    (dict(bucket_cap_mb=-1), ValueError, "'bucket_cap_mb' must be a finite number >= 0"),
    (dict(bucket_cap_mb=float("nan")), ValueError, "'bucket_cap_mb' must be a finite number >= 0"),
    (dict(bucket_cap_mb=float("inf")), ValueError, "'bucket_cap_mb' must be a finite number >= 0"),
    (dict(gradient_predivide_factor=0), ValueError, "'gradient_predivide_factor' must be a finite number > 0"),
    (dict(gradient_predivide_factor=-2.0), ValueError, "'gradient_predivide_factor' must be a finite number > 0"),
    (dict(gradient_predivide_factor="2"), TypeError, "'gradient_predivide_factor' must be a number or None"),
    (dict(reshard_after_forward="no"), TypeError, "'reshard_after_forward' must be a bool, got str"),
    (dict(mixed_precision=1), TypeError, "'mixed_precision' must be a bool, got int"),
    (dict(flatten_parameters=None), TypeError, "'flatten_parameters' must be a bool, got NoneType"),
    (dict(move_grads_to_cpu="yes"), TypeError, "'move_grads_to_cpu' must be a bool or None"),
    (dict(no_broadcast_optim_state=0), TypeError, "'no_broadcast_optim_state' must be a bool or None"),
    (dict(compute_dtype="float16"), TypeError, "'compute_dtype' must be a torch.dtype or None, got str"),
    (dict(compute_dtype=torch.int8), ValueError, "'compute_dtype' must be float32, float16 or bfloat16"),
    (dict(buffer_dtype=torch.int64), ValueError, "'buffer_dtype' must be a floating dtype"),
    (dict(compute_device=3.5), TypeError, "'compute_device' must be None, a torch.device"),
    (dict(process_group="world"), TypeError,
     "'process_group' must be a process group, an object with rank() and size(), or None, got str"),
    (dict(process_group_reduce_scatter="fast"), ValueError, "'process_group_reduce_scatter' must be a process group"),
    (dict(process_group_reduce_scatter=3), TypeError, "'process_group_reduce_scatter' must be a process group"),
    (dict(fp32_reduce_scatter=True), ValueError, "fp32_reduce_scatter requires mixed_precision=True"),
    (dict(compute_dtype=torch.bfloat16), ValueError, "'compute_dtype' is bfloat16 without mixed_precision=True"),
]
# fmt: on


@pytest.mark.parametrize("kwargs, exc, match", BAD_ARGS, ids=[repr(a[0]) for a in BAD_ARGS])
def test_constructor_arguments_are_checked(kwargs, exc, match):
    module = mlp()
    before = [p.detach().clone() for p in module.parameters()]
    with pytest.raises(exc, match=re.escape(match) if "(" in match else match):
        FSDP(module, **kwargs)
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters()))  # nothing was sharded


def test_device_arguments_must_parse():
    # Separate from the table: torch refuses these strings by throwing a C++ exception, which
    # ASan's __cxa_throw interceptor cannot handle inside libtorch (`make asan` leaves this out).
    with pytest.raises(ValueError, match="'compute_device' is not a device: 'gpu7'"):
        FSDP(mlp(), compute_device="gpu7")
    with pytest.raises(ValueError, match="'state_dict_device' is not a device: 'nowhere'"):
        FSDP(mlp(), state_dict_device="nowhere")


def test_accepted_argument_forms():
    m = FSDP(mlp(), bucket_cap_mb=0.5, gradient_predivide_factor=2, compute_device="cpu", state_dict_device=None)
    assert m.gradient_predivide_factor == 2.0 and m.gradient_postdivide_factor == 0.5
    assert FSDP(mlp(), process_group_reduce_scatter="default", move_grads_to_cpu=None).bucket_cap_mb == 25


def test_summon_full_params_inside_forward_raises():
    class Peek(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.owner = None

        def forward(self, x):
            with self.owner.summon_full_params():
                pass
            return self.lin(x)

    inner = Peek()
    m = FSDP(inner)
    inner.owner = m
    with pytest.raises(RuntimeError, match="summon_full_params: not allowed during forward"):
        m(torch.randn(1, 2))
    assert m.training_state is TrainingState.IDLE


def test_module_without_parameters_is_a_passthrough():
    # FairScale accepts it (e.g. a root that only holds buffers); so do we.
    m = FSDP(nn.ReLU())
    assert list(m.parameters()) == [] and m.local_metadata_dict()["param_metadata"][0]["params"] == {}
    assert torch.equal(m(torch.tensor([-1.0, 2.0])), torch.tensor([0.0, 2.0]))
    assert m.clip_grad_norm_(1.0) == 0


def test_tied_weights_split_across_instances_are_shared():
    # The head in the root shares the weight of the embedding's own instance (more in
    # test_fsdp_shared_params.py): one Parameter, trained as the plain model trains it.
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.embed = nn.Embedding(5, 3)
            self.head = nn.Linear(3, 5, bias=False)
            self.head.weight = self.embed.weight

        def forward(self, ids):
            return self.head(self.embed(ids))

    ref, model = Tied(), Tied()
    model.embed = FSDP(model.embed)
    model = FSDP(model)
    assert model.module.head.weight is model.module.embed.flat_param_0
    ids = torch.tensor([[0, 3, 4]])
    for m in (ref, model):
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        for _ in range(2):
            m(ids).logsumexp(-1).sum().backward()
            opt.step()
            opt.zero_grad()
    sd = model.state_dict()
    assert list(sd) == list(ref.state_dict())
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, rtol=1e-6, atol=1e-7)


def test_nested_instances_and_root_only_methods():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[0] = FSDP(model[0])
    root = FSDP(model)
    assert get_fsdp_instances(root) == [root, root.module[0]]
    root(torch.randn(3, 4)).sum().backward()
    with pytest.raises(RuntimeError, match="root instance"):
        root.module[0].clip_grad_norm_(1.0)
    with pytest.raises(RuntimeError, match="root instance"):
        with root.module[0].no_sync():
            pass
    assert root.flat_param_0.grad is not None and root.module[0].flat_param_0.grad is not None


def test_reset_parameters_needs_permission():
    with pytest.raises(RuntimeError, match="allow_reset_parameters"):
        FSDP(nn.Linear(2, 2)).reset_parameters()


def test_unflattened_shards_keep_original_names():
    m = FSDP(mlp(), flatten_parameters=False)
    local = m.local_state_dict()
    assert list(local) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    meta = m.local_metadata_dict()
    assert list(meta["param_metadata"][0]["params"]) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    merged = FSDP.consolidate_shard_weights([local], [meta])
    full = m.state_dict()
    assert set(merged) == set(full) and all(torch.equal(merged[k], full[k]) for k in full)
    x = torch.randn(3, 4)
    plain = mlp()
    torch.testing.assert_close(m(x), plain(x))
    assert [n for n, _ in m.named_parameters()] == list(local)  # clean names, as in FairScale
    # a parent's named_parameters() does not go through FSDP's and keeps the wrapper names
    parent = nn.Sequential(m)
    assert [n for n, _ in parent.named_parameters()] == ["0._fsdp_wrapped_module." + k for k in local]


def test_nested_names_under_summon_are_the_plain_models():
    model = mlp()
    model[2] = FSDP(model[2])
    m = FSDP(model)
    assert [n for n, _ in m.named_parameters()] == ["flat_param_0", "_fsdp_wrapped_module.2.flat_param_0"]
    with m.summon_full_params():
        assert [n for n, _ in m.named_parameters()] == [n for n, _ in mlp().named_parameters()]


def test_no_pre_load_state_dict_hook_takes_keys_as_given():
    from fairscale_c.nn.data_parallel import no_pre_load_state_dict_hook

    m = FSDP(mlp())
    sd = m.state_dict()
    wrapped = {"_fsdp_wrapped_module." + k: v + 1 for k, v in sd.items()}
    with no_pre_load_state_dict_hook():
        with pytest.raises(RuntimeError, match="Missing key"):
            m.load_state_dict(sd)  # clean keys are not renamed while the hook is off
        m.load_state_dict(wrapped)
    assert all(torch.equal(m.state_dict()[k], sd[k] + 1) for k in sd)
    m.load_state_dict(sd)  # the hook is back on
    assert all(torch.equal(m.state_dict()[k], sd[k]) for k in sd)


def test_unflattened_shared_parameters_are_one_parameter():
    # as in FairScale, whose unflattened instance keeps the tied Parameter object under both names
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    model[1].weight = model[0].weight
    m = FSDP(model, flatten_parameters=False)
    assert m.module[1].weight is m.module[0].weight and len(list(m.parameters())) == 3
    assert list(m.local_state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    m(torch.randn(2, 3)).sum().backward()
    assert m.module[0].weight.grad is not None
    with m.summon_full_params():
        assert m.module[1].weight is m.module[0].weight and m.module[0].weight.shape == (3, 3)


def test_unflattened_local_state_dict_at_world_one_keeps_parameter_shapes():
    """FairScale keeps each parameter whole at world size 1 without flattening, and its local
    state dict holds it in its own shape: ours does the same, so the two load each other's."""
    m = FSDP(mlp(), flatten_parameters=False)
    local = m.local_state_dict()
    assert {k: tuple(v.shape) for k, v in local.items()} == {
        "0.weight": (8, 4),
        "0.bias": (8,),
        "2.weight": (2, 8),
        "2.bias": (2,),
    }
    full = m.state_dict()
    merged = FSDP.consolidate_shard_weights([local], [m.local_metadata_dict()])
    assert all(torch.equal(merged[k], full[k]) for k in full)
    for saved in (local, {k: v.reshape(-1) for k, v in local.items()}):  # flat: saved by an earlier version
        other = FSDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), flatten_parameters=False)
        other.load_local_state_dict({k: v.clone() for k, v in saved.items()})
        assert all(torch.equal(other.state_dict()[k], full[k]) for k in full)
    with pytest.raises(ValueError, match="'0.bias' has 7 elements but this rank's shard has 8"):
        other.load_local_state_dict(dict(local, **{"0.bias": torch.zeros(7)}))
    with pytest.raises(RuntimeError, match="size mismatch for _fsdp_wrapped_module.0.weight"):  # transposed: refused
        other.load_local_state_dict(dict(local, **{"0.weight": local["0.weight"].t().contiguous()}))
    kept = other.local_state_dict(keep_vars=True)  # the Parameters themselves, as nn.Module gives them
    assert all(isinstance(v, nn.Parameter) for k, v in kept.items())

    # a weight tied within the instance (an embedding and its output layer): shaped under both names
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = nn.Embedding(10, 8), nn.Linear(8, 10, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, x):
            return self.head(self.emb(x))

    torch.manual_seed(0)
    tied = FSDP(Tied(), flatten_parameters=False)
    local = tied.local_state_dict()
    assert {k: tuple(v.shape) for k, v in local.items()} == {"emb.weight": (10, 8), "head.weight": (10, 8)}
    torch.manual_seed(1)
    again = FSDP(Tied(), flatten_parameters=False)
    again.load_local_state_dict({k: v.clone() for k, v in local.items()})
    assert torch.equal(again.state_dict()["emb.weight"], tied.state_dict()["emb.weight"])


def test_fairscale_instance_attributes():
    m = FSDP(mlp())
    assert (m.buffer_size, m.num_params_managed) == (4 * 8 + 8 + 8 * 2 + 2, 4)
    assert not m.has_full_params
    with m.summon_full_params():
        assert m.has_full_params
    assert not m.has_full_params
    kept = FSDP(mlp(), reshard_after_forward=False)
    kept(torch.randn(2, 4))
    assert kept.has_full_params  # kept after forward, for backward


@pytest.mark.parametrize("flatten", [True, False])
def test_parameters_swapped_in_by_functional_call_are_refused(flatten):
    m = FSDP(mlp(), flatten_parameters=flatten)
    zeros = {k: torch.zeros_like(v) for k, v in m.named_parameters()}
    with pytest.raises(RuntimeError, match="is not this instance's shard any more"):
        torch.func.functional_call(m, zeros, (torch.randn(2, 4),))
    m(torch.randn(2, 4)).sum().backward()  # the instance itself is untouched


@pytest.mark.parametrize("flatten", [True, False])
@pytest.mark.parametrize("how", ["checkpoint_wrapper", "torch non-reentrant"])
def test_activation_checkpointing_around_an_instance(how, flatten):
    # The forward recomputed in backward finds the instance's full parameters in its slots; that
    # is not a swap of the kind the check for torch.func.functional_call refuses.
    from fairscale_c.nn import checkpoint_wrapper

    def plain():
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)), nn.Linear(4, 2)
        )

    ref, m = plain(), plain()
    block = FSDP(m[1], flatten_parameters=flatten)
    m[1] = checkpoint_wrapper(block) if how == "checkpoint_wrapper" else TorchCheckpointed(block, reentrant=False)
    model = FSDP(m)
    x = torch.randn(3, 4)
    model(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    torch.optim.SGD(ref.parameters(), lr=1.0).step()
    full = {k.replace("inner.", ""): v for k, v in model.state_dict().items()}
    assert full.keys() == ref.state_dict().keys()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, msg=lambda msg, k=k: f"{k}: {msg}")


@pytest.mark.parametrize("flatten", [True, False])
def test_nested_instances_each_around_a_checkpointed_block(flatten):
    # The outer block's recomputation runs the inner instance's forward again after the inner
    # instance's backward began: its full parameters and views stay for that backward.
    from fairscale_c.nn import checkpoint_wrapper

    def plain():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)))

    ref, m = plain(), plain()
    m[1] = FSDP(checkpoint_wrapper(m[1]), flatten_parameters=flatten)
    model = FSDP(checkpoint_wrapper(m), flatten_parameters=flatten)
    x = torch.randn(3, 4)
    for net in (model, ref):
        net(x).pow(2).sum().backward()
        torch.optim.SGD(net.parameters(), lr=0.5).step()
    full = model.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(full[k], v, msg=lambda msg, k=k: f"{k}: {msg}")


def test_local_state_dict_round_trip_and_consolidate():
    m = FSDP(mlp())
    local = m.local_state_dict()
    assert list(local) == ["flat_param_0"]
    merged = FSDP.consolidate_shard_weights([local], [m.local_metadata_dict()])
    full = m.state_dict()
    assert set(merged) == set(full) and all(torch.equal(merged[k], full[k]) for k in full)
    other = FSDP(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)))
    other.load_local_state_dict(local)
    assert all(torch.equal(other.state_dict()[k], full[k]) for k in full)
    with pytest.raises(ValueError, match="one metadata dict per shard"):
        FSDP.consolidate_shard_weights([local], [])


@pytest.mark.parametrize("dtype", [torch.int64, torch.float16, torch.float64], ids=str)
def test_local_shards_of_another_dtype_are_refused(dtype):
    m = FSDP(mlp())
    local = m.local_state_dict()
    before = m.flat_param_0.detach().clone()
    with pytest.raises(TypeError, match=rf"'flat_param_0' is {dtype} but this rank's shard is torch.float32"):
        m.load_local_state_dict({k: v.to(dtype) for k, v in local.items()})
    assert torch.equal(m.flat_param_0.detach(), before)  # nothing was cast in
    metadata = m.local_metadata_dict()
    assert metadata["rank"] == 0 and metadata["world_size"] == 1


def test_state_dict_round_trip_into_plain_model():
    m = FSDP(mlp())
    plain = mlp()
    plain.load_state_dict(m.state_dict())
    x = torch.randn(3, 4)
    torch.testing.assert_close(plain(x), m(x))


def test_auto_wrap_bn_wraps_batchnorm_unflattened_in_fp32():
    from fairscale_c.nn.data_parallel import auto_wrap_bn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))
    ref = copy.deepcopy(model)
    wrapped = FSDP(auto_wrap_bn(model), mixed_precision=False)
    bn = wrapped.module[1]
    assert isinstance(bn, FSDP) and not bn.flatten_parameters and not bn.mixed_precision
    assert not bn.reshard_after_forward
    x = torch.randn(8, 4)
    out = wrapped(x)
    torch.testing.assert_close(out, ref(x))
    out.sum().backward()
    assert wrapped.module[1].module.weight.grad is not None
    with pytest.raises(AssertionError, match="wrapper_config"):
        m2 = nn.Sequential(nn.BatchNorm1d(3))
        m2[0].wrapper_config = {}
        auto_wrap_bn(m2)


@pytest.mark.parametrize("norm_type", [2.0, float("inf"), 1.0])
def test_clip_grad_norm_matches_torch(norm_type):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    model[1] = FSDP(model[1])
    fsdp = FSDP(model)
    x = torch.randn(3, 4)
    fsdp(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    total = fsdp.clip_grad_norm_(0.05, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type)
    torch.testing.assert_close(total, expected)
    flat = torch.cat([fsdp.flat_param_0.grad, fsdp.module[1].flat_param_0.grad])
    torch.testing.assert_close(flat, torch.cat([p.grad.reshape(-1) for p in ref.parameters()]))


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_reports_a_nan_gradient_as_torch_does(norm_type):
    # A caller that skips the step when the returned norm is not finite must see the NaN.
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    model[1] = FSDP(model[1])
    fsdp = FSDP(model)
    fsdp(torch.randn(3, 4)).pow(2).sum().backward()
    fsdp.module[1].flat_param_0.grad[0] = float("nan")
    assert torch.isnan(fsdp.clip_grad_norm_(1.0, norm_type))


def test_module_keeps_its_attributes_after_state_dict_and_summon():
    m = FSDP(mlp())
    m.state_dict()
    with m.summon_full_params():
        pass
    assert m.module[0].weight.shape == (8, 4) and "Linear(in_features=4" in repr(m)
    torch.testing.assert_close(m(torch.ones(1, 4)), mlp()(torch.ones(1, 4)))


def test_each_instance_casts_its_own_buffers():
    from fairscale_c.nn.data_parallel import auto_wrap_bn

    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    model.register_buffer("scale", torch.ones(2))
    root = FSDP(auto_wrap_bn(model), mixed_precision=True, compute_dtype=torch.bfloat16)
    with torch.no_grad():
        root(torch.randn(3, 4))
    assert root.module.scale.dtype is torch.bfloat16  # the root's buffer follows the root
    assert root.module[1].module.running_mean.dtype is torch.float32  # the fp32 BN keeps fp32


def test_half_and_float_after_wrapping_follow_fairscale():
    x = torch.randn(3, 4)
    m = FSDP(mlp()).half()
    assert m.compute_dtype is torch.float16 and m.flat_param_0.dtype is torch.float16
    out = m(x.half())
    torch.testing.assert_close(out, mlp().half()(x.half()))
    out.float().sum().backward()
    assert m.flat_param_0.grad.dtype is torch.float16
    m.zero_grad()
    m.float()
    assert m.compute_dtype is torch.float32
    torch.testing.assert_close(m(x), mlp()(x), atol=1e-3, rtol=1e-3)  # weights went through fp16
    b = FSDP(mlp()).bfloat16()
    torch.testing.assert_close(b(x.bfloat16()), mlp().bfloat16()(x.bfloat16()))
    # mixed precision keeps its compute dtype (FairScale: .half() there "makes little sense")
    mp = FSDP(mlp(), mixed_precision=True).half().float()
    assert mp.compute_dtype is torch.float16 and mp.flat_param_0.dtype is torch.float32
    torch.testing.assert_close(mp(x).float(), mlp()(x), atol=1e-2, rtol=1e-2)


def test_conversions_that_cannot_work_are_refused_before_anything_changes():
    m = FSDP(mlp())
    with pytest.raises(ValueError, match="float64"):
        m.double()
    assert m.flat_param_0.dtype is torch.float32
    with pytest.raises(RuntimeError, match="move the module before wrapping"):
        m.to("meta")
    assert m.flat_param_0.device.type == "cpu"
    torch.testing.assert_close(m(torch.ones(1, 4)), mlp()(torch.ones(1, 4)))


def test_pickling_and_deepcopy_raise_a_clear_error():
    import pickle

    m = FSDP(mlp())
    for fn in (copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError, match="cannot be pickled or deep-copied.*state_dict"):
            fn(m)


def test_reduce_scatters_share_the_group_where_ranks_share_a_gpu(monkeypatch):
    """Two NCCL communicators per rank deadlocked with ranks sharing a GPU under MPS (docs/fsdp.md):
    there the default reduce-scatter group is process_group's, with a warning; elsewhere the
    default is a group of its own, as in FairScale."""
    import types

    import fairscale_c.distributed as fdist
    from fairscale_c.nn.data_parallel import _setup as fsdp_setup
    from fairscale_c.nn.data_parallel.fully_sharded_data_parallel import ProcessGroupName

    roles = []
    monkeypatch.setattr(fdist, "group_for", lambda pg, role="default", **kw: roles.append(role) or "own group")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    fsdp_setup._warn_shared_gpu.cache_clear()
    fake = types.SimpleNamespace(
        comm=types.SimpleNamespace(size=2), process_group="pg", compute_device=torch.device("cuda")
    )

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun: 2 ranks on this node, 1 GPU
    assert fdist.ranks_share_gpus()
    with pytest.warns(UserWarning, match="share a GPU"):
        assert FSDP._reduce_scatter_comm(fake, ProcessGroupName.reduce_scatter) is fake.comm
    assert roles == []
    fake.compute_device = torch.device("cpu")  # a CPU instance has no NCCL communicator to deadlock
    assert FSDP._reduce_scatter_comm(fake, ProcessGroupName.reduce_scatter) == "own group"
    assert roles == ["reduce_scatter"]
    roles.clear()
    fake.compute_device = torch.device("cuda")

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert not fdist.ranks_share_gpus()
    assert FSDP._reduce_scatter_comm(fake, ProcessGroupName.reduce_scatter) == "own group"
    assert roles == ["reduce_scatter"]
    monkeypatch.delenv("LOCAL_WORLD_SIZE")  # not under torchrun: unknown, so no sharing assumed
    assert not fdist.ranks_share_gpus()
    fake.comm.shares_gpu = True  # ...unless the group found two ranks on one GPU at rendezvous
    assert fdist.ranks_share_gpus(fake.comm)
    assert FSDP._reduce_scatter_comm(fake, ProcessGroupName.reduce_scatter) is fake.comm
    assert roles == ["reduce_scatter"]
    fake.comm.shares_gpu = False
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # no CUDA: nothing to share
    assert not fdist.ranks_share_gpus()


def _freed_job(rank, world):
    """FSDP and ShardedDataParallel are freed once dropped: their gradient hooks hold them weakly
    (a tensor's hooks are out of the garbage collector's sight, so a strong one kept the module,
    its buffers and its torch process group alive for good)."""
    import gc
    import weakref

    import torch.distributed as dist

    from dist_utils import join_gloo
    from fairscale_c.nn import FullyShardedDataParallel as FSDP
    from fairscale_c.nn import ShardedDataParallel
    from fairscale_c.optim import OSS

    join_gloo(rank, world)
    m = FSDP(nn.Sequential(FSDP(nn.Linear(8, 8)), nn.Linear(8, 4)))
    m(torch.randn(2, 8)).sum().backward()
    fsdp = weakref.ref(m)
    lin = nn.Linear(8, 4)
    opt = OSS(lin.parameters(), optim=torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(lin, opt)
    sdp(torch.randn(2, 8)).sum().backward()
    opt.step()
    sdp_ref = weakref.ref(sdp)
    del m, sdp, opt, lin
    gc.collect()
    dist.barrier()
    return fsdp() is None, sdp_ref() is None


def test_dropped_wrappers_are_freed():
    from dist_utils import run_ranks

    assert run_ranks(_freed_job, 2, env={"FAIRSCALE_C_TIMEOUT": "60"}) == [(True, True)] * 2


@pytest.mark.parametrize("case", ["freeze", "unfreeze"])
def test_requires_grad_changed_after_wrapping_is_followed(case):
    # FairScale reads the flat parameter's requires_grad at every step: a layer frozen after
    # wrapping gets no gradient any more, and one unfrozen after wrapping starts training.
    plain = mlp()
    m = copy.deepcopy(plain)
    if case == "unfreeze":
        m[0].requires_grad_(False)
    m[0] = FSDP(m[0])
    model = FSDP(m)
    inner = model.module[0]
    x = torch.randn(3, 4)
    model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    inner.requires_grad_(case == "unfreeze")
    plain[0].requires_grad_(case == "unfreeze")
    model(x).sum().backward()
    plain(x).sum().backward()
    (flat,) = inner.parameters()
    if case == "freeze":
        assert flat.grad is None
    else:
        want = torch.cat([plain[0].weight.grad.flatten(), plain[0].bias.grad])
        torch.testing.assert_close(flat.grad[: want.numel()], want)
    rest = [p for p in model.parameters() if p is not flat]
    assert rest and all(p.grad is not None for p in rest)  # the rest of the model still trains


def test_local_state_dict_keeps_buffers_in_fp32_under_mixed_precision():
    torch.manual_seed(0)
    m = FSDP(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), mixed_precision=True, compute_dtype=torch.bfloat16)
    m(torch.randn(3, 4))
    local, full = m.local_state_dict(), m.state_dict()
    for name in ("1.running_mean", "1.running_var"):
        assert local[name].dtype is torch.float32 and full[name].dtype is torch.float32, name
    assert local["flat_param_0"].dtype is torch.float32


def test_a_first_forward_under_inference_mode_leaves_the_model_trainable():
    # The first forward casts the buffers to buffer_dtype; under inference mode the cast must
    # still give normal tensors, or every later training forward refuses to save them.
    torch.manual_seed(0)
    m = FSDP(
        nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2)),
        mixed_precision=True,
        compute_dtype=torch.bfloat16,
    )
    with torch.inference_mode():
        m(torch.randn(3, 4))
    assert not any(b.is_inference() for b in m.buffers())
    m(torch.randn(3, 4)).float().sum().backward()
    assert m.flat_param_0.grad is not None and torch.isfinite(m.flat_param_0.grad).all()


def test_a_module_on_the_meta_device_is_refused():
    meta = mlp().to_empty(device="meta")
    with pytest.raises(ValueError, match="argument 'module' has parameter '0.weight' on the meta device"):
        FSDP(meta)
    real = mlp()
    real.register_buffer("steps", torch.zeros(1, device="meta"))
    with pytest.raises(ValueError, match="argument 'module' has buffer 'steps' on the meta device"):
        FSDP(real)


def test_a_failed_summon_leaves_the_instance_as_it_was(monkeypatch):
    from fairscale_c.nn.data_parallel import _state_dict

    plain = mlp()
    plain[2].requires_grad_(False)  # two flat parameters: one gathered before the failing one
    m = FSDP(copy.deepcopy(plain))
    names = [n for n, _ in m.named_parameters()]
    assert names == ["flat_param_0", "flat_param_1"]
    gather, calls = _state_dict._gather_fp32, []

    def fail_second(fsdp, h):
        calls.append(h)
        if len(calls) == 2:
            raise RuntimeError("gather failed")
        return gather(fsdp, h)

    monkeypatch.setattr(_state_dict, "_gather_fp32", fail_second)
    with pytest.raises(RuntimeError, match="gather failed"):
        with m.summon_full_params():
            pass
    monkeypatch.setattr(_state_dict, "_gather_fp32", gather)
    assert m.training_state is TrainingState.IDLE and len(calls) == 2
    assert [n for n, _ in m.named_parameters()] == names
    x = torch.randn(3, 4)
    torch.testing.assert_close(m(x), plain(x))
    with m.summon_full_params():
        torch.testing.assert_close(m.module[0].weight, plain[0].weight)
    assert m.state_dict().keys() == plain.state_dict().keys()


def test_gathered_optimizer_state_gives_each_parameter_its_own_scalars():
    # NAdam's mu_product is one 0-d tensor per flat parameter; shared by every entry of the
    # gathered state, a plain NAdam loading it would multiply it once per parameter each step.
    plain, ref = mlp(), mlp()
    m = FSDP(plain)
    opt, ref_opt = torch.optim.NAdam(m.parameters(), lr=0.01), torch.optim.NAdam(ref.parameters(), lr=0.01)
    for step in range(3):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        for model, o in ((m, opt), (ref, ref_opt)):
            o.zero_grad()
            model(x).pow(2).sum().backward()
            o.step()
    full = m.gather_full_optim_state_dict(opt)
    assert full["state"][0]["mu_product"] is not full["state"][1]["mu_product"]
    loaded = mlp()
    loaded.load_state_dict(m.state_dict())
    loaded_opt = torch.optim.NAdam(loaded.parameters(), lr=0.01)
    loaded_opt.load_state_dict({"state": full["state"], "param_groups": full["param_groups"]})
    for step in range(3, 6):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        for model, o in ((loaded, loaded_opt), (ref, ref_opt)):
            o.zero_grad()
            model(x).pow(2).sum().backward()
            o.step()
    for p, q in zip(loaded.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q)


def test_optimizer_state_arguments_are_checked():
    m = FSDP(mlp())
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    with pytest.raises(TypeError, match="argument 'optim' must be a torch.optim.Optimizer, got NoneType"):
        m.gather_full_optim_state_dict(None)
    with pytest.raises(TypeError, match="argument 'full_optim_state_dict' must be a dict"):
        m.get_shard_from_optim_state_dict(None)
    full = m.gather_full_optim_state_dict(opt)
    assert full["state"][0]["momentum_buffer"].shape == (8, 4)
    transposed = copy.deepcopy(full)
    transposed["state"][0]["momentum_buffer"] = full["state"][0]["momentum_buffer"].t().contiguous()
    with pytest.raises(ValueError, match=r"state 'momentum_buffer' of parameter 0 is \(4, 8\); expected .* \(8, 4\)"):
        m.get_shard_from_optim_state_dict(transposed)
    missing = copy.deepcopy(full)
    del missing["state"][1]["momentum_buffer"]
    with pytest.raises(ValueError, match="has no state 'momentum_buffer' for parameter 1"):
        m.get_shard_from_optim_state_dict(missing)
    shard = m.get_shard_from_optim_state_dict(full)  # the checked form still round-trips
    torch.testing.assert_close(shard["state"][0]["momentum_buffer"], opt.state_dict()["state"][0]["momentum_buffer"])


def test_optimizer_state_of_another_wrapping_is_refused():
    """A gathered state names parameters by their order in the model that saved it and groups
    them by its flat parameters: a model wrapped otherwise (here one instance against a nested
    one, which order the parameters differently) would get other parameters' states, silently
    where the shapes agree. FairScale refuses it too (its count of instances)."""

    def build(nested):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        if nested:
            model[0] = FSDP(model[0])
        return FSDP(model)

    states = {}
    for nested in (True, False):
        m = build(nested)
        opt = torch.optim.Adam(m.parameters(), lr=0.01)
        m(torch.randn(3, 4)).sum().backward()
        opt.step()
        states[nested] = m.gather_full_optim_state_dict(opt)
    for saved_nested, load_nested, why in ((True, False, r"\[0, 1\]"), (False, True, "another flat parameter has it")):
        with pytest.raises(ValueError, match=f"grouped into flat parameters otherwise.*{why}.*same FSDP nesting"):
            build(load_nested).get_shard_from_optim_state_dict(states[saved_nested])
    for nested in (True, False):  # the same wrapping loads
        m = build(nested)
        torch.optim.Adam(m.parameters(), lr=0.01).load_state_dict(m.get_shard_from_optim_state_dict(states[nested]))


@pytest.mark.parametrize("flatten", [True, False])
def test_the_wrapped_modules_own_state_dict_is_refused_where_it_would_be_partial(flatten):
    # DDP's habit, model.module.state_dict(), would leave out (flat) or flatten (unflattened) the
    # parameters the instance holds; a module whose parameters all sit in nested instances is whole.
    m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    m[1] = FSDP(m[1], flatten_parameters=flatten)
    model = FSDP(m, flatten_parameters=flatten)
    with pytest.raises(RuntimeError, match="call state_dict\\(\\) on the FullyShardedDataParallel instance"):
        model.module.state_dict()
    full = model.state_dict()
    assert list(full) == ["0.weight", "0.bias", "1.weight", "1.bias"]
    with pytest.raises(RuntimeError, match="call state_dict\\(\\) on the FullyShardedDataParallel instance"):
        model.module[0].state_dict()  # a submodule whose parameters the instance holds
    with model.summon_full_params():
        inside = model.module.state_dict()
        plain = copy.deepcopy(model.module[0])  # a plain module, whole, with a state of its own
        pickled = pickle.loads(pickle.dumps(model.module[0]))
    assert list(inside) == list(full) and all(torch.equal(inside[k], v) for k, v in full.items())
    for copied in (plain, pickled):
        assert list(copied.state_dict()) == ["weight", "bias"]
        torch.testing.assert_close(copied.state_dict()["weight"], full["0.weight"])
    model.local_state_dict()  # its own paths are unaffected
    outer = FSDP(nn.Sequential(FSDP(nn.Linear(4, 4), flatten_parameters=flatten)))
    assert list(outer.module.state_dict()) == ["0.weight", "0.bias"]


def test_a_launched_rank_without_torch_distributed_is_refused(monkeypatch, tmp_path):
    # Under torchrun without init_process_group, process_group=None would be a world of one on
    # every rank: each would train alone, and save_sharded would write every rank as rank 0.
    from fairscale_c.nn import ShardedDataParallel
    from fairscale_c.optim import OSS
    from fairscale_c.optim.grad_scaler import ShardedGradScaler
    from fairscale_c.utils.checkpoint import save_sharded

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    message = "WORLD_SIZE=2 ranks .* call torch.distributed.init_process_group"
    with pytest.raises(
        RuntimeError, match="FullyShardedDataParallel" + r"\(process_group=None\): this process is one of " + message
    ):
        FSDP(mlp())
    with pytest.raises(RuntimeError, match=r"OSS\(group=None\): .*" + message):
        OSS(mlp().parameters(), optim=torch.optim.SGD, lr=0.1)
    with pytest.raises(RuntimeError, match=r"save_sharded .*" + message):
        save_sharded({"w": torch.ones(2)}, str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())
    monkeypatch.setenv("WORLD_SIZE", "1")
    model = mlp()
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    sdp = ShardedDataParallel(model, opt)
    scaler = ShardedGradScaler()
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"ShardedDataParallel\(process_group=None\): .*" + message):
        ShardedDataParallel(mlp(), opt)
    scaler.scale(sdp(torch.randn(2, 4)).sum()).backward()
    with pytest.raises(RuntimeError, match=r"ShardedGradScaler\(process_group=None\): .*" + message):
        scaler.step(opt)
    # before anything was unscaled: the stage is still READY, the gradients still scaled
    assert scaler._per_optimizer_states[id(opt)]["stage"].name == "READY"


class _Boxed(nn.Module):
    """mlp() whose output sits in an object FSDP cannot look into."""

    class Box:
        def __init__(self, t):
            self.t = t

    def __init__(self):
        super().__init__()
        self.net = mlp()

    def forward(self, x):
        return _Boxed.Box(self.net(x))


@pytest.mark.parametrize("flatten", [True, False])
def test_no_sync_gradients_follow_the_caller_until_the_next_backward(flatten):
    # zero_grad() after the next forward still drops what no_sync() accumulated (the gradients
    # go back to FSDP when backward starts); with outputs FSDP cannot hook, forwarding every
    # micro-batch before the backwards accumulates as plain torch does.
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    m, ref = FSDP(mlp(), flatten_parameters=flatten), mlp()
    with m.no_sync():
        m(xs[0]).sum().backward()
    out = m(xs[1])
    m.zero_grad()
    out.sum().backward()
    ref(xs[1]).sum().backward()
    torch.optim.SGD(m.parameters(), lr=1.0).step()
    torch.optim.SGD(ref.parameters(), lr=1.0).step()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(m.state_dict()[k], v, msg=lambda msg, k=k: f"dropped: {k}: {msg}")
    boxed, ref = FSDP(_Boxed(), flatten_parameters=flatten), _Boxed()
    with pytest.warns(UserWarning, match="Box, whose tensors FSDP cannot see"):
        outs = [boxed(x) for x in xs]
    with boxed.no_sync():
        outs[0].t.sum().backward()
        outs[1].t.sum().backward()
    outs[2].t.sum().backward()
    for x in xs:
        ref(x).t.sum().backward()
    torch.optim.SGD(boxed.parameters(), lr=1.0).step()
    torch.optim.SGD(ref.parameters(), lr=1.0).step()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(boxed.state_dict()[k], v, msg=lambda msg, k=k: f"hidden: {k}: {msg}")


def test_printing_a_held_weight_between_steps_does_not_read_released_memory():
    # In a process of its own: a read of the released full buffer would segfault it. Its device
    # and dtype stay readable (models build tensors on `some_layer.weight.device`).
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import torch
        from torch import nn
        from fairscale_c.nn.data_parallel import FullyShardedDataParallel as FSDP
        m = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        m[2] = FSDP(m[2])
        f = FSDP(m)
        f(torch.randn(2, 4)).sum().backward()
        inner = f.module[2].module
        print(repr(inner.weight), tuple(inner.weight.shape), inner.weight.dtype)
        assert inner.weight.device == torch.device("cpu") and inner.weight.requires_grad  # read as is common
        try:
            inner.weight.sum()
            raise AssertionError("a released parameter's values were read")
        except RuntimeError as e:
            assert "summon_full_params" in str(e), e
        with torch.no_grad():
            f(torch.randn(2, 4))
        print(repr(inner.weight))
        with f.summon_full_params():
            print(bool(inner.weight.abs().sum() > 0))
        for change in (lambda w: setattr(w, "requires_grad", False), lambda w: w.requires_grad_(False)):
            try:  # FairScale's view of the flat parameter refuses it too (not a leaf)
                change(inner.weight)
                raise AssertionError("a held parameter's requires_grad changed alone")
            except RuntimeError as e:
                assert "cannot change after wrapping" in str(e), e
        f.requires_grad_(False)  # frozen: a forward with gradients on reaches no backward
        f(torch.randn(2, 4))
        print(repr(inner.weight))
        f.requires_grad_(True)
        with f.no_sync():  # the inner instance reshards in its backward
            f(torch.randn(2, 4)).sum().backward()
        print(repr(inner.weight))
        out = f(torch.randn(2, 4))  # between a training forward and its backward
        print(repr(inner.weight))
        out.sum().backward()
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "ReleasedParameter(shape=(2, 8), dtype=torch.float32, device=cpu) (2, 8) torch.float32", lines
    assert lines[1] == "ReleasedParameter(shape=(2, 8), dtype=torch.float32, device=cpu)" and lines[2] == "True", lines
    assert lines[3] == lines[4] == lines[5] == "ReleasedParameter(shape=(2, 8), dtype=torch.float32, device=cpu)", lines


def _stepped_alike(fsdp, ref):
    """One SGD step with the gradients each holds gives the same weights."""
    for m in (fsdp, ref):
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    got = fsdp.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k], v, msg=k)


class _SlowBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(0.6)  # another thread acts meanwhile
        return g


class _SlowInBackward(nn.Module):
    def forward(self, x):
        return _SlowBackward.apply(x)


def test_a_thread_reading_parameters_during_backward_changes_nothing():
    """A monitoring thread's parameters() while the loop's backward runs is not taken for the
    call after a backward that failed (which puts that backward away)."""
    import threading

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), _SlowInBackward(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    m = copy.deepcopy(ref)
    for i in (0, 3, 5):
        m[i] = FSDP(m[i])
    f = FSDP(m)
    x = torch.randn(3, 4)
    seen = []
    monitor = threading.Thread(target=lambda: (time.sleep(0.3), seen.append(len(list(f.parameters())))))
    monitor.start()
    f(x).pow(2).sum().backward()
    monitor.join()
    ref(x).pow(2).sum().backward()
    assert seen == [3]
    _stepped_alike(f, ref)


class _GradientInForward(nn.Module):
    """Physics-informed style: the forward takes the gradient of an inner instance's output with
    respect to the input (that instance's backward hooks run inside the root's forward)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, 16), nn.Tanh(), nn.Linear(16, 1))
        self.head = nn.Linear(2, 1)

    def forward(self, x):
        u = self.body(x)
        (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
        return self.head(du) + u


@pytest.mark.parametrize("reshard", [True, False])
def test_a_gradient_inside_forward_with_a_penalty_on_the_parameters(reshard):
    torch.manual_seed(0)
    ref = _GradientInForward()
    f = copy.deepcopy(ref)
    f.body = FSDP(f.body, reshard_after_forward=reshard)
    f = FSDP(f, reshard_after_forward=reshard)
    for m in (f, ref):
        for k in range(2):
            x = torch.randn(5, 2, generator=torch.Generator().manual_seed(k)).requires_grad_()
            loss = m(x).pow(2).mean() + 1e-3 * sum(p.pow(2).sum() for p in m.parameters())
            loss.backward()
    _stepped_alike(f, ref)


def test_a_create_graph_gradient_then_a_step_then_a_forward():
    """The full parameters a create_graph=True gradient keeps for its graph are gathered again
    after the optimizer step, not reused."""
    torch.manual_seed(0)
    ref = nn.Linear(4, 2)
    f = FSDP(copy.deepcopy(ref))
    x = torch.randn(3, 4, requires_grad=True)
    outs = []
    for m in (f, ref):
        opt = torch.optim.SGD(m.parameters(), lr=0.5)
        m(x).pow(2).sum().backward()
        torch.autograd.grad(m(x).sum(), x, create_graph=True)  # an input-gradient metric
        opt.step()
        opt.zero_grad()
        if m is f:  # the name shows no values from before the step
            with pytest.raises(RuntimeError, match="summon_full_params"):
                f.module.weight.sum()
        outs.append(m(x).detach())
    torch.testing.assert_close(outs[0], outs[1])


@pytest.mark.parametrize("between", ["nothing", "a no_grad forward", "a forward whose output is dropped"])
@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_gradient_penalty_with_a_forward_before_its_backward(between, checkpointed):
    """Forwards between the create_graph gradient and the backward that uses it keep the full
    parameters' memory its graph reads; activation checkpointing inside the instance recomputes
    from it in that backward."""
    from fairscale_c.nn import checkpoint_wrapper

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
    f = copy.deepcopy(ref)
    f[2] = FSDP(checkpoint_wrapper(f[2]) if checkpointed else f[2])
    f = FSDP(f)
    gen = torch.Generator().manual_seed(3)
    x, x2 = torch.randn(5, 4, generator=gen).requires_grad_(), torch.randn(5, 4, generator=gen)
    for m in (f, ref):
        out = m(x)
        (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        if between == "a no_grad forward":
            with torch.no_grad():
                m(x2)
        elif between != "nothing":
            m(x2)
        (out.pow(2).mean() + ((g.norm(dim=1) - 1) ** 2).mean()).backward()
    _stepped_alike(f, ref)


def test_consolidation_with_a_non_persistent_buffer():
    """The metadata lists the buffers a state dict holds: one registered with persistent=False (a
    causal mask, rotary frequencies) is not in the local weights and is not asked for (it was a
    bare KeyError, as in FairScale); a metadata that lists it names it."""

    class WithBuffers(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("scale", torch.full((4,), 2.0), persistent=False)
            self.register_buffer("shift", torch.ones(4))

        def forward(self, x):
            return self.lin(x) * self.scale + self.shift

    m = FSDP(WithBuffers())
    m(torch.randn(2, 4)).sum().backward()
    weights, meta = m.local_state_dict(), m.local_metadata_dict()
    assert meta["buffer_names"] == ["shift"]
    full = FSDP.consolidate_shard_weights([weights], [meta])
    want = m.state_dict()
    assert sorted(full) == sorted(want), (list(full), list(want))
    for k, v in want.items():
        torch.testing.assert_close(full[k], v, atol=0, rtol=0)
    listed = dict(meta, buffer_names=["scale", "shift"])  # as FairScale's metadata lists them
    with pytest.raises(KeyError, match="buffer 'scale' of the metadata is not in rank 0's weights"):
        FSDP.consolidate_shard_weights([weights], [listed])
    assert "scale" not in FSDP.consolidate_shard_weights([weights], [listed], strict=False)


def test_mixed_precision_inputs_keep_their_gradient():
    """The root's cast of its inputs to the compute dtype is recorded by autograd: a layer before
    the instance trains, and a leaf input gets its gradient (saliency, a gradient penalty)."""
    for dtype in (torch.bfloat16, torch.float16):
        torch.manual_seed(0)
        upstream, body = nn.Linear(4, 4), mlp()
        ref_up, ref_body = copy.deepcopy(upstream), copy.deepcopy(body)
        fsdp = FSDP(body, mixed_precision=True, compute_dtype=dtype)
        x = torch.randn(3, 4, requires_grad=True)
        xr = x.detach().clone().requires_grad_(True)
        fsdp(upstream(x)).float().sum().backward()
        ref_body(ref_up(xr)).sum().backward()
        assert upstream.weight.grad is not None and x.grad is not None, dtype
        assert x.grad.dtype is torch.float32 and upstream.weight.grad.dtype is torch.float32
        tol = dict(atol=5e-2, rtol=5e-2)
        torch.testing.assert_close(upstream.weight.grad, ref_up.weight.grad, **tol)
        torch.testing.assert_close(x.grad, xr.grad, **tol)


def test_half_after_an_eval_forward_and_after_a_no_sync_backward():
    for step in ("eval forward", "no_sync backward"):
        m = FSDP(mlp(), mixed_precision=False)
        if step == "eval forward":
            with torch.no_grad():
                m(torch.randn(2, 4))
        else:
            with m.no_sync():
                m(torch.randn(2, 4)).sum().backward()
        m.half()
        assert m(torch.randn(2, 4).half()).dtype == torch.float16, step


def test_a_dataclass_output_with_an_unset_field():
    import dataclasses

    @dataclasses.dataclass
    class Out:
        y: torch.Tensor
        note: str = dataclasses.field(init=False)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = mlp()

        def forward(self, x):
            return Out(self.net(x))

    m = FSDP(Net())
    m(torch.randn(2, 4)).y.sum().backward()
    assert m.flat_param_0.grad is not None


def test_optimizer_state_written_by_fairscale_with_a_stateless_instance_loads():
    # FairScale numbers the optimizer's flat parameters by position and maps the parameters of
    # one without state (here the frozen middle instance) to None; its loader counts the runs.
    def model():
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2))
        m[1] = FSDP(m[1])
        return FSDP(m)

    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    m[1].flat_param_0.requires_grad_(False)
    m(torch.randn(3, 4)).sum().backward()
    opt.step()
    ours = m.gather_full_optim_state_dict(opt)
    order = [id(p) for p in m.parameters()]
    root_id, inner_id = order.index(id(m.flat_param_0)), order.index(id(m[1].flat_param_0))
    assert ours["local_param_count"] == 2 and set(ours["param_id_map"].values()) == {root_id, inner_id}
    # the same state as FairScale writes it: the stateless flat parameter's ids are None
    fairscale = {
        "state": {},
        "param_groups": ours["param_groups"],
        "param_id_map": {},
        "uncollected_local_ids": [],
    }
    for gid, lid in ours["param_id_map"].items():
        fairscale["param_id_map"][gid] = None if lid == inner_id else lid
        if lid == root_id:
            fairscale["state"][gid] = ours["state"][gid]
    shard = m.get_shard_from_optim_state_dict(copy.deepcopy(fairscale))
    assert shard["param_groups"][0]["params"] == [0, 1]
    loaded = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    loaded.load_state_dict(shard)
    torch.testing.assert_close(
        loaded.state[m.flat_param_0]["momentum_buffer"], opt.state[m.flat_param_0]["momentum_buffer"]
    )
    # our own file: None is a flat parameter the optimizer does not hold
    trainable = torch.optim.SGD([m.flat_param_0], lr=0.1, momentum=0.9)
    m(torch.randn(3, 4)).sum().backward()
    trainable.step()
    own = m.gather_full_optim_state_dict(trainable)
    assert own["local_param_count"] == 1 and None in own["param_id_map"].values()
    again = torch.optim.SGD([m.flat_param_0], lr=0.1, momentum=0.9)
    again.load_state_dict(m.get_shard_from_optim_state_dict(own))
    with pytest.raises(ValueError, match="argument 'optim' holds none of this model's parameters"):
        m.gather_full_optim_state_dict(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))


@pytest.mark.parametrize("order", ["FSDP(checkpoint(block))", "checkpoint(FSDP(block))"])
def test_a_reentrant_checkpoint_around_whole_instances_frees_them_in_backward(order):
    # The whole instance is recomputed and backpropagated in the checkpoint's nested backward:
    # its full parameters are freed there, as in FairScale, not kept to the end of backward.
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(4)]
    if order == "FSDP(checkpoint(block))":
        kids = [FSDP(TorchCheckpointed(b, reentrant=True)) for b in blocks]
        model = FSDP(nn.Sequential(*kids))
    else:
        kids = [FSDP(b) for b in blocks]
        model = FSDP(nn.Sequential(*[TorchCheckpointed(k, reentrant=True) for k in kids]))
    x = torch.randn(2, 8, requires_grad=True)
    held = []
    x.register_hook(lambda g: held.append(sum(h.has_full for k in kids for h in k._handles)))
    model(x).sum().backward()
    assert held == [0], held
    assert all(p.grad is not None for p in model.parameters())


def test_optimizer_state_round_trip_with_a_0d_parameter_first():
    # The state's layout must not be read off a 0-d first parameter: Adam's exp_avg would look
    # like a scalar, and the loaded optimizer would fail at its next step.
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.tensor(1.5))
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return self.lin(x) * self.scale

    torch.manual_seed(0)
    m = FSDP(Scaled())
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    m(torch.randn(2, 4)).sum().backward()
    opt.step()
    before = opt.state_dict()["state"][0]
    shard = m.get_shard_from_optim_state_dict(m.gather_full_optim_state_dict(opt))
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(shard["state"][0][key], before[key])
    opt.load_state_dict(shard)
    m(torch.randn(2, 4)).sum().backward()
    opt.step()


@pytest.mark.parametrize("device", ["meta", "cuda", "cuda:7"])
def test_a_compute_device_this_process_cannot_use_is_refused_before_anything_changes(device):
    if device != "meta" and torch.cuda.is_available() and torch.cuda.device_count() > 7:
        pytest.skip("this process can use that CUDA device")
    m = mlp()
    before = dict(m.named_parameters())
    with pytest.raises(ValueError, match="argument 'compute_device'"):
        FSDP(m, compute_device=device, move_params_to_cpu=True)
    assert dict(m.named_parameters()) == before
    FSDP(m, move_params_to_cpu=True)(torch.randn(2, 4)).sum().backward()  # the retry trains
    if device != "meta":
        with pytest.raises(ValueError, match="argument 'state_dict_device'"):
            FSDP(mlp(), state_dict_device=device)


def test_load_local_state_dict_of_something_else_names_the_argument():
    m = FSDP(mlp())
    with pytest.raises(TypeError, match="argument 'state_dict' must be a mapping .* got NoneType"):
        m.load_local_state_dict(None)


def test_a_layer_reused_in_several_places_and_wrapped_at_each():
    """A module object used in several places, each wrapped (the same layer applied three times;
    a layer shared by an encoder and a decoder that have layers of their own): the instances after
    the first manage no parameters of it and compute with the first's full parameters, which it
    keeps with reshard_after_forward=False. That trains as plain torch, as in FairScale."""
    torch.manual_seed(0)
    layer = nn.Linear(4, 4)
    ref = nn.Sequential(layer, layer, layer)
    m = copy.deepcopy(ref)
    for i in range(3):
        m[i] = FSDP(m[i], reshard_after_forward=False)
    torch.manual_seed(0)
    pair = _EncoderDecoderSharingALayer()
    pair_ref = copy.deepcopy(pair)
    pair.enc = FSDP(pair.enc, reshard_after_forward=False)
    pair.dec = FSDP(pair.dec, reshard_after_forward=False)
    x = torch.randn(3, 4)
    for model, ref_model in (
        (FSDP(m, reshard_after_forward=False), ref),
        (FSDP(pair, reshard_after_forward=False), pair_ref),
    ):
        for mm in (model, ref_model):
            mm(x).sum().backward()
            torch.optim.SGD(mm.parameters(), lr=0.1).step()
        got = model.state_dict()
        for k, v in ref_model.state_dict().items():
            torch.testing.assert_close(got[k], v, msg=k)


class _EncoderDecoderSharingALayer(nn.Module):
    def __init__(self):
        super().__init__()
        shared = nn.Linear(4, 4)
        self.enc = nn.Sequential(shared, nn.ReLU())
        self.dec = nn.Sequential(shared, nn.Linear(4, 2))

    def forward(self, x):
        return self.dec(self.enc(x))


def test_a_process_group_this_rank_is_not_in_is_named():
    import torch.distributed as dist

    with pytest.raises(ValueError, match="argument 'process_group' is GroupMember.NON_GROUP_MEMBER"):
        FSDP(mlp(), process_group=dist.GroupMember.NON_GROUP_MEMBER)


@pytest.mark.parametrize("flatten", [True, False])
def test_training_steps_leave_no_garbage_for_the_cycle_collector(flatten):
    """Loops that turn the collector off (or run it by hand) must not grow: nothing a step makes
    is kept alive by a reference cycle."""
    import gc

    model = mlp()
    model[2] = FSDP(model[2], flatten_parameters=flatten)
    model = FSDP(model, flatten_parameters=flatten)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 4)

    def step():
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()

    step()
    gc.collect()
    gc.disable()
    try:
        for _ in range(20):
            step()
        assert gc.collect() == 0
    finally:
        gc.enable()


class _RaisesInBackward(torch.autograd.Function):
    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if _RaisesInBackward.armed:
            raise RuntimeError("on purpose")
        return g


class _Raiser(nn.Module):
    def forward(self, x):
        return _RaisesInBackward.apply(x)


class _CatchesItsInnerGradient(_GradientInForward):
    """The gradient inside the forward raises inside the inner instance (its pre-backward hook has
    run); the forward catches it and goes on without it."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(2, 16), _Raiser(), nn.Tanh(), nn.Linear(16, 1))

    def forward(self, x):
        u = self.body(x)
        _RaisesInBackward.armed = True
        try:
            torch.autograd.grad(u.sum(), x, create_graph=True)
        except RuntimeError:
            pass
        finally:
            _RaisesInBackward.armed = False
        return self.head(x) + u


@pytest.mark.parametrize("flatten", [True, False])
def test_a_gradient_inside_forward_that_raises_leaves_the_inner_instance_as_its_forward_did(flatten):
    torch.manual_seed(0)
    ref = _CatchesItsInnerGradient()
    f = copy.deepcopy(ref)
    f.body = FSDP(f.body, flatten_parameters=flatten)
    f = FSDP(f, flatten_parameters=flatten)
    x = torch.randn(5, 2).requires_grad_()
    before = list(f.parameters())
    out = f(x)
    assert f.body.training_state.name == "IDLE"
    assert list(f.parameters()) == before  # unflattened too: the inner shards are registered
    f.state_dict()  # allowed: nothing is in backward
    out.pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    _stepped_alike(f, ref)


class _RecordsInputDtypes(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.seen = None

    def forward(self, a, b, c):
        self.seen = (a.dtype, b.dtype, c.dtype)
        return self.lin(a.to(self.lin.weight.dtype)).sum() + b.sum() + c.sum()


def test_which_root_inputs_are_cast():
    """float32, float16 and bfloat16 inputs, to the compute dtype under mixed precision and to
    float32 with force_input_to_fp32; float64 ones pass as they are (FairScale casts float32 only,
    resp. float16 only; a float64 1.7e9 cast to float16 would be inf)."""
    a, b, c = torch.ones(1, 2), torch.tensor([1.7e9], dtype=torch.float64), torch.ones(1, dtype=torch.bfloat16)
    m = FSDP(_RecordsInputDtypes(), mixed_precision=True, compute_dtype=torch.float16)
    m(a, b, c)
    assert m.module.seen == (torch.float16, torch.float64, torch.float16)
    m = FSDP(_RecordsInputDtypes(), force_input_to_fp32=True)
    m(a.half(), b, c)
    assert m.module.seen == (torch.float32, torch.float64, torch.float32)


def test_a_mixed_precision_model_converted_away_from_float32_refuses_to_compute():
    m = FSDP(mlp(), mixed_precision=True, compute_dtype=torch.bfloat16)
    for convert in (m.half, m.bfloat16):
        convert()
        with pytest.raises(RuntimeError, match="mixed_precision=True computes in torch.bfloat16 from float32 shards"):
            m(torch.randn(2, 4))
        m.float()
    m(torch.randn(2, 4)).float().sum().backward()


@pytest.mark.parametrize("reshard", [True, False])
def test_a_backward_computes_with_its_forwards_weights(reshard):
    """An optimizer step between a forward and its backward (which torch refuses) does not make
    the backward gather the stepped shards into the memory the forward computed with."""
    torch.manual_seed(0)
    m = FSDP(nn.Linear(3, 3), reshard_after_forward=reshard)
    with m.summon_full_params():
        weight = m.module.weight.detach().clone()
    x = torch.randn(2, 3, requires_grad=True)
    out = m(x)
    for p in m.parameters():
        p.grad = torch.ones_like(p)
    torch.optim.SGD(m.parameters(), lr=1.0).step()
    out.sum().backward()
    torch.testing.assert_close(x.grad, weight.sum(0).expand(2, 3))
