"""with_wrapped_modules: wrap inner modules of a Tango Model in FSDP and/or checkpoint_wrapper."""

import re
from typing import Optional, Set

import torch
import torch.distributed as dist
from tango.integrations.torch import Model

from fairscale_c.nn.checkpoint import checkpoint_wrapper

from .fsdp_config import FSDPConfig


@Model.register("fairscale_c::with_wrapped_modules")  # type: ignore[arg-type]
def with_wrapped_modules(
    model: Model,
    modules_to_wrap: Set[str],
    fsdp_config: Optional[FSDPConfig] = None,
    activation_checkpointing: bool = False,
) -> Model:
    """Wrap every module of ``model`` whose name (as ``named_modules()`` gives it) matches one of
    the regular expressions ``modules_to_wrap`` in full: in ``checkpoint_wrapper`` when
    ``activation_checkpointing``, then in FSDP (with ``fsdp_config``) when one is given and
    torch.distributed is initialised. The model is changed in place and returned. Tango's
    ``fairscale::with_wrapped_modules`` with this package's FSDPConfig (``compute_dtype``)."""
    matched = set()
    for name, module in list(model.named_modules()):
        hits = [p for p in modules_to_wrap if re.fullmatch(p, name)]
        if not hits:
            continue
        matched.update(hits)
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        wrapped: torch.nn.Module = module
        if activation_checkpointing:
            wrapped = checkpoint_wrapper(wrapped, offload_to_cpu=True)
        if fsdp_config is not None and dist.is_available() and dist.is_initialized():
            wrapped = fsdp_config.wrap(wrapped)
        parent.add_module(attr, wrapped)
    missing = sorted(set(modules_to_wrap) - matched)
    if missing:
        raise ValueError(f"with_wrapped_modules: 'modules_to_wrap' patterns {missing} match no module of the model")
    return model
