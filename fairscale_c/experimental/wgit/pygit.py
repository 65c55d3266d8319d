"""PyGit: the git repository inside a wgit repo's ``.wgit`` directory, which versions its metadata
files — mirrors fairscale.experimental.wgit.pygit.

FairScale drives git through pygit2 (libgit2); this drives the ``git`` program, so nothing beyond
git itself is needed, and the repository is an ordinary one that either reads. ``PyGit.repo``
answers ``status()`` and ``path`` as a pygit2 ``Repository`` does (status flags with pygit2's
values), which is what FairScale's callers and tests use of it. Every git call has a timeout and
raises ``GitError`` with git's message when it fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

__all__ = ["PyGit", "GitError"]

# pygit2's GIT_STATUS_* values.
GIT_STATUS_INDEX_NEW = 1
GIT_STATUS_INDEX_MODIFIED = 2
GIT_STATUS_INDEX_DELETED = 4
GIT_STATUS_INDEX_TYPECHANGE = 16
GIT_STATUS_WT_NEW = 128
GIT_STATUS_WT_MODIFIED = 256
GIT_STATUS_WT_DELETED = 512
GIT_STATUS_WT_TYPECHANGE = 1024
GIT_STATUS_IGNORED = 16384
GIT_STATUS_CONFLICTED = 32768

_INDEX_FLAGS = {
    "A": GIT_STATUS_INDEX_NEW,
    "M": GIT_STATUS_INDEX_MODIFIED,
    "D": GIT_STATUS_INDEX_DELETED,
    "T": GIT_STATUS_INDEX_TYPECHANGE,
}
_WORKTREE_FLAGS = {"M": GIT_STATUS_WT_MODIFIED, "D": GIT_STATUS_WT_DELETED, "T": GIT_STATUS_WT_TYPECHANGE}

GIT_TIMEOUT = 120.0  # seconds any one git command may take


class GitError(RuntimeError):
    """A git command failed; the message carries git's."""


def run_git(workdir: Path, args: Sequence[str], *, env: Optional[Dict[str, str]] = None) -> str:
    """Runs ``git -C workdir <args>`` and returns its standard output. Hooks, pagers, prompts,
    signing and the user's excludes are off, so the result depends on the repository alone."""
    exe = shutil.which("git")
    if exe is None:
        raise GitError("wgit needs the git program, and none is on PATH")
    cmd = [
        exe,
        "-C",
        str(workdir),
        "-c",
        "core.hooksPath=/dev/null",
        "-c",
        "commit.gpgSign=false",
        "-c",
        "core.excludesFile=",
        "-c",
        "core.quotePath=false",
        *args,
    ]
    full_env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "GIT_PAGER": "cat", "LC_ALL": "C", **(env or {})}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=GIT_TIMEOUT)
    except subprocess.TimeoutExpired:
        raise GitError(f"git {' '.join(args)} in {workdir} took over {GIT_TIMEOUT:.0f} s") from None
    if proc.returncode != 0:
        raise GitError(f"git {' '.join(args)} in {workdir} failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc.stdout


class GitRepository:
    """What wgit uses of a pygit2 ``Repository``: ``path`` (the git directory, with a trailing
    separator), ``workdir`` and ``status()``."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = str(Path(workdir).absolute()) + os.sep
        self.path = str(Path(workdir).absolute() / ".git") + os.sep

    def status(self) -> Dict[str, int]:
        """{path relative to the work tree: pygit2 status flags} for every file that differs from
        HEAD or is untracked (each file of an untracked directory listed); ignored files left out."""
        out = run_git(Path(self.workdir), ["status", "--porcelain=v1", "-z", "--untracked-files=all", "--no-renames"])
        status: Dict[str, int] = {}
        for record in out.split("\0"):
            if not record:
                continue
            xy, path = record[:2], record[3:]
            if xy == "??":
                status[path] = GIT_STATUS_WT_NEW
            elif "U" in xy or xy in ("AA", "DD"):
                status[path] = GIT_STATUS_CONFLICTED
            else:
                status[path] = _INDEX_FLAGS.get(xy[0], 0) | _WORKTREE_FLAGS.get(xy[1], 0)
        return status


class PyGit:
    """The git repository of a ``.wgit`` directory: wraps the one there, or makes one.

    Args:
        parent_path (Path): the ``.wgit`` directory (a full path).
        gitignore (list): entries written to the new repository's ``.gitignore``.
        name, email (str): the commits' author when git's own configuration names none.
    """

    def __init__(
        self,
        parent_path: Path,
        gitignore: Optional[List[str]] = None,
        name: str = "user",
        email: str = "user@email.com",
    ) -> None:
        self._parent_path = Path(parent_path)
        self.name, self.email = self._set_author_config(name, email)
        if self._parent_path.joinpath(".git").exists():
            self.repo = GitRepository(self._parent_path)
            self.path = self._parent_path / ".git"
        else:
            self._init_wgit_git(list(gitignore or []))

    def _init_wgit_git(self, gitignore: List[str]) -> None:
        """Makes the directory a git repository with the given ``.gitignore`` entries."""
        self._parent_path.mkdir(parents=True, exist_ok=True)
        run_git(self._parent_path, ["init", "-q"])
        self.repo = GitRepository(self._parent_path)
        self.path = self._parent_path / ".git"
        ignore = self._parent_path / ".gitignore"
        present = ignore.read_text().splitlines() if ignore.exists() else []
        with open(ignore, "a") as f:
            for item in gitignore:
                if item not in present:
                    f.write(f"{item}\n")

    def add(self) -> None:
        """Stages every file of the directory that ``.gitignore`` does not exclude."""
        run_git(self._parent_path, ["add", "--all", "."])

    def commit(self, message: str) -> None:
        """Commits what is staged (an empty commit when nothing is, as pygit2 makes one)."""
        if not isinstance(message, str):
            raise TypeError(f"PyGit.commit: message must be a str, got {type(message).__name__}")
        ident = {
            "GIT_AUTHOR_NAME": self.name,
            "GIT_AUTHOR_EMAIL": self.email,
            "GIT_COMMITTER_NAME": self.name,
            "GIT_COMMITTER_EMAIL": self.email,
        }
        run_git(self._parent_path, ["commit", "-q", "--allow-empty", "--allow-empty-message", "-m", message], env=ident)

    @property
    def _exists(self) -> bool:
        """True when the directory is the work tree of the wrapped repository."""
        return self._parent_path.absolute() == Path(self.repo.path).parent

    @property
    def _path(self) -> str:
        """The wrapped repository's git directory."""
        return self.repo.path

    def status(self) -> Dict[str, int]:
        """{path relative to the ``.wgit`` directory: pygit2 status flags} of files not ignored
        that differ from the last commit or are untracked."""
        return {k: v for k, v in self.repo.status().items() if v != GIT_STATUS_IGNORED}

    def _set_author_config(self, name: str, email: str) -> Tuple[str, str]:
        """git's configured user.name and user.email when both are set, else name and email."""
        try:
            set_name = run_git(Path.cwd(), ["config", "user.name"]).strip()
            set_email = run_git(Path.cwd(), ["config", "user.email"]).strip()
        except GitError:
            return name, email
        return (set_name, set_email) if set_name and set_email else (name, email)
