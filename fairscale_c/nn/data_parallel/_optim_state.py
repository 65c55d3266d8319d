"""Optimizer state for FSDP: gather shards into FairScale's unflattened format, and shard it back.

Format (as FairScale 0.4.13): ``{"state": {global_id: {...}}, "param_groups": [...],
"param_id_map": {global_id: local_id}, "uncollected_local_ids": [...]}``. Global ids number the
original (unflattened, de-duplicated) parameters in flattening order across the FSDP instances;
local ids index the optimizer's own (flat, sharded) parameters, None for a flat parameter the
optimizer does not hold. FairScale numbers local ids by the flat parameters' position instead,
and writes None for one that has no state (unused, or frozen): a state without the
"local_param_count" key written here is read that way.
"""

import copy
import itertools
from typing import Any, Dict, List, Optional, Tuple

import torch


def _flat_entries(instances: List[Any]) -> List[Tuple[Any, Any]]:
    """(instance, handle) for every flat parameter of `instances` (in module order), in parameters() order."""
    return [(m, h) for m in instances for h in m._handles]


def _local_ids(optim: torch.optim.Optimizer, entries) -> List[Optional[int]]:
    if not isinstance(optim, torch.optim.Optimizer):
        raise TypeError(
            "gather_full_optim_state_dict: argument 'optim' must be a torch.optim.Optimizer, got "
            + type(optim).__name__
        )
    if len(optim.param_groups) != 1:
        raise ValueError(
            f"gather_full_optim_state_dict: the optimizer has {len(optim.param_groups)} parameter groups; "
            f"FairScale's format (and this implementation) supports exactly one"
        )
    index = {id(p): i for i, p in enumerate(optim.param_groups[0]["params"])}
    ids = [index.get(id(h.param)) for _, h in entries]
    if entries and all(i is None for i in ids):
        raise ValueError(
            "gather_full_optim_state_dict: argument 'optim' holds none of this model's parameters; build it "
            "from the wrapped model's parameters() (after wrapping: FSDP replaces them with flat shards)"
        )
    return ids


def _is_singleton(x: Any) -> bool:
    return torch.is_tensor(x) and x.dim() == 0


@torch.no_grad()
def gather_full(root, instances: List[Any], optim: torch.optim.Optimizer) -> Optional[Dict[str, Any]]:
    """`root`'s gather_full_optim_state_dict; `instances`: its FSDP instances (itself included)."""
    root._lazy_init()
    entries = _flat_entries(instances)
    local_ids = _local_ids(optim, entries)
    osd = optim.state_dict()
    state: Dict[int, Dict[str, Any]] = {}
    param_id_map: Dict[int, Optional[int]] = {}
    uncollected = []
    global_id = 0
    for (m, h), local_id in zip(entries, local_ids):
        local_state = osd["state"].get(local_id, {}) if local_id is not None else {}
        if local_id is not None and m.no_broadcast_optim_state:
            uncollected.append(local_id)
        full_state = {}
        for key, value in local_state.items():
            if torch.is_tensor(value) and not _is_singleton(value) and not m.no_broadcast_optim_state:
                if value.numel() != h.layout.shard_numel:
                    raise ValueError(
                        f"gather_full_optim_state_dict: state '{key}' of flat parameter {local_id} has "
                        f"{value.numel()} elements, expected the shard's {h.layout.shard_numel}"
                    )
                full = torch.empty(h.layout.padded_numel, dtype=value.dtype, device=value.device)
                m.comm.all_gather(full, value.detach().contiguous())
                full_state[key] = full
            elif _is_singleton(value) and key == "step":
                full_state[key] = value.item()  # FairScale stores the step as an int
            elif isinstance(value, (list, tuple, dict)) and m.world_size > 1:
                raise ValueError(
                    f"gather_full_optim_state_dict: state '{key}' of flat parameter {local_id} is a "
                    f"{type(value).__name__} (LBFGS keeps its history so): each rank's differs and this format "
                    "holds one; only tensors of the shard's size and scalars can be gathered"
                )
            else:
                full_state[key] = value
        for slot in h.layout.slots:
            param_id_map[global_id] = local_id
            if root.rank == 0 and local_state:
                state[global_id] = {k: _slot_value(v, slot, h) for k, v in full_state.items()}
            global_id += 1
    if root.rank != 0:
        return None
    param_groups = copy.deepcopy(osd["param_groups"])
    param_groups[0]["params"] = list(range(global_id))
    return {
        "state": state,
        "param_groups": param_groups,
        "param_id_map": param_id_map,
        "uncollected_local_ids": uncollected,
        "local_param_count": len(optim.param_groups[0]["params"]),
    }


def _slot_value(v: Any, slot: Any, h: Any) -> Any:
    """One original parameter's entry of a gathered state value: its part of a full flat tensor,
    in the parameter's shape; a scalar tensor a copy of its own (shared by every entry, it would
    be updated once per entry by an optimizer that loads it: NAdam's mu_product); anything else
    (an uncollected shard's state, say) shared, as gathered."""
    if torch.is_tensor(v) and v.dim() == 1 and v.numel() == h.layout.padded_numel:
        return v[slot.offset : slot.offset + slot.numel].view(slot.shape).cpu().clone()
    return v.clone() if _is_singleton(v) else v


def _slot_state(full_osd: Dict[str, Any], gid: int, key: str, slot: Any) -> torch.Tensor:
    """The state tensor `key` of original parameter `gid`, checked against the parameter's shape."""
    entry = full_osd["state"].get(gid)
    if not isinstance(entry, dict) or key not in entry:
        raise ValueError(
            f"get_shard_from_optim_state_dict: argument 'full_optim_state_dict' has no state '{key}' for "
            f"parameter {gid} (its flat parameter's other parameters have it)"
        )
    t = entry[key]
    shape = tuple(slot.shape)
    if not torch.is_tensor(t) or (tuple(t.shape) != shape and tuple(t.shape) != (slot.numel,)):
        got = tuple(t.shape) if torch.is_tensor(t) else type(t).__name__
        raise ValueError(
            f"get_shard_from_optim_state_dict: state '{key}' of parameter {gid} is {got}; expected a tensor of the "
            f"parameter's shape {shape}"
        )
    return t


@torch.no_grad()
def shard_from_full(instances: List[Any], full_osd: Dict[str, Any]) -> Dict[str, Any]:
    """get_shard_from_optim_state_dict of the root of `instances` (its FSDP instances, itself included)."""
    entries = _flat_entries(instances)
    if not isinstance(full_osd, dict):
        raise TypeError(
            "get_shard_from_optim_state_dict: argument 'full_optim_state_dict' must be a dict (from "
            f"gather_full_optim_state_dict), got {type(full_osd).__name__}"
        )
    for key in ("state", "param_groups", "param_id_map"):
        if key not in full_osd:
            raise ValueError(f"get_shard_from_optim_state_dict: argument 'full_optim_state_dict' has no '{key}'")
    n_global = sum(len(h.layout.slots) for _, h in entries)
    if len(full_osd["param_id_map"]) != n_global:
        raise ValueError(
            f"get_shard_from_optim_state_dict: the state describes {len(full_osd['param_id_map'])} parameters, "
            f"this model has {n_global}"
        )
    state: Dict[int, Dict[str, Any]] = {}
    global_id = 0
    local_ids = set()
    per_entry = []  # (position of the flat parameter, its local id)
    for k, (_, h) in enumerate(entries):
        ids = list(range(global_id, global_id + len(h.layout.slots)))
        global_id += len(ids)
        saved = {full_osd["param_id_map"].get(g, "absent") for g in ids}
        local_id = next(iter(saved))
        if len(saved) != 1 or local_id == "absent" or (local_id is not None and local_id in local_ids):
            shared = " (another flat parameter has it too)" if len(saved) == 1 else ""
            raise ValueError(
                "get_shard_from_optim_state_dict: argument 'full_optim_state_dict' was saved from a model whose "
                f"parameters were grouped into flat parameters otherwise: this model's flat parameter {k} holds "
                f"parameters {ids[0]}..{ids[-1]} (in this model's order), which the state gives to optimizer "
                f"parameter(s) {sorted(saved, key=str)}{shared}; "
                "load it into the model wrapped as the one that saved it (the same FSDP nesting and "
                "flatten_parameters)"
            )
        per_entry.append((k, local_id))
        if local_id is None:
            continue
        local_ids.add(local_id)
        if ids[0] not in full_osd["state"]:
            continue
        # A state is per element when it has the parameter's shape: read off the largest of the
        # flat parameter's parameters (a 0-d one would make every state look like a scalar).
        largest = max(range(len(ids)), key=lambda i: h.layout.slots[i].numel)
        shard_state = {}
        for key, value in full_osd["state"].get(ids[largest], full_osd["state"][ids[0]]).items():
            if (
                torch.is_tensor(value)
                and not _is_singleton(value)
                and local_id not in full_osd.get("uncollected_local_ids", [])
            ):
                flat = torch.zeros(h.layout.padded_numel, dtype=value.dtype)
                for gid, slot in zip(ids, h.layout.slots):
                    flat[slot.offset : slot.offset + slot.numel] = _slot_state(full_osd, gid, key, slot).reshape(-1)
                n = h.layout.shard_numel
                shard_state[key] = flat[h.layout.rank * n : (h.layout.rank + 1) * n].to(h.param.device).clone()
            elif key == "step" and not torch.is_tensor(value):
                shard_state[key] = torch.tensor(float(value))  # torch optimizers keep the step as a tensor
            else:
                shard_state[key] = value
        state[local_id] = shard_state
    param_groups = copy.deepcopy(full_osd["param_groups"])
    ids_in_order = [full_osd["param_id_map"][g] for g in sorted(full_osd["param_id_map"])]
    positional = all(i is None or i == k for k, i in per_entry)
    if "local_param_count" not in full_osd and None in ids_in_order and positional:
        # FairScale's: each flat parameter, None (no state) or not, is one of the optimizer's,
        # numbered by position (its flatten_optim_state_dict counts the runs of equal ids). A
        # state this library wrote before it recorded local_param_count numbers the optimizer's
        # parameters, which a flat parameter left out of it shifts (one left out last is read
        # as FairScale's).
        param_groups[0]["params"] = list(range(sum(1 for _ in itertools.groupby(ids_in_order))))
    else:
        param_groups[0]["params"] = sorted(local_ids)
    return {"state": state, "param_groups": param_groups}
