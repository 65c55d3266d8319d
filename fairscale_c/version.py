"""fairscale.version's content under the alias: ``__version_tuple__``, the FairScale release whose
API this package provides (fairscale_c's own version is ``fairscale_c.__version__``)."""

from .compat import FAIRSCALE_VERSION

__version_tuple__ = tuple(int(p) for p in FAIRSCALE_VERSION.split("."))
