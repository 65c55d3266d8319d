"""wgit's version, FairScale 0.4.13's."""

__version_tuple__ = (0, 0, 1)
