"""FlattenParamsWrapper and FlatParameter with FairScale 0.4.13's API.

``FlattenParamsWrapper(module, param_list=None, flat_param_names=None)`` replaces the module's
parameters (all of them, or the groups in ``param_list``) by one flat parameter per group,
registered on the wrapper as ``flat_param_<name>``; the module's attributes become views into
it, so the module computes as before while an optimizer sees one tensor per group. A parameter
shared by several modules is stored once. ``state_dict()`` has the module's own keys (the flat
one with ``flat_state_dict()``), ``load_state_dict`` takes either, and ``unflatten_params()``
gives the module real parameters again for the length of a ``with`` block.

FSDP here flattens in its own way (fairscale_c.nn.data_parallel.flat_param); this wrapper is the
stand-alone module FairScale users build on.
"""

from __future__ import annotations

import contextlib
import copy
from itertools import chain
from typing import Any, Dict, Generator, Iterator, List, Optional, Sequence, Set, Tuple, Union

import torch
from torch import Tensor, nn

__all__ = ["FlatParameter", "FlattenParamsWrapper"]

ParamInfo = Tuple[str, nn.Module, str]  # (module name under the wrapper, module, attribute)
SharedParamInfo = Tuple[str, str, nn.Module, str, nn.Module, str]  # the user, then the owner

_MODULE = "_fpw_module"
_FLAT_PREFIX = "flat_param_"


class FlatParameter(nn.Parameter):
    """One parameter holding several, flattened and concatenated in order; ``get_param_views``
    gives them back as views with their shapes."""

    def __new__(cls, params: Sequence[Tensor], requires_grad: bool = True) -> "FlatParameter":
        if not isinstance(params, (list, tuple)) or len(params) == 0:
            raise ValueError("FlatParameter: argument 'params' must be a non-empty list or tuple of Parameters")
        if not all(isinstance(p, Tensor) for p in params):
            kinds = sorted({type(p).__name__ for p in params if not isinstance(p, Tensor)})
            raise ValueError(f"FlatParameter: argument 'params' must hold Parameters, got {', '.join(kinds)}")
        if any(isinstance(p, FlatParameter) for p in params):
            raise ValueError("FlatParameter: argument 'params' holds a FlatParameter; nesting is not supported")
        if len({(p.dtype, p.device) for p in params}) > 1:
            found = sorted({f"{p.dtype} on {p.device}" for p in params})
            raise ValueError(f"FlatParameter: the parameters must share one dtype and device, got {', '.join(found)}")
        data = torch.cat([p.detach().reshape(-1) for p in params])
        return super().__new__(cls, data, requires_grad=requires_grad)

    def __init__(self, params: Sequence[Tensor], requires_grad: bool = True) -> None:
        self._param_numels: List[int] = [p.numel() for p in params]
        self._param_shapes: List[torch.Size] = [p.size() for p in params]
        # Filled in by FlattenParamsWrapper.
        self._param_infos: List[ParamInfo] = []
        self._shared_param_infos: List[SharedParamInfo] = []

    def get_param_views(self, external_data: Optional[Tensor] = None) -> Iterator[Tensor]:
        """Views of this parameter's data (or of `external_data`, of the same size) shaped as
        the parameters it was made from."""
        data = self if external_data is None else external_data
        total = sum(self._param_numels)
        if data.numel() != total:
            raise ValueError(f"FlatParameter.get_param_views: the data has {data.numel()} elements, expected {total}")
        return (piece.view(shape) for piece, shape in zip(data.split(self._param_numels), self._param_shapes))

    def metadata(self) -> Tuple[List[str], List[torch.Size], List[int]]:
        """(names, shapes, numels) of the parameters held, names as ``module.attribute``."""
        names = [f"{m}.{n}" if m else n for m, _, n in self._param_infos]
        return names, self._param_shapes, self._param_numels

    def _state(self) -> tuple:
        return (self._param_numels, self._param_shapes, self._param_infos, self._shared_param_infos)

    def __setstate__(self, state: tuple) -> None:
        self._param_numels, self._param_shapes, self._param_infos, self._shared_param_infos = state

    def __reduce_ex__(self, proto: int) -> tuple:
        # Rebuilt from its data as a one-tensor list, then given its metadata back.
        return (FlatParameter, ([self.data], self.requires_grad), self._state())

    def __deepcopy__(self, memo: Dict[int, Any]) -> "FlatParameter":
        if id(self) in memo:
            return memo[id(self)]
        result = FlatParameter([self.data.clone(memory_format=torch.preserve_format)], self.requires_grad)
        memo[id(self)] = result

        # Modules already copied (a wrapper being copied) map to their copies; copied alone, the
        # parameter keeps naming the modules it came from.
        def mod(m: nn.Module) -> nn.Module:
            return memo.get(id(m), m)

        infos = [(name, mod(m), n) for name, m, n in self._param_infos]
        shared = [(a, b, mod(m), n, mod(o), on) for a, b, m, n, o, on in self._shared_param_infos]
        result.__setstate__((list(self._param_numels), list(self._param_shapes), infos, shared))
        return result


class FlattenParamsWrapper(nn.Module):
    """Flatten `module`'s parameters into one FlatParameter per group.

    Args:
        module: the module to wrap.
        param_list: the parameters to flatten: None for all of them, a list of Parameters for
            one group, a list of such lists for several (a parameter may not be in two groups);
            an empty list flattens nothing.
        flat_param_names: one name per group (the group's flat parameter is then
            ``flat_param_<name>``); default ``0``, ``1``, ...
    """

    def __init__(
        self,
        module: nn.Module,
        param_list: Optional[Union[List[List[nn.Parameter]], List[nn.Parameter]]] = None,
        flat_param_names: Optional[List[str]] = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"FlattenParamsWrapper: argument 'module' must be an nn.Module, got {type(module).__name__}"
            )
        self._fpw_module = module
        self.is_flattened = False
        self._auto_unflatten_state_dict = True

        groups = _groups_of(module, param_list)
        self.num_params_managed = sum(len(g) for g in groups)
        everyone: Set[nn.Parameter] = set().union(*groups) if groups else set()
        if len(everyone) != self.num_params_managed:
            raise ValueError(
                "FlattenParamsWrapper: argument 'param_list' puts a parameter in two groups; a flat parameter cannot "
                "share part of itself with another"
            )
        # Each group as the (module, attribute) places that hold its parameters: a shared
        # parameter appears under every module that holds it. Groups that no module holds drop out.
        self._param_sets: List[Set[Tuple[nn.Module, str]]] = []
        for group in groups:
            places = {(m, n) for m in self.modules() for n, p in m.named_parameters(recurse=False) if p in group}
            if places:
                self._param_sets.append(places)

        # any names, ints too, as FairScale's (it formats them into the attribute names)
        names = [str(n) for n in (range(len(self._param_sets)) if flat_param_names is None else flat_param_names)]
        if len(names) != len(self._param_sets):
            raise ValueError(
                f"FlattenParamsWrapper: argument 'flat_param_names' has {len(names)} names for "
                f"{len(self._param_sets)} groups of parameters"
            )
        if len(set(names)) != len(names):
            raise ValueError("FlattenParamsWrapper: argument 'flat_param_names' must hold unique names")
        self.flat_param_names = [_FLAT_PREFIX + n for n in names]

        flat_params: List[nn.Parameter] = []
        for places in self._param_sets:
            params, infos, shared = self._describe(places)
            flat = FlatParameter(params, params[0].requires_grad)
            flat._param_infos, flat._shared_param_infos = infos, shared
            flat_params.append(flat)
        self.flat_params: List[nn.Parameter] = []
        self._flatten_params(flat_params)

        self._register_state_dict_hook(_strip_module_prefix)
        self._register_load_state_dict_pre_hook(_add_module_prefix)

    # ------------------------------------------------------------------ set-up

    def _describe(
        self, places: Set[Tuple[nn.Module, str]]
    ) -> Tuple[List[Tensor], List[ParamInfo], List[SharedParamInfo]]:
        """The group's distinct parameters in module order, where each lives, and where the
        shared ones are used again."""
        params: List[Tensor] = []
        infos: List[ParamInfo] = []
        shared: List[SharedParamInfo] = []
        first: Dict[nn.Parameter, ParamInfo] = {}
        for name, m in self.named_modules():
            for n, p in m.named_parameters(recurse=False):
                if (m, n) not in places:
                    continue
                if p in first:
                    owner_name, owner, owner_attr = first[p]
                    shared.append((name, owner_name, m, n, owner, owner_attr))
                else:
                    first[p] = (name, m, n)
                    infos.append((name, m, n))
                    params.append(p)
        # One dtype and device per group: FlatParameter refuses anything else.
        if len({p.requires_grad for p in params}) > 1:
            raise ValueError("FlattenParamsWrapper: a group's parameters must all require grad, or none")
        return params, infos, shared

    # ------------------------------------------------------------------ flat <-> unflat

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._fpw_module

    @property
    def flat_param(self) -> nn.Parameter:
        """The flat parameter, where there is exactly one."""
        if len(self.flat_params) != 1:  # not AttributeError: nn.Module would look for it elsewhere
            raise RuntimeError(
                f"FlattenParamsWrapper.flat_param: there are {len(self.flat_params)} flat parameters; use flat_params"
            )
        return self.flat_params[0]

    @property
    def _param_infos(self) -> Iterator[ParamInfo]:
        return chain.from_iterable(p._param_infos for p in self.flat_params)

    @property
    def _shared_param_infos(self) -> Iterator[SharedParamInfo]:
        return chain.from_iterable(p._shared_param_infos for p in self.flat_params)

    def _flatten_params(self, flat_params: List[nn.Parameter]) -> None:
        """Register `flat_params` and turn the module's parameters into views of them."""
        assert not self.is_flattened
        for name, flat in zip(self.flat_param_names, flat_params):
            self.register_parameter(name, flat)
        self.flat_params = flat_params
        self.is_flattened = True
        for _, m, n in self._param_infos:
            delattr(m, n)
        for _, _, m, n, _, _ in self._shared_param_infos:
            delattr(m, n)
        self._unflatten_params_as_views()

    def _unflatten_params(self, external_data: Optional[List[Optional[Tensor]]] = None) -> None:
        """Give the module real parameters again (sharing memory with the flat parameters or
        with `external_data`) and drop the flat parameters from the wrapper."""
        views = list(self.get_param_views(external_data))
        infos, shared = list(self._param_infos), list(self._shared_param_infos)
        for (_, m, n), view in zip(infos, views):
            if hasattr(m, n):
                delattr(m, n)
            m.register_parameter(n, nn.Parameter(view))
        for _, _, m, n, owner, owner_attr in shared:
            if hasattr(m, n):
                delattr(m, n)
            m.register_parameter(n, getattr(owner, owner_attr))
        self._fpw_module.__dict__.pop("_unflattened_param_views", None)
        for name in self.flat_param_names:
            delattr(self, name)
        self.flat_params = []
        self.is_flattened = False

    def _unflatten_params_as_views(self) -> None:
        """Point the module's attributes at fresh views of the flat parameters (autograd then
        reaches the flat parameters from this forward)."""
        assert self.is_flattened
        views = list(self.get_param_views())
        for (_, m, n), view in zip(self._param_infos, views):
            setattr(m, n, view)  # a plain attribute: the name is no longer a parameter
        self._fpw_module._unflattened_param_views = views
        for _, _, m, n, owner, owner_attr in self._shared_param_infos:
            setattr(m, n, getattr(owner, owner_attr))

    @contextlib.contextmanager
    def unflatten_params(self, flat_params: Optional[List[Tensor]] = None) -> Generator[None, None, None]:
        """Inside, the module has its own parameters again: views of the flat parameters, or of
        `flat_params` (one tensor per flat parameter, used only inside), so that changes made
        inside land there. A wrapper already unflattened stays so."""
        if flat_params is not None and not self.is_flattened:
            raise ValueError("FlattenParamsWrapper.unflatten_params: argument 'flat_params' needs a flattened wrapper")
        was_flat = self.is_flattened
        if was_flat:
            kept = self.flat_params
            self._unflatten_params(flat_params)
        try:
            yield
        finally:
            if was_flat:
                self._flatten_params(kept)

    def get_param_views(self, external_data_list: Optional[List[Optional[Tensor]]] = None) -> Iterator[Tensor]:
        """Views shaped as the original parameters, of every flat parameter in turn (or of the
        tensors of `external_data_list`, one per flat parameter, None for its own data)."""
        if external_data_list is None:
            external_data_list = [None] * len(self.flat_params)
        if len(external_data_list) != len(self.flat_params):
            raise ValueError(
                f"FlattenParamsWrapper.get_param_views: argument 'external_data_list' has {len(external_data_list)} "
                f"entries for {len(self.flat_params)} flat parameters"
            )
        return chain.from_iterable(p.get_param_views(d) for p, d in zip(self.flat_params, external_data_list))

    def metadata(self, flat_param_idx: int) -> Tuple[List[str], Sequence[torch.Size], List[int]]:
        """(names, shapes, numels) of the parameters in flat parameter `flat_param_idx`."""
        return self.flat_params[flat_param_idx].metadata()

    def __deepcopy__(self, memo: Dict[int, Any]) -> "FlattenParamsWrapper":
        # The module's attributes are views that autograd tracks, which deepcopy refuses: copy
        # the unflattened wrapper (real parameters), then flatten both again.
        flats, was_flat = self.flat_params, self.is_flattened
        if was_flat:
            self._unflatten_params()
        try:
            twin = type(self).__new__(type(self))
            memo[id(self)] = twin
            for key, value in self.__dict__.items():
                twin.__dict__[key] = copy.deepcopy(value, memo)
            twin_flats = [copy.deepcopy(f, memo) for f in flats]  # their places map to twin's modules
        finally:
            if was_flat:
                self._flatten_params(flats)
        if was_flat:
            twin._flatten_params(twin_flats)
        return twin

    # ------------------------------------------------------------------ module protocol

    def forward(self, *inputs: Any, **kwinputs: Any) -> Any:
        self._unflatten_params_as_views()
        return self._fpw_module(*inputs, **kwinputs)

    def __getattr__(self, name: str) -> Any:
        """Attributes missing here come from the wrapped module."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._fpw_module, name)

    def __getitem__(self, key: int) -> Any:
        return self._fpw_module[key]

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The module's own state dict (its parameter names); ``flat_state_dict()`` for the
        flat parameters instead."""
        if self.is_flattened and self._auto_unflatten_state_dict:
            with self.unflatten_params():
                return super().state_dict(*args, **kwargs)
        return super().state_dict(*args, **kwargs)

    def flat_state_dict(self, *args: Any, **kwargs: Any) -> Dict[str, Any]:
        """The state dict with the flat parameters (``flat_param_<name>``) in place of the module's."""
        if not self.is_flattened:
            raise RuntimeError("FlattenParamsWrapper.flat_state_dict: the wrapper is unflattened (in unflatten_params)")
        auto, self._auto_unflatten_state_dict = self._auto_unflatten_state_dict, False
        try:
            return self.state_dict(*args, **kwargs)
        finally:
            self._auto_unflatten_state_dict = auto

    def load_state_dict(self, state_dict: Dict[str, Tensor], strict: bool = True, **kwargs: Any) -> Any:
        """Load a flat state dict (keys ``flat_param_*``, or the single ``flat_param`` of older
        versions) or the module's own."""
        flat = any(k.startswith(_FLAT_PREFIX) for k in state_dict)
        if self.num_params_managed > 0 and self.is_flattened and not flat and "flat_param" not in state_dict:
            with self.unflatten_params():
                return super().load_state_dict(state_dict, strict, **kwargs)
        if "flat_param" in state_dict:
            state_dict = dict(state_dict)
            state_dict[_FLAT_PREFIX + "0"] = state_dict.pop("flat_param")
        return super().load_state_dict(state_dict, strict, **kwargs)


def _groups_of(module: nn.Module, param_list: Any) -> List[Set[nn.Parameter]]:
    if param_list is None:
        return [set(module.parameters())]
    if not isinstance(param_list, (list, tuple)):
        raise TypeError(
            f"FlattenParamsWrapper: argument 'param_list' must be a list of Parameters or of lists of them, "
            f"got {type(param_list).__name__}"
        )
    if len(param_list) > 0 and isinstance(param_list[0], nn.Parameter):
        param_list = [param_list]
    groups = []
    for group in param_list:
        if not isinstance(group, (list, tuple, set)) or not all(isinstance(p, nn.Parameter) for p in group):
            raise TypeError(
                "FlattenParamsWrapper: argument 'param_list' must be a list of Parameters or of lists of them"
            )
        groups.append(set(group))
    return groups


def _rename_prefix(state_dict: Dict[str, Any], old: str, new: str) -> None:
    for key in list(state_dict):
        if key.startswith(old):
            state_dict[new + key[len(old) :]] = state_dict.pop(key)


def _strip_module_prefix(module: nn.Module, state_dict: Dict[str, Any], prefix: str, *args: Any) -> Dict[str, Any]:
    # The wrapped module's keys come up one level: the wrapper is transparent in state dicts.
    _rename_prefix(state_dict, prefix + _MODULE + ".", prefix)
    return state_dict


def _add_module_prefix(state_dict: Dict[str, Any], prefix: str, *args: Any) -> None:
    # Down to the wrapped module, except the flat parameters, which live on the wrapper.
    _rename_prefix(state_dict, prefix, prefix + _MODULE + ".")
    _rename_prefix(state_dict, prefix + _MODULE + "." + _FLAT_PREFIX, prefix + _FLAT_PREFIX)
