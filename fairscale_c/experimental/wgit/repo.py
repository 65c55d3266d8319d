"""Repo: a WeiGit repository, which versions model checkpoints — mirrors
fairscale.experimental.wgit.repo.

A repo is a directory holding a ``.wgit`` directory: ``.wgit/sha1_store`` (the checkpoints'
content, deduplicated per tensor: SHA1_Store), one JSON metadata file per tracked checkpoint
(the SHA1 of its current version, its modification time and its path), and ``.wgit/.git``, a
git repository of those metadata files whose commits are the repo's versions. The layout,
metadata keys and the rule that places a checkpoint's metadata file are FairScale 0.4.13's.

Beyond FairScale, whose ``log`` prints only a header and whose ``checkout`` and ``size_info``
raise NotImplementedError:
- ``log`` prints the commits (of the repo, or those that changed one file) after the header;
- ``checkout`` writes tracked checkpoints back as they were at a commit, or one checkpoint
  version named by its SHA1;
- ``size_info`` gives the sizes of the repo or of one file;
- errors are exceptions (FileNotFoundError when there is no repo, ValueError naming the
  argument); FairScale exits the process.
``add(..., sparsify=True)`` raises NotImplementedError as in FairScale: no policy for it is
defined there, and ``SignalSparsity`` serves lossy compression directly.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from torch import Tensor

from fairscale_c.internal.containers import apply_to_type

from .pygit import PyGit, run_git
from .sha1_store import SHA1_Store, atomic_file

__all__ = ["Repo", "RepoStatus", "SizeInfo"]

SHA1_STORE_DIR_NAME = "sha1_store"

# Metadata file keys, FairScale's.
SHA1_KEY = "SHA1"
LAST_MODIFIED_TS_KEY = "last_modified_time_stamp"
REL_PATH_KEY = "file_path"

_NOT_METADATA = {SHA1_STORE_DIR_NAME, ".git", ".gitignore"}


class RepoStatus(Enum):
    """A tracked file's state."""

    CLEAN = 1
    CHANGES_NOT_ADDED = 2
    CHANGES_ADDED_NOT_COMMITED = 3


@dataclass
class SizeInfo:
    """Bytes of a file or of the repo: as added (every add counted), after deduplication, after
    sparsification (none is made: equal to deduplicated) and as stored (gzip)."""

    original: int
    deduped: int
    sparsified: int
    gzipped: int


@dataclass
class _SHA1_Tensor:
    """A tensor of a per-tensor added state dict, by the SHA1 of its content in the store."""

    is_dense: bool = True
    dense_sha1: str = ""
    sst_sha1: str = ""
    dst_sha1: str = ""


def _recursive_apply_to_elements(data: Union[List[Any], Dict[str, Any]], fn: Any, names: List[str]) -> None:
    """Replaces, in place, every leaf x of nested dicts and lists with fn(x, path), path being the
    keys and indices that lead to it."""
    if isinstance(data, dict):
        keys: Any = list(data.keys())
    elif isinstance(data, list):
        keys = range(len(data))
    else:
        raise TypeError(f"wgit: a checkpoint must be a dict or a list of them, got {type(data).__name__}")
    for key in keys:
        names.append(str(key))
        if isinstance(data[key], (list, dict)):
            _recursive_apply_to_elements(data[key], fn, names)
        else:
            data[key] = fn(data[key], names)
        names.pop()


def _is_ref(x: Any) -> bool:
    return isinstance(x, _SHA1_Tensor)


class Repo:
    """A WeiGit repo for tracking neural network weights and their versions.

    Args:
        parent_dir (Path, str): the directory holding (or to hold) ``.wgit``; a repo in a parent
            directory is found too. Default "": the current directory.
        init (bool): make a repo in parent_dir when none is found. Default: False.
    """

    def __init__(self, parent_dir: Union[Path, str] = "", init: bool = False) -> None:
        self._wgit_parent = Path(parent_dir if parent_dir != "" else Path.cwd()).absolute()
        self._dot_wgit_dir_path: Optional[Path] = None
        exists = self._recursive_search_and_may_init_dot_wgit_dir_path(self._wgit_parent)
        if not exists and init:
            self._dot_wgit_dir_path = self._wgit_parent.joinpath(".wgit")
            self._dot_wgit_dir_path.mkdir(parents=False, exist_ok=True)
            self._sha1_store = SHA1_Store(self._dot_wgit_dir_path.joinpath(SHA1_STORE_DIR_NAME), init=True)
            self._pygit = PyGit(self._dot_wgit_dir_path.absolute(), gitignore=[SHA1_STORE_DIR_NAME])
        elif exists:
            assert self._dot_wgit_dir_path is not None
            self._sha1_store = SHA1_Store(self._dot_wgit_dir_path.joinpath(SHA1_STORE_DIR_NAME))
            self._pygit = PyGit(self._dot_wgit_dir_path.absolute())
        else:
            raise FileNotFoundError(f"wgit: not a wgit repository (nor is any parent of {self._wgit_parent})")
        self._sanity_check()

    # Finding the repo.

    def _recursive_search_and_may_init_dot_wgit_dir_path(self, check_dir: Path) -> bool:
        """Looks for a repo in check_dir and then each parent; sets ``_dot_wgit_dir_path`` to the
        first found. True when one was."""
        for d in (check_dir, *check_dir.absolute().parents):
            if self._weigit_repo_exists(d):
                self._dot_wgit_dir_path = d.joinpath(".wgit")
                return True
        return False

    def _weigit_repo_exists(self, check_dir: Path) -> bool:
        """True when check_dir holds a complete ``.wgit``."""
        return all(self._weigit_repo_file_check(check_dir))

    def _weigit_repo_file_check(self, check_dir: Path) -> Tuple[bool, bool, bool]:
        """Whether ``.wgit``, ``.wgit/.git`` and ``.wgit/.gitignore`` exist in check_dir."""
        wgit = check_dir.joinpath(".wgit")
        return wgit.exists(), wgit.joinpath(".git").exists(), wgit.joinpath(".gitignore").exists()

    def _sanity_check(self) -> None:
        """Raises FileNotFoundError when the repo's directory is gone or incomplete."""
        if self._dot_wgit_dir_path is None or not self._weigit_repo_exists(self._dot_wgit_dir_path.parent):
            raise FileNotFoundError(f"wgit: the repository at {self._dot_wgit_dir_path} is gone or incomplete")

    @property
    def _wgit(self) -> Path:
        assert self._dot_wgit_dir_path is not None
        return self._dot_wgit_dir_path

    # Adding and committing.

    def add(
        self,
        in_file_path: str,
        per_tensor: bool = True,
        gzip: bool = True,
        sparsify: bool = False,
        sparsify_policy: Any = None,
    ) -> Optional[Dict[Any, Any]]:
        """Adds a checkpoint file (new or changed) to the staged changes.

        Args:
            in_file_path (str): the file (``torch.save`` output, or a pickle).
            per_tensor (bool): store each tensor of the checkpoint as its own object, so
                tensors equal across versions or files are stored once. Default: True.
            gzip (bool): compress what is stored. Default: True.
            sparsify (bool), sparsify_policy: lossy compression; not implemented (as in
                FairScale).

        Returns:
            None: the content is stored as it is.
        """
        self._sanity_check()
        if sparsify and not per_tensor:
            raise ValueError("Repo.add: sparsify needs per_tensor=True")
        if sparsify:
            raise NotImplementedError("Repo.add: sparsify is not implemented (use SignalSparsity on the tensors)")
        file_path = Path(in_file_path)
        if not file_path.is_file():
            raise FileNotFoundError(f"Repo.add: in_file_path {in_file_path!r} is not a file")
        metadata_file = self._process_metadata_file(self._rel_file_path(file_path))

        obj: Union[Path, Dict[Any, Any]] = file_path
        added: List[str] = []  # references this call took: given back if it fails part-way
        try:
            if per_tensor:
                state_dict = torch.load(file_path, map_location="cpu", weights_only=True)

                def fn(element: Any, names: List[str]) -> Any:
                    if isinstance(element, Tensor):
                        added.append(self._sha1_store.add(element, gzip, ".".join(names)))
                        return _SHA1_Tensor(is_dense=True, dense_sha1=added[-1])
                    return element

                if isinstance(state_dict, dict):
                    _recursive_apply_to_elements(state_dict, fn, [])
                elif not isinstance(state_dict, Tensor):  # a tensor alone is one object anyway
                    raise TypeError(
                        f"Repo.add: per_tensor=True needs a checkpoint holding a dict or a tensor, "
                        f"{in_file_path!r} holds a {type(state_dict).__name__}"
                    )
                obj = state_dict
            added.append(self._sha1_store.add(obj, compress=gzip))
            self._write_metadata(metadata_file, file_path, added[-1])
        except BaseException:
            for sha1 in reversed(added):
                try:
                    self._sha1_store.delete(sha1)
                except Exception as exc:  # noqa: BLE001 - the original error is the one to raise
                    logging.warning("Repo.add: could not give back the reference to %s: %s", sha1, exc)
            raise
        self._pygit.add()
        return None

    def commit(self, message: str) -> None:
        """Commits the staged changes with the given message."""
        self._sanity_check()
        if not isinstance(message, str):
            raise TypeError(f"Repo.commit: message must be a str, got {type(message).__name__}")
        self._pygit.commit(message)

    # Inspecting.

    def status(self) -> Dict[str, RepoStatus]:
        """{metadata path of each tracked file: its RepoStatus}; {"": CLEAN} for a repo that
        tracks nothing. A tracked file changed (or removed) since it was last added is
        CHANGES_NOT_ADDED; one added since the last commit CHANGES_ADDED_NOT_COMMITED."""
        self._sanity_check()
        staged = self._pygit.status()
        files = self._get_metdata_files()
        if not files:
            return {"": RepoStatus.CLEAN}
        out: Dict[str, RepoStatus] = {}
        for metadata_file, is_modified in files.items():
            if is_modified:
                out[metadata_file] = RepoStatus.CHANGES_NOT_ADDED
            elif metadata_file in staged:
                out[metadata_file] = RepoStatus.CHANGES_ADDED_NOT_COMMITED
            else:
                out[metadata_file] = RepoStatus.CLEAN
        return out

    def log(self, file: str = "") -> None:
        """Prints the history: a header line as FairScale's (``wgit log``, or ``wgit log of the
        file: FILE``), then one line per commit, newest first: ``<commit> <date> <message>``, and
        for a file the SHA1 of its version in that commit."""
        self._sanity_check()
        print(f"wgit log of the file: {file}" if file else "wgit log")
        for commit, date, message, version in self._history(file):
            suffix = f"  {SHA1_KEY} {version}" if version else ""
            print(f"{commit} {date} {message}{suffix}")

    def _history(self, file: str) -> List[Tuple[str, str, str, str]]:
        """(commit, ISO date, subject, the file's version SHA1 or "") per commit, newest first."""
        if not self._has_commits():
            return []
        args = ["log", "--format=%H%x1f%aI%x1f%s", "HEAD"]
        rel = ""
        if file:
            rel = self._rel_file_path(Path(file)).as_posix()
            args += ["--", rel]
        rows = []
        for line in run_git(self._wgit, args).splitlines():
            commit, date, subject = line.split("\x1f", 2)
            version = self._metadata_at(commit, rel).get(SHA1_KEY, "") if rel else ""
            rows.append((commit, date, subject, version))
        return rows

    def size_info(self, path: Optional[str] = None) -> SizeInfo:
        """Sizes of the whole repo, or of one tracked file's current version (its objects, each
        counted once per reference from it)."""
        self._sanity_check()
        if path is None:
            orig, dedup, comp = self._sha1_store.size_info()
            return SizeInfo(orig, dedup, dedup, comp)
        metadata = self._read_metadata(self._wgit.joinpath(self._rel_file_path(Path(path))), "path", path)
        counts: Dict[str, int] = {}
        top = metadata[SHA1_KEY]
        counts[top] = 1
        for ref in self._tensor_refs(self._sha1_store.get(top)):
            counts[ref] = counts.get(ref, 0) + 1
        orig = dedup = comp = 0
        for sha1, n in counts.items():
            o, d, c = self._sha1_store.size_info(sha1)
            size_once = d if d else o
            orig += size_once * n
            dedup += d
            comp += c
        return SizeInfo(orig, dedup, dedup, comp)

    # Checking out.

    def checkout(self, sha1: str) -> None:
        """Writes tracked checkpoints back as they were.

        ``sha1`` names either a commit of the repo (full, or a unique prefix of at least 4 hex
        digits, as ``log`` prints): every file tracked at that commit is written back and its
        metadata restored and staged; or the SHA1 of one file version (as ``log FILE`` prints):
        that file alone. Commit the result to make it the newest version.
        """
        self._sanity_check()
        if not isinstance(sha1, str) or len(sha1) < 4 or any(c not in "0123456789abcdefABCDEF" for c in sha1):
            raise ValueError(f"Repo.checkout: sha1 must be a hex string of at least 4 digits, got {sha1!r}")
        commit = self._resolve_commit(sha1)
        if commit is not None:
            rels = [p for p in run_git(self._wgit, ["ls-tree", "-r", "--name-only", "-z", commit]).split("\0") if p]
            targets = [(rel, self._metadata_at(commit, rel)) for rel in rels if self._is_metadata_path(rel)]
        else:
            targets = self._find_version(sha1.lower())
            if not targets:
                raise ValueError(f"Repo.checkout: sha1 {sha1} names no commit and no version of a tracked file")
        for rel, metadata in targets:
            self._restore(rel, metadata)
        self._pygit.add()

    def checkout_by_steps(self) -> None:
        """Not implemented (as in FairScale): checking out by training step."""
        self._sanity_check()
        raise NotImplementedError("Repo.checkout_by_steps is not implemented")

    def _restore(self, rel: str, metadata: Dict[str, Any]) -> None:
        """Writes the version in `metadata` to its file (atomically) and records it."""
        obj = self._sha1_store.get(metadata[SHA1_KEY])
        obj = apply_to_type(_is_ref, lambda x: self._sha1_store.get(x.dense_sha1), obj)
        target = Path(metadata[REL_PATH_KEY])
        target.parent.mkdir(parents=True, exist_ok=True)
        with atomic_file(target, target.parent) as f:
            torch.save(obj, f)
        metadata_file = self._wgit.joinpath(rel)
        metadata_file.parent.mkdir(parents=True, exist_ok=True)
        self._write_metadata(metadata_file, target, metadata[SHA1_KEY])

    def _resolve_commit(self, name: str) -> Optional[str]:
        if not self._has_commits():
            return None
        try:
            return run_git(self._wgit, ["rev-parse", "--verify", "--quiet", f"{name}^{{commit}}"]).strip() or None
        except Exception:
            return None

    def _find_version(self, sha1: str) -> List[Tuple[str, Dict[str, Any]]]:
        """(metadata path, metadata) of the file version whose SHA1 starts with `sha1`: the
        current metadata's, else the newest commit's that has it."""
        for path in self._get_metdata_files():
            metadata = self._read_metadata(self._wgit.joinpath(path), "file", path)
            if metadata[SHA1_KEY].startswith(sha1):
                return [(path, metadata)]
        if not self._has_commits():
            return []
        for commit in run_git(self._wgit, ["rev-list", "HEAD"]).split():
            rels = [p for p in run_git(self._wgit, ["ls-tree", "-r", "--name-only", "-z", commit]).split("\0") if p]
            for rel in rels:
                if self._is_metadata_path(rel):
                    metadata = self._metadata_at(commit, rel)
                    if metadata.get(SHA1_KEY, "").startswith(sha1):
                        return [(rel, metadata)]
        return []

    def _has_commits(self) -> bool:
        try:
            run_git(self._wgit, ["rev-parse", "--verify", "--quiet", "HEAD"])
            return True
        except Exception:
            return False

    def _metadata_at(self, commit: str, rel: str) -> Dict[str, Any]:
        try:
            return json.loads(run_git(self._wgit, ["show", f"{commit}:{rel}"]))
        except Exception:
            return {}

    @staticmethod
    def _is_metadata_path(rel: str) -> bool:
        return Path(rel).parts[0] not in _NOT_METADATA

    def _tensor_refs(self, obj: Any) -> List[str]:
        refs: List[str] = []
        apply_to_type(_is_ref, lambda x: refs.append(x.dense_sha1), obj)
        return refs

    # Metadata files.

    def _get_metdata_files(self) -> Dict[str, bool]:
        """{metadata path relative to ``.wgit``: whether its checkpoint changed since added}."""
        out: Dict[str, bool] = {}
        for entry in sorted(self._wgit.iterdir()):
            if entry.name in _NOT_METADATA:
                continue
            paths = [entry] if entry.is_file() else sorted(entry.rglob("*"))
            for path in paths:
                if path.is_file() and not path.name.startswith(".w-"):  # not a write in progress
                    out[path.relative_to(self._wgit).as_posix()] = self._is_file_modified(path)
        return out

    def _is_metadata_file(self, file: Path) -> bool:
        """True when `file` is a JSON object with exactly the metadata keys."""
        try:
            metadata = json.loads(Path(file).read_text())
        except (OSError, ValueError):
            return False
        return isinstance(metadata, dict) and set(metadata) == {SHA1_KEY, LAST_MODIFIED_TS_KEY, REL_PATH_KEY}

    def _is_file_modified(self, file: Path) -> bool:
        """True when the checkpoint recorded in metadata file `file` was modified or removed
        since its last add."""
        metadata = self._read_metadata(file, "file", file)
        try:
            mtime = Path(metadata[REL_PATH_KEY]).stat().st_mtime
        except FileNotFoundError:
            return True
        return mtime != metadata[LAST_MODIFIED_TS_KEY]

    def _read_metadata(self, file: Path, arg: str, value: Any) -> Dict[str, Any]:
        try:
            metadata = json.loads(Path(file).read_text())
        except FileNotFoundError:
            raise ValueError(f"wgit: {arg} {str(value)!r} is not tracked") from None
        except ValueError as e:
            raise ValueError(f"wgit: metadata file {file} is not valid JSON ({e})") from None
        if not isinstance(metadata, dict) or not {SHA1_KEY, LAST_MODIFIED_TS_KEY, REL_PATH_KEY} <= set(metadata):
            raise ValueError(f"wgit: {file} is not a wgit metadata file")
        return metadata

    def _process_metadata_file(self, metadata_fname: Path) -> Path:
        """The metadata file for a checkpoint, created empty with its directories if new."""
        metadata_file = self._wgit.joinpath(metadata_fname)
        metadata_file.parent.mkdir(parents=True, exist_ok=True)
        if not metadata_file.exists():
            metadata_file.touch()
        return metadata_file

    def _write_metadata(self, metadata_file: Path, file_path: Path, sha1: str) -> None:
        """Records a checkpoint version (atomically): its SHA1, modification time and path."""
        metadata = {SHA1_KEY: sha1, LAST_MODIFIED_TS_KEY: Path(file_path).stat().st_mtime, REL_PATH_KEY: str(file_path)}
        with atomic_file(metadata_file, metadata_file.parent) as f:
            f.write(json.dumps(metadata, ensure_ascii=False, indent=4).encode("utf-8"))

    def _rel_file_path(self, filepath: Path) -> Path:
        """Where a checkpoint's metadata file goes under ``.wgit``: FairScale's rule, the
        checkpoint's absolute path from the depth of the current directory's last component on
        (``./ckpt.pt`` run in ``/a/b`` gives ``b/ckpt.pt``)."""
        parts = filepath.resolve().parts
        depth = min(len(parts), len(Path.cwd().parts)) - 1
        return Path(*parts[depth:])
