"""Module wrapping: ``wrap``/``auto_wrap`` driven by an ``enable_wrap`` context, and the wrap policies.

Same semantics as ``fairscale.nn.wrap.auto_wrap`` (FairScale 0.4.13). The wrapper class is a
parameter of the context (``wrapper_cls``), so nothing here depends on FullyShardedDataParallel.

A *policy* is called by ``auto_wrap`` with four keyword arguments and returns a bool:

- ``module``: the module being considered;
- ``recurse``: True to ask "descend into the children of ``module``?", False to ask "wrap
  ``module`` itself?" (asked after its children were handled);
- ``unwrapped_params``: number of parameters of ``module`` not yet inside a wrapper;
- ``module_is_root``: whether ``module`` is the one ``auto_wrap`` was called on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator, Iterable
from typing import Any, Union

from torch import nn

# One module class or an iterable of them (a set in FairScale's signatures).
ModuleClasses = Union[type[nn.Module], Iterable[type[nn.Module]]]


def _class_tuple(classes: ModuleClasses, arg_name: str) -> tuple[type, ...]:
    """``classes`` (one class or an iterable of them) as a tuple for ``isinstance``."""
    if isinstance(classes, type):
        return (classes,)
    try:
        result = tuple(classes)
    except TypeError:
        raise TypeError(f"{arg_name} must be a set of module classes, got {type(classes).__name__}") from None
    for cls in result:
        if not isinstance(cls, type):
            raise TypeError(f"{arg_name} must contain classes, got {cls!r}")
    return result


def default_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    unwrapped_params: int,
    module_is_root: bool,
    min_num_params: int = int(1e8),
    force_leaf_modules: set[type[nn.Module]] | None = None,
    exclude_wrap_modules: set[type[nn.Module]] | None = None,
    skip_params_check_for_root: bool = False,
) -> bool:
    """Size-based policy: descend into and wrap modules with at least ``min_num_params`` unwrapped params.

    The first four parameters are the policy protocol (see the module docstring); bind the
    others with ``functools.partial``.

    Args:
        min_num_params: size threshold, compared with ``>=`` against ``unwrapped_params``.
        force_leaf_modules: module types whose children are never wrapped (not descended into).
            ``None`` means ``default_auto_wrap_policy.FORCE_LEAF_MODULES`` ({MultiheadAttention}).
        exclude_wrap_modules: module types never wrapped themselves (their children may be).
            ``None`` means ``default_auto_wrap_policy.EXCLUDE_WRAP_MODULES`` ({ModuleList, ModuleDict}).
        skip_params_check_for_root: wrap the root whatever its number of unwrapped params
            (it is still subject to ``exclude_wrap_modules``).
    """
    if force_leaf_modules is None:
        force_leaf_modules = default_auto_wrap_policy.FORCE_LEAF_MODULES  # type: ignore[attr-defined]
    if exclude_wrap_modules is None:
        exclude_wrap_modules = default_auto_wrap_policy.EXCLUDE_WRAP_MODULES  # type: ignore[attr-defined]

    # Converted on every call, so a bad set is reported on the first call, whatever the branch.
    leaf_classes = _class_tuple(force_leaf_modules, "force_leaf_modules")
    excluded_classes = _class_tuple(exclude_wrap_modules, "exclude_wrap_modules")

    is_large = unwrapped_params >= min_num_params
    if recurse:
        return is_large and not isinstance(module, leaf_classes)
    wanted = is_large or (module_is_root and skip_params_check_for_root)
    return wanted and not isinstance(module, excluded_classes)


# Function attributes, as in FairScale: importable defaults that callers may also extend in place.
default_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}  # type: ignore[attr-defined]
default_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}  # type: ignore[attr-defined]


def config_auto_wrap_policy(module: nn.Module, recurse: bool, unwrapped_params: int, module_is_root: bool) -> bool:
    """Tag-based policy: always descend; wrap exactly the modules that have a ``wrapper_config`` attribute.

    ``unwrapped_params`` and ``module_is_root`` are ignored. The tag's value (a dict) is also
    used by :func:`wrap` as per-module wrapper arguments.
    """
    if recurse:
        return True
    return hasattr(module, "wrapper_config")


def transformer_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    unwrapped_params: int,
    module_is_root: bool,
    transformer_layer_cls: ModuleClasses | None = None,
) -> bool:
    """Class-based policy, like PyTorch FSDP's: always descend; wrap instances of ``transformer_layer_cls``.

    Bind the classes with ``functools.partial(transformer_auto_wrap_policy,
    transformer_layer_cls={MyBlock})``; a single class is accepted too. Sizes are ignored, and
    the root is wrapped only if it is itself such an instance.
    """
    if transformer_layer_cls is None:
        raise TypeError(
            "transformer_auto_wrap_policy needs transformer_layer_cls; bind it with "
            "functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={...})"
        )
    layer_classes = _class_tuple(transformer_layer_cls, "transformer_layer_cls")
    if recurse:
        return True
    return isinstance(module, layer_classes)


@contextlib.contextmanager
def enable_wrap(auto_wrap_policy: Callable | None = None, **wrapper_kwargs: Any) -> Generator[None, None, None]:
    """Context in which :func:`wrap` and :func:`auto_wrap` wrap modules.

    Usage::

        with enable_wrap(wrapper_cls=FullyShardedDataParallel, **fsdp_config):
            self.l1 = wrap(torch.nn.Linear(5, 5))
            self.l2 = auto_wrap(TransformerBlock(),
                                auto_wrap_policy=functools.partial(default_auto_wrap_policy, min_num_params=1e7))

    Args:
        auto_wrap_policy: policy used by :func:`auto_wrap` when it is given none
            (default: :func:`default_auto_wrap_policy`). Modules passed to :func:`wrap` are always wrapped.
        **wrapper_kwargs: must hold ``wrapper_cls``, the callable that wraps a module as
            ``wrapper_cls(module, **kwargs)``. ``move_module_cuda_half=True`` makes :func:`wrap`
            call ``module.cuda().half()`` first. Everything else is passed to every wrapper.

    Raises:
        NotImplementedError: when already inside an ``enable_wrap`` context (no nesting).
        AssertionError: when ``wrapper_cls`` is missing (FairScale asserts it).
        TypeError: when ``wrapper_cls`` or ``auto_wrap_policy`` is not callable.
    """
    with ConfigAutoWrap(auto_wrap_policy, **wrapper_kwargs):
        yield


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """Wrap ``module`` with the context's ``wrapper_cls``; outside :func:`enable_wrap`, return it unchanged.

    Wrapper arguments are merged with increasing priority from: the :func:`enable_wrap`
    context, ``module.wrapper_config`` (a dict, if the attribute exists), ``wrap_overrides``.
    """
    if not ConfigAutoWrap.in_autowrap_context:
        return module
    module_config: dict[str, Any] = {}
    if hasattr(module, "wrapper_config"):
        module_config = module.wrapper_config
        if not isinstance(module_config, dict):
            raise AssertionError(
                f"wrapper_config of {type(module).__name__} must be a dict of wrapper arguments, "
                f"got {type(module_config).__name__}"
            )
    kwargs = {**ConfigAutoWrap.kwargs, **module_config, **wrap_overrides}
    wrapper_cls = ConfigAutoWrap.wrapper_cls
    if wrapper_cls is None:
        raise AssertionError("wrap(): the enable_wrap context has no wrapper_cls")
    if ConfigAutoWrap.move_module_cuda_half:
        module = module.cuda().half()
    return wrapper_cls(module, **kwargs)


def auto_wrap(module: nn.Module, auto_wrap_policy: Callable | None = None, **kwargs: Any) -> nn.Module:
    """Wrap the submodules of ``module`` (children first) that ``auto_wrap_policy`` selects, then maybe ``module``.

    Outside :func:`enable_wrap` this returns ``module`` unchanged. Children are replaced in
    place (``setattr``); the return value is ``module`` or its wrapper. ``kwargs`` are
    :func:`wrap` overrides for every wrapper created.

    ``auto_wrap`` assumes no submodule is wrapped yet (it counts all parameters as unwrapped),
    so it can run once per module tree; to wrap in several passes, tag modules with
    ``wrapper_config`` and use :func:`config_auto_wrap_policy`.

    Args:
        auto_wrap_policy: see the module docstring; default: the context's policy.

    Raises:
        AssertionError: when ``module`` or one of its submodules is already a ``wrapper_cls``.
    """
    if not ConfigAutoWrap.in_autowrap_context:
        return module
    wrapped, _ = ConfigAutoWrap.recursive_wrap(module, auto_wrap_policy=auto_wrap_policy, module_is_root=True, **kwargs)
    return wrapped


class ConfigAutoWrap:
    """The state of the :func:`enable_wrap` context, kept in class attributes (one context at a time).

    An instance is a context manager: ``with ConfigAutoWrap(policy, wrapper_cls=W, **kw)`` is
    ``with enable_wrap(policy, wrapper_cls=W, **kw)``.
    """

    in_autowrap_context: bool = False
    move_module_cuda_half: bool = False
    wrapper_cls: Callable | None = None
    kwargs: dict[str, Any] = {}  # noqa: RUF012 -- FairScale's class attribute, shadowed per instance
    auto_wrap_policy: Callable | None = None

    def __init__(self, auto_wrap_policy: Callable | None = None, **kwargs: Any) -> None:
        self.auto_wrap_policy = auto_wrap_policy
        self.kwargs = kwargs

    @staticmethod
    def enable_autowrap_context(auto_wrap_policy: Callable | None, kwargs: dict[str, Any]) -> None:
        """Enter the context; ``kwargs`` must hold ``wrapper_cls`` (it is not modified)."""
        if ConfigAutoWrap.in_autowrap_context:
            raise NotImplementedError(
                "You are already within an autowrap context and we currently do not supported nested autowrap."
            )
        # Validate before touching the class state, so a failed enter leaves no context behind.
        if "wrapper_cls" not in kwargs:
            raise AssertionError("enable_wrap() needs wrapper_cls=<class wrapping a module>")
        wrapper_kwargs = dict(kwargs)
        wrapper_cls = wrapper_kwargs.pop("wrapper_cls")
        if not callable(wrapper_cls):
            raise TypeError(f"enable_wrap(): wrapper_cls must be callable, got {wrapper_cls!r}")
        if auto_wrap_policy is not None and not callable(auto_wrap_policy):
            raise TypeError(f"enable_wrap(): auto_wrap_policy must be callable, got {auto_wrap_policy!r}")
        move_module_cuda_half = bool(wrapper_kwargs.pop("move_module_cuda_half", False))

        ConfigAutoWrap.in_autowrap_context = True
        ConfigAutoWrap.move_module_cuda_half = move_module_cuda_half
        ConfigAutoWrap.wrapper_cls = wrapper_cls
        ConfigAutoWrap.auto_wrap_policy = default_auto_wrap_policy if auto_wrap_policy is None else auto_wrap_policy
        ConfigAutoWrap.kwargs = wrapper_kwargs

    @staticmethod
    def disable_autowrap_context() -> None:
        """Leave the context and reset every class attribute to its default."""
        ConfigAutoWrap.in_autowrap_context = False
        ConfigAutoWrap.move_module_cuda_half = False
        ConfigAutoWrap.wrapper_cls = None
        ConfigAutoWrap.kwargs = {}
        ConfigAutoWrap.auto_wrap_policy = None

    def __enter__(self) -> None:
        self.enable_autowrap_context(self.auto_wrap_policy, self.kwargs)

    def __exit__(self, exc_type: object, exc_val: object, exc_tb: object) -> None:
        self.disable_autowrap_context()

    @staticmethod
    def recursive_wrap(
        module: nn.Module, auto_wrap_policy: Callable | None, module_is_root: bool, **kwargs: Any
    ) -> tuple[nn.Module, int]:
        """Wrap the submodules of ``module`` selected by ``auto_wrap_policy`` (default: the context's).

        Returns ``(module or its wrapper, number of parameters now inside wrappers)``; ``kwargs``
        are :func:`wrap` overrides.
        """
        if auto_wrap_policy is None:
            auto_wrap_policy = ConfigAutoWrap.auto_wrap_policy
        if auto_wrap_policy is None:
            raise AssertionError("auto_wrap needs a policy: call it inside enable_wrap() or pass auto_wrap_policy")
        if not callable(auto_wrap_policy):
            raise TypeError(f"auto_wrap_policy must be callable, got {auto_wrap_policy!r}")
        return _recursive_wrap(module, auto_wrap_policy, module_is_root, kwargs)


def _check_not_wrapped(module: nn.Module) -> None:
    """Raise if ``module`` or a submodule is already an instance of the context's wrapper class."""
    wrapper_cls = ConfigAutoWrap.wrapper_cls
    # FairScale allows any callable as wrapper_cls; only a class can be checked with isinstance.
    if not isinstance(wrapper_cls, type):
        return
    for name, child in module.named_modules():
        if isinstance(child, wrapper_cls):
            where = f"submodule '{name}'" if name else "the module itself"
            raise AssertionError(  # noqa: TRY004 -- FairScale asserts here; callers may catch AssertionError
                f"auto_wrap: {where} is already a {wrapper_cls.__name__}; auto_wrap can be applied only once "
                "(to wrap in several passes, set wrapper_config and use config_auto_wrap_policy)"
            )


def _recursive_wrap(
    module: nn.Module, policy: Callable, module_is_root: bool, overrides: dict[str, Any]
) -> tuple[nn.Module, int]:
    # Checked at every level, not once at the root: a submodule shared by two subtrees may have
    # been wrapped while the first one was visited.
    _check_not_wrapped(module)
    num_params = sum(p.numel() for p in module.parameters())
    if not policy(module=module, recurse=True, unwrapped_params=num_params, module_is_root=module_is_root):
        return module, 0

    wrapped_params = 0
    for name, child in module.named_children():
        new_child, child_wrapped = _recursive_wrap(child, policy, False, overrides)
        setattr(module, name, new_child)
        wrapped_params += child_wrapped
    remainder = num_params - wrapped_params
    if policy(module=module, recurse=False, unwrapped_params=remainder, module_is_root=module_is_root):
        # Either a leaf, or the parameters its wrapped children left over are worth a wrapper.
        return wrap(module, **overrides), num_params
    return module, wrapped_params
