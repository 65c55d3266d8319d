"""State-dict plumbing for FSDP: key renaming hooks, summoning full parameters, FairScale's
local-metadata format and offline consolidation."""

import contextlib
from typing import Any, Dict, List, Tuple

import torch
from torch import nn

from fairscale_c.distributed import local_copy

WRAPPED = "_fsdp_wrapped_module"
_HIDDEN = {WRAPPED, "_fpw_module"}


def clean_path(path: str) -> str:
    """Drop wrapper attribute names from a dotted path (FairScale writes the same clean names)."""
    return ".".join(p for p in path.split(".") if p and p not in _HIDDEN)


def post_state_dict_hook(module: nn.Module, state_dict: Dict[str, Any], prefix: str, local_metadata: Any) -> None:
    """``<prefix>_fsdp_wrapped_module.x`` -> ``<prefix>x``: state dicts carry the original keys."""
    inner = prefix + WRAPPED + "."
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)


_pre_load_enabled = True


@contextlib.contextmanager
def no_pre_load_state_dict_hook():
    """FairScale's switch: while inside, load_state_dict() takes keys as they are, for state dicts
    that still carry the wrapper names (not produced by a root instance's state_dict())."""
    global _pre_load_enabled
    before = _pre_load_enabled
    _pre_load_enabled = False
    try:
        yield
    finally:
        _pre_load_enabled = before


def pre_load_state_dict_hook(fsdp: nn.Module, state_dict: Dict[str, Any], prefix: str, *unused: Any) -> None:
    """The inverse of post_state_dict_hook, for everything but the instance's own flat params."""
    if not _pre_load_enabled:
        return
    own = set(fsdp._parameters.keys())
    for key in [k for k in state_dict if k.startswith(prefix)]:
        rest = key[len(prefix) :]
        if rest.startswith(WRAPPED + ".") or rest in own:
            continue
        state_dict[prefix + WRAPPED + "." + rest] = state_dict.pop(key)


@contextlib.contextmanager
def override(instances: List[nn.Module], attr: str, value: Any):
    """Set `attr` on every instance while inside; restore each one's own value after."""
    old = [getattr(m, attr) for m in instances]
    for m in instances:
        setattr(m, attr, value)
    try:
        yield
    finally:
        for m, v in zip(instances, old):
            setattr(m, attr, v)


def local_mode(instances: List[nn.Module]):
    """state_dict()/load_state_dict() see the sharded flat parameters while inside."""
    return override(instances, "_return_full_state_dict", False)


def _gather_fp32(fsdp, h) -> torch.Tensor:
    shard = h.param.detach()
    full = torch.empty(h.layout.padded_numel, dtype=shard.dtype, device=shard.device)
    fsdp.comm.all_gather(full, shard)
    return full


def _write_back(h, full: torch.Tensor) -> None:
    n = h.layout.shard_numel
    local_copy(h.param.detach(), full[h.layout.rank * n : (h.layout.rank + 1) * n])


@torch.no_grad()
def summon(fsdp) -> List[Any]:
    """All-gather each flat parameter in fp32 and register the original parameters as views of it.
    A parameter shared with another instance (``fsdp._ties``) gets the owner's summoned Parameter
    when the owner is summoned, else a gather of its own. A gather that raises undoes the others."""
    fulls: List[Any] = []
    try:
        _summon_into(fsdp, fulls)
    except BaseException:
        unsummon(fsdp, fulls, write_back=False)
        raise
    return fulls


def _summon_into(fsdp, fulls: List[Any]) -> None:
    for h in fsdp._handles:
        full = _gather_fp32(fsdp, h)
        fulls.append(full)
        params = {}
        for slot in h.layout.slots:
            p = nn.Parameter(full[slot.offset : slot.offset + slot.numel].view(slot.shape), h.param.requires_grad)
            params[id(slot)] = p
            slot.module.__dict__.pop(slot.attr, None)  # a view left by the last forward
            slot.module._parameters[slot.attr] = p
        for shared in h.layout.shared:
            shared.module.__dict__.pop(shared.attr, None)
            shared.module._parameters[shared.attr] = params[id(shared.src)]
        h.summoned = params
        fsdp._parameters.pop(h.backing_name, None)  # flattened: the shard hides while summoned
    for t in fsdp._ties:
        own = None
        p = t.handle.summoned.get(id(t.slot)) if t.handle.summoned is not None else None
        if p is None:
            own = _gather_fp32(fsdp, t.handle)
            s = t.slot
            p = nn.Parameter(own[s.offset : s.offset + s.numel].view(s.shape), t.handle.param.requires_grad)
        t.module.__dict__.pop(t.attr, None)
        t.module._parameters[t.attr] = p
        fulls.append(own)


@torch.no_grad()
def unsummon(fsdp, fulls: List[Any], write_back: bool) -> None:
    """Undo summon(); with write_back, this rank's slice of each full parameter goes to its shard
    (a shared parameter's by its owner, unless this instance gathered it itself)."""
    n_own = len(fsdp._handles)
    for t, own in zip(fsdp._ties, fulls[n_own:]):
        if own is not None and write_back:
            _write_back(t.handle, own)
        t.module._parameters[t.attr] = t.handle.param
    for h, full in zip(fsdp._handles, fulls[:n_own]):
        if write_back:
            _write_back(h, full)
        h.summoned = None
        if not fsdp.flatten_parameters:  # the shard goes back in the summoned parameter's place
            for module, attr in h.places():
                module._parameters[attr] = h.param
            continue
        for slot in h.layout.slots:
            slot.module._parameters.pop(slot.attr, None)
        for shared in h.layout.shared:
            shared.module._parameters.pop(shared.attr, None)
        fsdp._parameters[h.backing_name] = h.param
    if fsdp.flatten_parameters:  # in handle order, also after a summon that stopped part-way
        for h in fsdp._handles:
            if h.backing_name in fsdp._parameters:
                fsdp._parameters[h.backing_name] = fsdp._parameters.pop(h.backing_name)
    fsdp._leave_shaped_views()


def detach_to(sd: Dict[str, Any], device: torch.device, to_fp32: bool) -> Dict[str, Any]:
    out = type(sd)()
    for k, v in sd.items():
        if torch.is_tensor(v):
            v = v.detach().to(device=device, copy=True)
            if to_fp32 and v.is_floating_point():
                v = v.float()
        out[k] = v
    if hasattr(sd, "_metadata"):
        out._metadata = sd._metadata
    return out


def _whole_shards(named_instances: List[Tuple[str, Any]]) -> Dict[int, Tuple[int, torch.Size]]:
    """data_ptr -> (numel, shape) of the shards that hold one whole parameter: those of instances
    at world size 1 without flattening, which FairScale keeps in the parameter's shape."""
    out = {}
    for _, m in named_instances:
        if m.world_size == 1 and not m.flatten_parameters:
            for h in m._handles:
                if len(h.layout.slots) == 1 and h.layout.padding == 0 and h.param.numel() > 0:
                    out[h.param.data_ptr()] = (h.param.numel(), h.layout.slots[0].shape)
    return out


def unflattened_shards(named_instances: List[Tuple[str, Any]], sd: Dict[str, Any]) -> None:
    """At world size 1 without flattening, FairScale keeps each parameter whole, in its own shape,
    and its local state dict holds it so: give ours the same shapes (views of the shards), under
    every name a shard has (a tied parameter's too). Parameters (``keep_vars=True``) stay as they
    are."""
    whole = _whole_shards(named_instances)
    for key, v in sd.items():
        if torch.is_tensor(v) and not isinstance(v, nn.Parameter) and v.dim() == 1:
            hit = whole.get(v.data_ptr())
            if hit is not None and hit[0] == v.numel():
                sd[key] = v.view(hit[1])


def shaped_for_load(
    named_instances: List[Tuple[str, Any]], current: Dict[str, Any], state_dict: Dict[str, Any]
) -> Dict[str, Any]:
    """``state_dict`` with the whole-parameter shards (see unflattened_shards) given in their
    parameters' shapes, as FairScale and ours save them, flattened to the shards' shape for
    loading. ``current``: the model's local state (its shards, under every name)."""
    whole = _whole_shards(named_instances)
    reshaped = {}
    for key, v in current.items():
        hit = whole.get(v.data_ptr()) if torch.is_tensor(v) else None
        given = state_dict.get(key)
        if hit is not None and torch.is_tensor(given) and given.shape == hit[1] and given.shape != v.shape:
            reshaped[key] = given.reshape(v.shape)
    if not reshaped:
        return state_dict
    out = type(state_dict)(state_dict)
    out.update(reshaped)
    if hasattr(state_dict, "_metadata"):
        out._metadata = state_dict._metadata
    return out


def check_local_shards(named_instances: List[Tuple[str, Any]], state_dict: Dict[str, Any]) -> None:
    """A local state saved at another world size has other shard sizes, and one of another dtype
    would be cast silently by nn.Module: say so before loading anything. `named_instances`: (clean
    path, instance) of every FSDP instance of the model."""
    for path, m in named_instances:
        for h in m._handles:
            key = _join(path, h.backing_name)
            if key not in state_dict:
                continue
            value = state_dict[key]
            if not torch.is_tensor(value):
                raise TypeError(f"load_local_state_dict: '{key}' is a {type(value).__name__}; expected a tensor")
            if value.dtype != h.param.dtype:
                raise TypeError(
                    f"load_local_state_dict: '{key}' is {value.dtype} but this rank's shard is {h.param.dtype}; "
                    "expected the dtype the shard was saved with (shards are not cast on load)"
                )
            if value.numel() != h.layout.shard_numel:
                raise ValueError(
                    f"load_local_state_dict: '{key}' has {value.numel()} elements but this rank's shard "
                    f"has {h.layout.shard_numel} (world size {m.world_size}); a local state dict loads only into the "
                    "same model at the world size it was saved with (another model, or another world size: for the "
                    "latter, rebuild full weights with consolidate_shard_weights() and load_state_dict())"
                )


def _persistent_buffer_names(root: nn.Module) -> List[str]:
    """The buffers a state dict holds (not those registered with persistent=False), in
    named_buffers() order, by their names in the unwrapped model."""
    seen, names = set(), []
    for path, module in root.named_modules():
        for name, b in module._buffers.items():
            if b is None or id(b) in seen:
                continue
            seen.add(id(b))
            if name not in module._non_persistent_buffers_set:
                names.append(clean_path(_join(path, name)))
    return names


def local_metadata(root: nn.Module, named_instances: List[Tuple[str, Any]]) -> Dict[str, Any]:
    """FairScale's local metadata of `root` and its FSDP instances ((clean path, instance) pairs)."""
    param_metadata = []
    for path, m in named_instances:
        param_metadata.append(
            {
                "fsdp_path": path,
                "params": {clean_path(h.backing_name): h.layout.metadata() for h in m._handles},
                "no_broadcast_optim_state": m.no_broadcast_optim_state,
                "shared_param_info": [(clean_path(s), clean_path(d)) for s, d in m._shared_pairs],
            }
        )
    # Parameters shared across instances: pairs of full paths, in the root's entry (its path is "").
    paths = {id(m): path for path, m in named_instances}
    for path, m in named_instances:
        for t in m._ties:
            owner = t.owner()
            if owner is not None and id(owner) in paths:
                src, dst = _join(paths[id(owner)], t.slot.name), _join(path, t.name)
                param_metadata[0]["shared_param_info"].append((clean_path(src), clean_path(dst)))
    buffer_names = _persistent_buffer_names(root)
    # rank and world_size: extra top-level keys (FairScale's readers ignore them) that let
    # consolidation order shards by rank and refuse incomplete or mixed sets
    return {
        "param_metadata": param_metadata,
        "buffer_names": buffer_names,
        "rank": root.rank,
        "world_size": root.world_size,
    }


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _unpad(shard: torch.Tensor, pad: int) -> torch.Tensor:
    return shard[: shard.numel() - pad] if pad > 0 else shard


def _order_by_rank(shard_weights, shard_metadata):
    """Shards in rank order, when their metadata carry rank and world_size (ours do; FairScale's
    do not, and are taken in the order given, as FairScale does). A set with a missing,
    duplicate or out-of-range rank, or of mixed world sizes, is refused: merging it would give
    permuted or foreign weights without an error."""
    where = "consolidate_shard_weights"
    tagged = ["rank" in m and "world_size" in m for m in shard_metadata]
    if not any(tagged):
        return list(shard_weights), list(shard_metadata)
    if not all(tagged):
        untagged = [i for i, t in enumerate(tagged) if not t]
        raise ValueError(
            f"{where}: shard_metadata {untagged} carry no 'rank' / 'world_size' but the others do; "
            "expected one set of shards written together"
        )
    worlds = sorted({m["world_size"] for m in shard_metadata})
    if len(worlds) > 1:
        raise ValueError(f"{where}: the shards were written at different world sizes {worlds}; expected one set")
    world = worlds[0]
    ranks = [m["rank"] for m in shard_metadata]
    for i, r in enumerate(ranks):
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < world:
            raise ValueError(f"{where}: shard_metadata[{i}] has rank {r!r}; expected 0 <= rank < world_size ({world})")
    duplicates = sorted({r for r in ranks if ranks.count(r) > 1})
    missing = sorted(set(range(world)) - set(ranks))
    if duplicates or missing:
        raise ValueError(
            f"{where}: the shards of a world of {world} need each rank once; "
            + (f"rank(s) {duplicates} appear more than once" if duplicates else "")
            + ("; " if duplicates and missing else "")
            + (f"rank(s) {missing} are missing" if missing else "")
        )
    order = sorted(range(len(ranks)), key=lambda i: ranks[i])
    return [shard_weights[i] for i in order], [shard_metadata[i] for i in order]


def _check_layouts(shard_metadata) -> None:
    """Every shard must describe the same parameters (only the padding differs per rank), and each
    flat parameter's names, shapes and numels must line up (a shorter list dropped a parameter)."""
    where = "consolidate_shard_weights"
    first = shard_metadata[0]["param_metadata"]
    for meta in first:
        for backing, info in meta["params"].items():
            lengths = {k: len(info[k]) for k in ("names", "shapes", "numels")}
            if len(set(lengths.values())) != 1:
                raise ValueError(
                    f"{where}: '{meta['fsdp_path']}' {backing} lists {lengths['names']} names, {lengths['shapes']} "
                    f"shapes and {lengths['numels']} numels; expected one of each per parameter"
                )
    for i, sm in enumerate(shard_metadata[1:], start=1):
        other = sm["param_metadata"]
        same = len(other) == len(first) and all(
            a["fsdp_path"] == b["fsdp_path"]
            and list(a["params"]) == list(b["params"])
            and all(
                list(a["params"][k]["names"]) == list(b["params"][k]["names"])
                and list(a["params"][k]["numels"]) == list(b["params"][k]["numels"])
                for k in a["params"]
            )
            for a, b in zip(first, other)
        )
        if not same:
            raise ValueError(
                f"{where}: shard {i} describes other parameters than shard 0 (different wrapping, names or "
                "sizes); expected the shards of one model"
            )


def consolidate(shard_weights, shard_metadata, with_module_buffers: bool, strict: bool) -> Dict[str, torch.Tensor]:
    if len(shard_weights) != len(shard_metadata) or not shard_weights:
        raise ValueError("consolidate_shard_weights: need one metadata dict per shard, and at least one shard")
    shard_weights, shard_metadata = _order_by_rank(shard_weights, shard_metadata)
    _check_layouts(shard_metadata)
    out: Dict[str, torch.Tensor] = {}
    aliases = []  # filled in after every instance's parameters: a pair may name another instance's
    for idx, meta in enumerate(shard_metadata[0]["param_metadata"]):
        path = meta["fsdp_path"]
        for backing, info in meta["params"].items():
            key = _join(path, backing)
            if key not in shard_weights[0] and not strict:
                continue
            shards = []
            for rank, weights in enumerate(shard_weights):
                if key not in weights:
                    raise KeyError(f"consolidate_shard_weights: shard {rank} has no '{key}'")
                pad = shard_metadata[rank]["param_metadata"][idx]["params"][backing]["padding"]
                shards.append(_unpad(weights[key].reshape(-1), pad))
                if meta["no_broadcast_optim_state"]:
                    break
            full = torch.cat(shards, dim=0)
            if sum(info["numels"]) != full.numel():
                raise ValueError(
                    f"consolidate_shard_weights: '{key}' holds {full.numel()} elements after unpadding, "
                    f"metadata says {sum(info['numels'])}"
                )
            for name, t, shape in zip(info["names"], full.split(info["numels"]), info["shapes"]):
                out[_join(path, name)] = t.view(shape)
        aliases.extend((_join(path, src), _join(path, dst)) for src, dst in meta["shared_param_info"])
    for src_key, dst_key in aliases:
        if src_key in out or strict:  # not strict: a parameter skipped above takes its aliases along
            if src_key not in out:
                raise KeyError(
                    f"consolidate_shard_weights: shared parameter '{dst_key}' names '{src_key}', which no shard holds"
                )
            out[dst_key] = out[src_key]
    if with_module_buffers:
        for name in shard_metadata[0]["buffer_names"]:
            if name not in shard_weights[0]:
                if not strict:
                    continue
                raise KeyError(
                    f"consolidate_shard_weights: buffer '{name}' of the metadata is not in rank 0's weights (a "
                    "non-persistent buffer, listed by FairScale's local_metadata_dict? pass strict=False)"
                )
            out[name] = shard_weights[0][name]
    return out
