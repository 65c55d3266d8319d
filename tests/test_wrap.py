"""fairscale_c.nn.wrap: enable_wrap/wrap/auto_wrap and the wrap policies, with a recording stand-in wrapper.

Expected wrap sets were checked against FairScale 0.4.13's own auto_wrap on the same models.
Parameter counts: Linear(10, 10) has 110, MultiheadAttention(10, 2) has 440, ``Block`` 660.
"""

import functools
import importlib

import pytest
import torch
from torch import nn

from fairscale_c.nn.wrap import (
    ConfigAutoWrap,
    auto_wrap,
    config_auto_wrap_policy,
    default_auto_wrap_policy,
    enable_wrap,
    transformer_auto_wrap_policy,
    wrap,
)


class Recorder(nn.Module):
    """Stand-in for FullyShardedDataParallel: keeps the module and the keyword arguments it got."""

    def __init__(self, module, **kwargs):
        super().__init__()
        self.module = module
        self.kwargs = kwargs

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


class OtherWrapper(Recorder):
    pass


class Block(nn.Module):
    """A transformer-like layer: attention (440 params) and a feed-forward Sequential (220 params)."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(10, 2)
        self.ff = nn.Sequential(lin(), nn.ReLU(), lin())

    def forward(self, x):
        x = x + self.attn(x, x, x, need_weights=False)[0]
        return x + self.ff(x)


def lin():
    return nn.Linear(10, 10)


def nested_seq():
    """660 params: 0, 1, 2.0, 2.1, 2.2.0, 2.2.1 are Linear; 2 (440) and 2.2 (220) are Sequential."""
    return nn.Sequential(lin(), lin(), nn.Sequential(lin(), lin(), nn.Sequential(lin(), lin())))


def with_module_list():
    """440 params: a ModuleList of three Linear, then a Linear."""
    return nn.Sequential(nn.ModuleList([lin(), lin(), lin()]), lin())


def blocks():
    """1430 params: Block, Block, Linear."""
    return nn.Sequential(Block(), Block(), lin())


def wrapped_paths(model):
    """Original dotted paths of every Recorder in ``model`` ("" for the root), wrappers looked through."""
    found = []

    def walk(module, path):
        if isinstance(module, Recorder):
            found.append(path)
            walk(module.module, path)
            return
        for name, child in module.named_children():
            walk(child, f"{path}.{name}" if path else name)

    walk(model, "")
    return found


def run_auto_wrap(model, policy, **overrides):
    with enable_wrap(wrapper_cls=Recorder):
        return auto_wrap(model, auto_wrap_policy=policy, **overrides)


def size_policy(min_num_params, **kwargs):
    return functools.partial(default_auto_wrap_policy, min_num_params=min_num_params, **kwargs)


@pytest.fixture(autouse=True)
def no_leftover_context():
    yield
    leaked = ConfigAutoWrap.in_autowrap_context
    ConfigAutoWrap.disable_autowrap_context()
    assert not leaked, "a test left an enable_wrap context active"


def test_exports():
    # As in FairScale, the package attribute fairscale_c.nn.wrap is shadowed by the wrap() function
    # once fairscale_c.nn re-exports it, so the subpackage is looked up by module name.
    wrap_pkg = importlib.import_module("fairscale_c.nn.wrap")
    assert set(wrap_pkg.__all__) == {
        "auto_wrap",
        "config_auto_wrap_policy",
        "default_auto_wrap_policy",
        "enable_wrap",
        "wrap",
        "transformer_auto_wrap_policy",
        "ConfigAutoWrap",
    }
    assert default_auto_wrap_policy.FORCE_LEAF_MODULES == {nn.MultiheadAttention}
    assert default_auto_wrap_policy.EXCLUDE_WRAP_MODULES == {nn.ModuleList, nn.ModuleDict}


# --- wrap / enable_wrap -------------------------------------------------------------------------


def test_wrap_outside_context_is_a_no_op():
    layer = lin()
    assert wrap(layer, anything=1) is layer
    assert auto_wrap(layer, auto_wrap_policy=size_policy(0)) is layer
    assert not isinstance(layer, Recorder)


def test_wrap_inside_context_uses_wrapper_cls_and_context_kwargs():
    layer = lin()
    with enable_wrap(wrapper_cls=Recorder, flatten_parameters=False, mixed_precision=True):
        wrapped = wrap(layer)
    assert isinstance(wrapped, Recorder)
    assert wrapped.module is layer
    assert wrapped.kwargs == {"flatten_parameters": False, "mixed_precision": True}
    assert wrap(layer) is layer  # the context is gone again


def test_wrap_priority_context_then_wrapper_config_then_overrides():
    layer = lin()
    layer.wrapper_config = {"a": "config", "b": "config"}
    with enable_wrap(wrapper_cls=Recorder, a="context", b="context", c="context"):
        wrapped = wrap(layer, b="override")
    assert wrapped.kwargs == {"a": "config", "b": "override", "c": "context"}


def test_wrap_override_can_be_any_key():
    with enable_wrap(wrapper_cls=Recorder):
        assert wrap(lin(), reshard_after_forward=False).kwargs == {"reshard_after_forward": False}


def test_wrapper_config_must_be_a_dict():
    layer = lin()
    layer.wrapper_config = ["not", "a", "dict"]
    with enable_wrap(wrapper_cls=Recorder), pytest.raises(AssertionError, match="wrapper_config .* must be a dict"):
        wrap(layer)


def test_context_state_is_set_and_reset():
    policy = size_policy(5)
    with enable_wrap(policy, wrapper_cls=Recorder, x=1):
        assert ConfigAutoWrap.in_autowrap_context
        assert ConfigAutoWrap.wrapper_cls is Recorder
        assert ConfigAutoWrap.kwargs == {"x": 1}
        assert ConfigAutoWrap.auto_wrap_policy is policy
        assert not ConfigAutoWrap.move_module_cuda_half
    assert not ConfigAutoWrap.in_autowrap_context
    assert ConfigAutoWrap.wrapper_cls is None
    assert ConfigAutoWrap.kwargs == {}
    assert ConfigAutoWrap.auto_wrap_policy is None


def test_context_default_policy_is_default_auto_wrap_policy():
    with enable_wrap(wrapper_cls=Recorder):
        assert ConfigAutoWrap.auto_wrap_policy is default_auto_wrap_policy


def test_context_is_reset_when_the_body_raises():
    with pytest.raises(RuntimeError, match="boom"), enable_wrap(wrapper_cls=Recorder):
        raise RuntimeError("boom")
    assert not ConfigAutoWrap.in_autowrap_context
    assert wrap(lin()).__class__ is nn.Linear


def test_nested_enable_wrap_raises_and_keeps_the_outer_context():
    with enable_wrap(wrapper_cls=Recorder, level="outer"):
        with pytest.raises(NotImplementedError, match="nested autowrap"), enable_wrap(wrapper_cls=OtherWrapper):
            pass
        wrapped = wrap(lin())
    assert type(wrapped) is Recorder
    assert wrapped.kwargs == {"level": "outer"}


def test_config_auto_wrap_class_is_a_context_manager_and_reusable():
    ctx = ConfigAutoWrap(None, wrapper_cls=Recorder, x=2)
    for _ in range(2):
        with ctx:
            assert wrap(lin()).kwargs == {"x": 2}
    assert ctx.kwargs == {"wrapper_cls": Recorder, "x": 2}


def test_enable_wrap_without_wrapper_cls_raises_and_leaves_no_context():
    with pytest.raises(AssertionError, match="wrapper_cls"), enable_wrap(flatten_parameters=True):
        pass
    assert not ConfigAutoWrap.in_autowrap_context
    with enable_wrap(wrapper_cls=Recorder):  # a later context still works
        assert isinstance(wrap(lin()), Recorder)


@pytest.mark.parametrize("bad", [None, 3, "Recorder"])
def test_enable_wrap_rejects_a_non_callable_wrapper_cls(bad):
    with pytest.raises(TypeError, match="wrapper_cls must be callable"), enable_wrap(wrapper_cls=bad):
        pass
    assert not ConfigAutoWrap.in_autowrap_context


def test_enable_wrap_rejects_a_non_callable_policy():
    with pytest.raises(TypeError, match="auto_wrap_policy must be callable"), enable_wrap(1e8, wrapper_cls=Recorder):
        pass
    assert not ConfigAutoWrap.in_autowrap_context


def test_auto_wrap_rejects_a_non_callable_policy():
    with enable_wrap(wrapper_cls=Recorder), pytest.raises(TypeError, match="auto_wrap_policy must be callable"):
        auto_wrap(lin(), auto_wrap_policy="big")


def test_move_module_cuda_half_is_applied_before_wrapping_and_not_passed_on():
    calls = []

    class FakeCudaLinear(nn.Linear):
        def cuda(self, device=None):
            calls.append("cuda")
            return self

    layer = FakeCudaLinear(4, 4)
    with enable_wrap(wrapper_cls=Recorder, move_module_cuda_half=True, x=1):
        assert ConfigAutoWrap.move_module_cuda_half
        wrapped = wrap(layer)
    assert calls == ["cuda"]
    assert wrapped.module.weight.dtype == torch.float16
    assert wrapped.kwargs == {"x": 1}
    assert not ConfigAutoWrap.move_module_cuda_half


# --- auto_wrap with default_auto_wrap_policy ----------------------------------------------------


@pytest.mark.parametrize(
    "min_num_params, expected",
    [
        (0, ["", "0", "1", "2", "2.0", "2.1", "2.2", "2.2.0", "2.2.1"]),
        (110, ["0", "1", "2.0", "2.1", "2.2.0", "2.2.1"]),
        # 2.2 (220) is wrapped whole; 2 and the root then each have 220 params left over.
        (111, ["", "2", "2.2"]),
        (220, ["", "2", "2.2"]),
        (221, ["2"]),
        (550, [""]),
        (661, []),
        (int(1e8), []),
    ],
)
def test_auto_wrap_thresholds_on_nested_sequential(min_num_params, expected):
    assert wrapped_paths(run_auto_wrap(nested_seq(), size_policy(min_num_params))) == expected


@pytest.mark.parametrize(
    "min_num_params, skip_root, expected",
    [
        (221, False, ["2"]),
        (221, True, ["", "2"]),  # the root's 220 left-over params no longer matter
        (661, True, []),  # too small to recurse into at all, so the root is never considered
    ],
)
def test_skip_params_check_for_root(min_num_params, skip_root, expected):
    policy = size_policy(min_num_params, skip_params_check_for_root=skip_root)
    assert wrapped_paths(run_auto_wrap(nested_seq(), policy)) == expected


@pytest.mark.parametrize(
    "min_num_params, expected",
    [
        (110, ["0.0", "0.1", "0.2", "1"]),
        # The ModuleList (330) is big enough but excluded, so its params fall to the root.
        (111, [""]),
        (441, []),
    ],
)
def test_module_list_is_never_wrapped_itself(min_num_params, expected):
    assert wrapped_paths(run_auto_wrap(with_module_list(), size_policy(min_num_params))) == expected


def test_module_list_is_wrapped_when_not_excluded():
    policy = size_policy(111, exclude_wrap_modules=set())
    assert wrapped_paths(run_auto_wrap(with_module_list(), policy)) == ["0"]


def test_module_dict_is_excluded_even_as_root():
    model = nn.ModuleDict({"a": lin(), "b": nn.Sequential(lin(), lin())})
    assert wrapped_paths(run_auto_wrap(model, size_policy(111, skip_params_check_for_root=True))) == ["b"]


def test_exclude_wrap_modules_is_customisable():
    def model():
        return nn.Sequential(nn.MultiheadAttention(10, 2), lin())

    assert wrapped_paths(run_auto_wrap(model(), size_policy(100))) == ["", "1"]
    assert wrapped_paths(run_auto_wrap(model(), size_policy(100, exclude_wrap_modules={nn.Sequential}))) == ["1"]


def test_force_leaf_module_is_neither_entered_nor_wrapped():
    # attn (440) is a forced leaf: its params stay in the Block's remainder (440), so the Block is wrapped.
    assert wrapped_paths(run_auto_wrap(blocks(), size_policy(100))) == [
        "0",
        "0.ff.0",
        "0.ff.2",
        "1",
        "1.ff.0",
        "1.ff.2",
        "2",
    ]


def test_force_leaf_modules_is_customisable():
    assert wrapped_paths(run_auto_wrap(blocks(), size_policy(100, force_leaf_modules=set()))) == [
        "0.attn",
        "0.attn.out_proj",
        "0.ff.0",
        "0.ff.2",
        "1.attn",
        "1.attn.out_proj",
        "1.ff.0",
        "1.ff.2",
        "2",
    ]


def test_default_sets_are_read_at_call_time(monkeypatch):
    monkeypatch.setattr(default_auto_wrap_policy, "EXCLUDE_WRAP_MODULES", {nn.Linear})
    assert wrapped_paths(run_auto_wrap(nested_seq(), size_policy(110))) == ["", "2", "2.2"]


def test_default_policy_decisions():
    seq, mha = nn.Sequential(), nn.MultiheadAttention(10, 2)
    call = functools.partial(default_auto_wrap_policy, min_num_params=10)
    assert call(seq, recurse=True, unwrapped_params=10, module_is_root=False)
    assert not call(seq, recurse=True, unwrapped_params=9, module_is_root=False)
    assert not call(mha, recurse=True, unwrapped_params=10**9, module_is_root=False)
    assert call(mha, recurse=False, unwrapped_params=10, module_is_root=False)
    assert not call(nn.ModuleList(), recurse=False, unwrapped_params=10**9, module_is_root=False)
    assert not call(seq, recurse=False, unwrapped_params=0, module_is_root=True)
    assert call(seq, recurse=False, unwrapped_params=0, module_is_root=True, skip_params_check_for_root=True)
    assert not call(seq, recurse=False, unwrapped_params=0, module_is_root=False, skip_params_check_for_root=True)
    # The default threshold is 1e8.
    assert not default_auto_wrap_policy(seq, True, int(1e8) - 1, False)
    assert default_auto_wrap_policy(seq, True, int(1e8), False)


@pytest.mark.parametrize("arg", ["force_leaf_modules", "exclude_wrap_modules"])
def test_default_policy_rejects_bad_class_sets(arg):
    with pytest.raises(TypeError, match=f"{arg} must"):
        default_auto_wrap_policy(
            nn.Sequential(), recurse=True, unwrapped_params=5, module_is_root=True, min_num_params=1, **{arg: 3}
        )
    with pytest.raises(TypeError, match=f"{arg} must contain classes"):
        default_auto_wrap_policy(
            nn.Sequential(),
            recurse=False,
            unwrapped_params=5,
            module_is_root=True,
            min_num_params=1,
            **{arg: {"Linear"}},
        )


def test_context_policy_is_used_when_auto_wrap_gets_none():
    with enable_wrap(size_policy(111), wrapper_cls=Recorder):
        model = auto_wrap(nested_seq())
    assert wrapped_paths(model) == ["", "2", "2.2"]
    with enable_wrap(wrapper_cls=Recorder):  # default policy: 1e8 params, nothing here is that big
        model = auto_wrap(nested_seq())
    assert wrapped_paths(model) == []


def test_auto_wrap_argument_beats_context_policy():
    with enable_wrap(size_policy(0), wrapper_cls=Recorder):
        model = auto_wrap(nested_seq(), auto_wrap_policy=size_policy(221))
    assert wrapped_paths(model) == ["2"]


def test_auto_wrap_kwargs_reach_every_wrapper():
    with enable_wrap(wrapper_cls=Recorder, ctx=1, shared="context"):
        model = auto_wrap(nested_seq(), auto_wrap_policy=size_policy(111), shared="auto_wrap")
    wrappers = [m for m in model.modules() if isinstance(m, Recorder)]
    assert len(wrappers) == 3
    assert all(w.kwargs == {"ctx": 1, "shared": "auto_wrap"} for w in wrappers)


def test_auto_wrap_replaces_children_in_place_and_keeps_the_output():
    torch.manual_seed(0)
    model = nested_seq()
    x = torch.randn(3, 10)
    expected = model(x)
    inner = model[2]
    wrapped = run_auto_wrap(model, size_policy(221))
    assert wrapped is model  # the root itself was not wrapped
    assert isinstance(model[2], Recorder) and model[2].module is inner
    torch.testing.assert_close(wrapped(x), expected)


def test_auto_wrap_of_blocks_keeps_the_output():
    torch.manual_seed(0)
    model = blocks()
    x = torch.randn(4, 2, 10)
    expected = model(x)
    wrapped = run_auto_wrap(model, size_policy(100))
    assert isinstance(wrapped[0], Recorder)
    torch.testing.assert_close(wrapped(x), expected)


def test_policy_protocol_calls():
    model = nn.Sequential(lin(), nn.Sequential(lin(), lin()))
    names = {id(m): name or "<root>" for name, m in model.named_modules()}
    calls = []

    def policy(module, recurse, unwrapped_params, module_is_root):
        calls.append((names[id(module)], recurse, unwrapped_params, module_is_root))
        return unwrapped_params >= 111

    assert wrapped_paths(run_auto_wrap(model, policy)) == ["1"]
    assert calls == [
        ("<root>", True, 330, True),
        ("0", True, 110, False),
        ("1", True, 220, False),
        ("1.0", True, 110, False),
        ("1.1", True, 110, False),
        ("1", False, 220, False),
        ("<root>", False, 110, True),  # 330 minus the 220 wrapped in "1"
    ]


def test_shared_parameters_are_counted_once_per_module():
    def model():
        shared = lin()
        return nn.Sequential(nn.Sequential(shared, lin()), nn.Sequential(shared, lin()))

    # Each child counts 220; the root counts 330 (the shared Linear once), leaving 330 - 440 < 0.
    assert wrapped_paths(run_auto_wrap(model(), size_policy(111))) == ["0", "1"]
    assert wrapped_paths(run_auto_wrap(model(), size_policy(221))) == [""]


# --- already-wrapped modules --------------------------------------------------------------------


def test_each_module_is_wrapped_at_most_once():
    model = run_auto_wrap(nested_seq(), size_policy(0))
    wrapped_modules = [m.module for m in model.modules() if isinstance(m, Recorder)]
    assert len(wrapped_modules) == 9
    assert len({id(m) for m in wrapped_modules}) == 9
    assert not any(isinstance(m, Recorder) for m in wrapped_modules)


def test_auto_wrap_refuses_an_already_wrapped_child():
    model = nn.Sequential(Recorder(lin()), lin())
    with enable_wrap(wrapper_cls=Recorder), pytest.raises(AssertionError, match="submodule '0' is already a Recorder"):
        auto_wrap(model, auto_wrap_policy=size_policy(0))


def test_auto_wrap_refuses_an_already_wrapped_root():
    with enable_wrap(wrapper_cls=Recorder), pytest.raises(AssertionError, match="module itself is already a Recorder"):
        auto_wrap(Recorder(lin()), auto_wrap_policy=size_policy(10**9))


def test_auto_wrap_cannot_run_twice_on_the_same_tree():
    with enable_wrap(wrapper_cls=Recorder):
        model = auto_wrap(nested_seq(), auto_wrap_policy=size_policy(221))
        with pytest.raises(AssertionError, match="already a Recorder"):
            auto_wrap(model, auto_wrap_policy=size_policy(221))


def test_submodule_shared_between_subtrees_is_caught_once_wrapped():
    # "0.0" and "1.0" are the same Sequential: wrapping its Linear under "0" wraps it under "1" too.
    common = nn.Sequential(lin())
    model = nn.Sequential(nn.Sequential(common, lin()), nn.Sequential(common, lin()))
    with enable_wrap(wrapper_cls=Recorder), pytest.raises(AssertionError, match="already a Recorder"):
        auto_wrap(model, auto_wrap_policy=size_policy(100))


def test_only_instances_of_the_context_wrapper_count_as_wrapped():
    # OtherWrapper subclasses Recorder, so it counts as wrapped when wrapper_cls is Recorder...
    model = nn.Sequential(OtherWrapper(lin()), lin())
    with enable_wrap(wrapper_cls=Recorder), pytest.raises(AssertionError, match="submodule '0' is already a Recorder"):
        auto_wrap(model, auto_wrap_policy=size_policy(0))
    # ...but a Recorder is not an OtherWrapper: it is then an ordinary module, entered and kept.
    model = nn.Sequential(Recorder(lin()), lin())
    with enable_wrap(wrapper_cls=OtherWrapper):
        wrapped = auto_wrap(model, auto_wrap_policy=size_policy(110))
    assert wrapped is model
    assert type(model[0]) is Recorder and type(model[0].module) is OtherWrapper
    assert type(model[1]) is OtherWrapper


def test_wrapper_cls_may_be_a_factory_function():
    def factory(module, **kwargs):
        return Recorder(module, via="factory", **kwargs)

    with enable_wrap(wrapper_cls=factory):
        model = auto_wrap(nested_seq(), auto_wrap_policy=size_policy(221))
    assert wrapped_paths(model) == ["2"]
    assert model[2].kwargs == {"via": "factory"}


# --- config_auto_wrap_policy --------------------------------------------------------------------


def test_config_auto_wrap_policy_wraps_tagged_modules_with_their_config():
    model = nn.Sequential(lin(), nn.Sequential(lin(), lin()), lin())
    model[1].wrapper_config = {"a": 1}
    model[1][0].wrapper_config = {"b": 2}
    model[2].wrapper_config = {}
    with enable_wrap(config_auto_wrap_policy, wrapper_cls=Recorder, ctx=1):
        wrapped = auto_wrap(model)
    assert wrapped_paths(wrapped) == ["1", "1.0", "2"]
    assert wrapped[1].kwargs == {"ctx": 1, "a": 1}
    assert wrapped[1].module[0].kwargs == {"ctx": 1, "b": 2}
    assert wrapped[2].kwargs == {"ctx": 1}


def test_config_auto_wrap_policy_ignores_sizes_and_root_flag():
    assert config_auto_wrap_policy(nn.MultiheadAttention(10, 2), True, 0, False)
    assert not config_auto_wrap_policy(nn.Linear(1000, 1000), False, 10**9, True)
    tagged = nn.ModuleList()
    tagged.wrapper_config = {}
    assert config_auto_wrap_policy(tagged, False, 0, False)


def test_config_policy_wraps_a_tagged_root_and_force_leaf_types():
    model = nn.Sequential(nn.MultiheadAttention(10, 2), lin())
    model.wrapper_config = {"root": True}
    model[0].wrapper_config = {}
    wrapped = run_auto_wrap(model, config_auto_wrap_policy)
    assert wrapped_paths(wrapped) == ["", "0"]
    assert wrapped.kwargs == {"root": True}


# --- transformer_auto_wrap_policy ---------------------------------------------------------------


def test_transformer_policy_wraps_only_layer_instances():
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    torch.manual_seed(0)
    model = blocks()
    x = torch.randn(4, 2, 10)
    expected = model(x)
    wrapped = run_auto_wrap(model, policy)
    assert wrapped_paths(wrapped) == ["0", "1"]
    torch.testing.assert_close(wrapped(x), expected)


def test_transformer_policy_recurses_into_layers_and_accepts_one_class():
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block, nn.Linear})
    assert wrapped_paths(run_auto_wrap(blocks(), policy)) == [
        "0",
        "0.attn.out_proj",
        "0.ff.0",
        "0.ff.2",
        "1",
        "1.attn.out_proj",
        "1.ff.0",
        "1.ff.2",
        "2",
    ]
    single = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=nn.Sequential)
    assert wrapped_paths(run_auto_wrap(nested_seq(), single)) == ["", "2", "2.2"]


def test_transformer_policy_ignores_sizes():
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=[Block])
    assert not policy(nn.Linear(1000, 1000), recurse=False, unwrapped_params=10**9, module_is_root=True)
    assert policy(Block(), recurse=False, unwrapped_params=0, module_is_root=False)
    assert policy(nn.Linear(1, 1), recurse=True, unwrapped_params=0, module_is_root=False)


def test_transformer_policy_needs_layer_classes():
    with pytest.raises(TypeError, match="needs transformer_layer_cls"):
        transformer_auto_wrap_policy(lin(), recurse=True, unwrapped_params=110, module_is_root=True)
    with pytest.raises(TypeError, match="transformer_layer_cls must contain classes"):
        transformer_auto_wrap_policy(lin(), True, 110, True, transformer_layer_cls={"Block"})
    with pytest.raises(TypeError, match="transformer_layer_cls must be a set"):
        transformer_auto_wrap_policy(lin(), True, 110, True, transformer_layer_cls=Block())
