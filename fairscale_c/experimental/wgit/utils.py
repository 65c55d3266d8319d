"""ExitCode: wgit's exit codes — mirrors fairscale.experimental.wgit.utils."""

from enum import Enum


class ExitCode(Enum):
    """Exit codes."""

    CLEAN = 0
    FILE_EXISTS_ERROR = 1
    FILE_DOES_NOT_EXIST_ERROR = 2
