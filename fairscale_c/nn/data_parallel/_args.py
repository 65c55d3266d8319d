"""Argument checks of FullyShardedDataParallel's constructor: each FairScale 0.4.13 argument gets
a type and range check whose message names it, before anything is built."""

import math
import numbers
from typing import Any, Dict

import torch
from torch import nn

from fairscale_c.internal.parallel import ProcessGroupName
from fairscale_c.internal.args import refuse_meta_tensors, refuse_sparse_gradients

_BOOLS = (
    "reshard_after_forward",
    "disable_reshard_on_root",
    "mixed_precision",
    "fp32_reduce_scatter",
    "flatten_parameters",
    "move_params_to_cpu",
    "clear_autocast_cache",
    "force_input_to_fp32",
    "verbose",
    "cpu_offload",
    "state_dict_on_rank_0_only",
    "allow_reset_parameters",
)
_OPTIONAL_BOOLS = ("move_grads_to_cpu", "no_broadcast_optim_state")
_COMPUTE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_WHERE = "FullyShardedDataParallel"


def _number(value: Any) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _check_device(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (str, int, torch.device)):
        raise TypeError(
            f"{_WHERE}: argument '{name}' must be None, a torch.device, a device string or a CUDA index, "
            f"got {type(value).__name__}"
        )
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"{_WHERE}: argument '{name}' is not a device: {value!r} ({exc})") from None
    if name == "compute_device" and device.type not in ("cpu", "cuda"):
        raise ValueError(f"{_WHERE}: argument 'compute_device' must be a CPU or CUDA device, got {value!r}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0 or (device.index is not None and device.index >= count):
            raise ValueError(f"{_WHERE}: argument '{name}' is {value!r}, but this process sees {count} CUDA device(s)")


def _check_process_group(name: str, value: Any, names: Any) -> None:
    import torch.distributed as dist

    if value is None or (dist.is_available() and isinstance(value, dist.ProcessGroup)):
        return
    if callable(getattr(value, "rank", None)) and callable(getattr(value, "size", None)):
        return  # a stand-in, as FairScale accepts: fairscale_c.distributed.group_for checks its size
    if names is not None and dist.is_available() and value is dist.GroupMember.NON_GROUP_MEMBER:
        return  # what new_group() gives a rank outside it; FairScale's rule then uses process_group
    if names is not None and isinstance(value, str):
        if value in {n.value for n in names}:
            return
        raise ValueError(
            f"{_WHERE}: argument '{name}' must be a process group, None or a ProcessGroupName "
            f"('default' or 'reduce_scatter'), got {value!r}"
        )
    if dist.is_available() and value is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError(
            f"{_WHERE}: argument '{name}' is GroupMember.NON_GROUP_MEMBER, what torch.distributed.new_group "
            "gives a rank outside the group: this rank is not a member; build FSDP on a group that includes it"
        )
    expected = "a process group, an object with rank() and size(), " + (
        "None or a ProcessGroupName" if names is not None else "or None"
    )
    raise TypeError(f"{_WHERE}: argument '{name}' must be {expected}, got {type(value).__name__}")


def check_fsdp_args(args: Dict[str, Any]) -> None:
    """Check FullyShardedDataParallel.__init__'s arguments (its ``locals()`` on entry). TypeError
    for a wrong type, ValueError for a value out of range, each naming the argument."""
    if not isinstance(args["module"], nn.Module):
        raise TypeError(f"{_WHERE}: argument 'module' must be an nn.Module, got {type(args['module']).__name__}")
    refuse_sparse_gradients(args["module"], _WHERE)
    refuse_meta_tensors(args["module"], _WHERE)
    for name in _BOOLS:
        if not isinstance(args[name], bool):
            raise TypeError(f"{_WHERE}: argument '{name}' must be a bool, got {type(args[name]).__name__}")
    for name in _OPTIONAL_BOOLS:
        if args[name] is not None and not isinstance(args[name], bool):
            raise TypeError(f"{_WHERE}: argument '{name}' must be a bool or None, got {type(args[name]).__name__}")
    _check_process_group("process_group", args["process_group"], None)
    _check_process_group("process_group_reduce_scatter", args["process_group_reduce_scatter"], ProcessGroupName)
    for name in ("compute_dtype", "buffer_dtype"):
        value = args[name]
        if value is not None and not isinstance(value, torch.dtype):
            raise TypeError(f"{_WHERE}: argument '{name}' must be a torch.dtype or None, got {type(value).__name__}")
    if args["compute_dtype"] is not None and args["compute_dtype"] not in _COMPUTE_DTYPES:
        raise ValueError(
            f"{_WHERE}: argument 'compute_dtype' must be float32, float16 or bfloat16, got {args['compute_dtype']}"
        )
    if args["buffer_dtype"] is not None and not args["buffer_dtype"].is_floating_point:
        raise ValueError(
            f"{_WHERE}: argument 'buffer_dtype' must be a floating dtype (floating buffers are cast to it), "
            f"got {args['buffer_dtype']}"
        )
    cap = args["bucket_cap_mb"]
    if not isinstance(cap, numbers.Real) or isinstance(cap, bool):
        raise TypeError(f"{_WHERE}: argument 'bucket_cap_mb' must be a number of MiB, got {type(cap).__name__}")
    if not _number(cap) or cap < 0:
        raise ValueError(f"{_WHERE}: argument 'bucket_cap_mb' must be a finite number >= 0 (0: no buckets), got {cap}")
    factor = args["gradient_predivide_factor"]
    if factor is not None:
        if not isinstance(factor, numbers.Real) or isinstance(factor, bool):
            raise TypeError(
                f"{_WHERE}: argument 'gradient_predivide_factor' must be a number or None, got {type(factor).__name__}"
            )
        if not _number(factor) or factor <= 0:
            raise ValueError(
                f"{_WHERE}: argument 'gradient_predivide_factor' must be a finite number > 0 or None (None: the "
                f"power of 2 near sqrt(world size)), got {factor}"
            )
    _check_device("compute_device", args["compute_device"])
    _check_device("state_dict_device", args["state_dict_device"])
    if args["fp32_reduce_scatter"] and not args["mixed_precision"]:
        raise ValueError(f"{_WHERE}: fp32_reduce_scatter requires mixed_precision=True")
    if args["compute_dtype"] is torch.bfloat16 and not args["mixed_precision"]:
        raise ValueError(
            f"{_WHERE}: argument 'compute_dtype' is bfloat16 without mixed_precision=True; expected "
            "mixed_precision=True (float32 parameters computed in bfloat16), or, for parameters kept in bfloat16, "
            "wrapping float32 ones and calling .bfloat16() on the wrapper (float32 inputs would otherwise meet "
            "bfloat16 weights in the forward)"
        )
