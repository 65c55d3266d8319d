"""fairscale_c.experimental.wgit — mirrors fairscale.experimental.wgit (WeiGit): versioning of
model checkpoints with per-tensor deduplication (Repo, over SHA1_Store and a git repository of
metadata), and the signal-processing sparsifiers (SignalSparsity, EnergyConcentrationProfile).
Needs the ``git`` program for Repo; FairScale's pygit2 and pgzip are not needed
(docs/experimental.md)."""

from typing import List

from .repo import Repo  # noqa: F401
from .signal_sparsity import Algo, SignalSparsity, random_sparse_mask  # noqa: F401
from .signal_sparsity_profiling import EnergyConcentrationProfile  # noqa: F401
from .version import __version_tuple__

__version__ = ".".join(str(x) for x in __version_tuple__)
__all__: List[str] = []  # as FairScale's: the names above are imported by name
