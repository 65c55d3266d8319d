"""fairscale_c for AI2 Tango: a TrainingEngine registered as ``"fairscale_c"``, an ``FSDPConfig``
that can set ``compute_dtype``, and the Model wrapper ``"fairscale_c::with_wrapped_modules"``.

Importing this module registers them with Tango (list it under ``include_package`` in
``tango.yml``, or pass ``--include-package fairscale_c.integrations.tango``). It needs Tango
(``ai2-tango``) importable; without it the import raises ImportError. Tango's own ``"fairscale"``
engine also runs on fairscale_c, through the alias (``python -m fairscale_c.compat``, or
``fairscale_c.compat.install()``): docs/tango.md compares the two.
"""

try:
    import tango.integrations.torch  # noqa: F401
except ImportError as exc:
    raise ImportError(
        f"fairscale_c.integrations.tango needs AI2 Tango (pip install ai2-tango): importing it failed ({exc})"
    ) from exc

from .fsdp_config import FSDPConfig
from .module_wrapper import with_wrapped_modules
from .training_engine import FairScaleCTrainingEngine

__all__ = ["FairScaleCTrainingEngine", "FSDPConfig", "with_wrapped_modules"]
