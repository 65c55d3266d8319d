"""Sharded checkpoints that are all-or-nothing across ranks.

Every rank saves its own state (an FSDP ``local_state_dict()`` with its ``local_metadata_dict()``,
optimizer state, anything ``torch.save`` takes) into one directory that every rank sees::

    from fairscale_c.utils.checkpoint import save_sharded, load_sharded, load_all_shards

    save_sharded({"weights": model.local_state_dict(), "metadata": model.local_metadata_dict(),
                  "optim": optim.state_dict()}, ckpt_dir, step=step)      # collective
    state = load_sharded(ckpt_dir)                                      # this rank's
    shards = load_all_shards(ckpt_dir)                                  # offline: every rank's

A save writes each rank's file under a name no committed checkpoint uses, waits until every rank
has written and synced its file, and only then commits: rank 0 replaces ``manifest.json`` (step,
world size, and each shard's file, size and SHA-256) in one atomic rename. Until that rename the
previous manifest, and the files it names, are untouched; so a rank killed at any point of a
save leaves the previous checkpoint complete and loadable, and the new files are removed by the
next successful save. Loading reads the manifest and checks the shard against it (size,
checksum, and the checkpoint id, rank and world size stored inside the file): a set mixed from
two saves, a truncated file or a checkpoint of another world size is a :class:`CheckpointError`.

After a commit each rank removes its files of the checkpoint the commit replaced and the leftovers
of saves that never committed. A file that a save in progress is writing is locked
(``flock``, shared) from its creation to the end of that save, and a file is removed only under an
exclusive lock and only when the manifest on disk does not name it; so two saves into one
directory at once (two jobs, or two groups of one job) never remove each other's files: the later
commit wins, and each save either commits or raises. A load that races a save's clean-up reads
the manifest again and retries.

Directory layout::

    manifest.json              {"format", "tag", "step", "world_size", "shards": [{"rank", "file", "bytes", "sha256"}]}
    shard-<tag>-rank<r>.pt     rank r's state of checkpoint <tag>
    .<name>.<hex>.tmp          a file being written (renamed to <name> once complete)
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from .. import DistributedError
from .. import distributed as fdist

__all__ = ["CheckpointError", "save_sharded", "load_sharded", "load_all_shards", "read_manifest"]

MANIFEST = "manifest.json"
FORMAT = "fairscale_c.sharded_checkpoint/1"
_KEY = "__fairscale_c_shard__"  # the header every shard file carries next to the state
# What a save may leave behind: a shard (committed or not) or a temporary file of a shard or manifest.
_LEFTOVER = re.compile(
    r"^(?:\.?shard-([0-9a-f]+)-rank([0-9]+)\.pt(?:\.(?:[0-9a-f]+\.)?tmp)?|\.manifest\.json\.[0-9a-f]+\.tmp)$"
)
_TAG = re.compile(r"^[0-9a-f]+$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_LOAD_ATTEMPTS = 5  # a load that races other saves' commits reads the manifest again this often


class CheckpointError(ValueError):
    """A sharded checkpoint that cannot be loaded as one consistent set, or a save that failed on
    some rank (the previous checkpoint is then unchanged)."""


def _rank_and_world(group: Any) -> Tuple[int, int]:
    if group is None and not (dist.is_available() and dist.is_initialized()):
        fdist.require_initialised_world("save_sharded / load_sharded (group=None)")
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _all_gather(obj: Any, group: Any, world: int) -> List[Any]:
    """Every rank's `obj` (JSON: the tag, shard entries and errors), in rank order. A collective
    on the group's engine group, so a peer that dies or stalls is a DistributedError within
    FAIRSCALE_C_TIMEOUT, as for every other collective (torch's object collectives would wait
    for the process group's own timeout, 30 minutes by default on gloo)."""
    if world == 1:
        return [obj]
    from .. import distributed as fdist

    engine = fdist.group_for(group)
    data = json.dumps(obj).encode()
    sizes = torch.empty(world, dtype=torch.int64)
    engine.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64))
    longest = int(sizes.max())
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # JSON is never empty
    every = torch.empty(world * longest, dtype=torch.uint8)
    engine.all_gather(every, mine)
    raw = every.numpy().tobytes()
    return [json.loads(raw[r * longest : r * longest + int(sizes[r])]) for r in range(world)]


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _DirectoryNotSynced(OSError):
    """The rename happened, but syncing the directory afterwards failed."""


def _create_locked(path: str) -> Any:
    """Create `path` for writing and reading, holding a shared flock on it until it is closed. A
    clean-up that removed the name between the creation and the lock (it found the file unlocked)
    makes us create it again."""
    for _ in range(100):
        f = open(path, "w+b")
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_SH)
        except OSError:  # a filesystem without flock: the file must not stay behind
            f.close()
            os.unlink(path)
            raise
        try:
            if os.stat(path).st_ino == os.fstat(f.fileno()).st_ino:
                return f
        except FileNotFoundError:
            pass
        f.close()
    raise OSError(errno.EAGAIN, f"{path} was removed each time it was created")


def _write_durably(path: str, write: Any) -> Any:
    """write(file) into a temporary name next to `path`, fsync, rename over `path`, fsync the
    directory. Returns the file, still open and locked (see _create_locked): the caller closes it
    when its save ends."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{secrets.token_hex(4)}.tmp")
    f = _create_locked(tmp)
    try:
        write(f)
        f.flush()
        os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        f.close()
        raise
    try:
        _fsync_dir(os.path.dirname(path))
    except OSError as exc:
        f.close()
        raise _DirectoryNotSynced(exc.errno, f"syncing the directory after writing {path}: {exc}") from exc
    return f


def _sha256_of(f: Any) -> str:
    h = hashlib.sha256()
    f.seek(0)
    for block in iter(lambda: f.read(1 << 22), b""):
        h.update(block)
    return h.hexdigest()


def _current_tag(directory: str) -> Optional[str]:
    try:
        return read_manifest(directory)["tag"]
    except (OSError, CheckpointError):
        return None


def _remove_stale(directory: str, keep: str, rank: int, world: int) -> None:
    """After a commit: this rank's shard files of other checkpoints (the one the commit replaced,
    and leftovers of saves that never committed); rank 0 also those of ranks the new world no
    longer has, and leftover manifest files. A file is removed only when no save or load holds it
    (an exclusive flock succeeds) and the manifest on disk does not name it. Failures are warned
    about, never raised: the save has committed."""
    try:
        names = os.listdir(directory)
    except OSError as exc:
        warnings.warn(f"save_sharded({directory!r}): could not list it to remove old shards: {exc}", stacklevel=3)
        return
    for name in names:
        m = _LEFTOVER.match(name)
        if m is None:
            continue
        tag, r = m.group(1), m.group(2)
        if tag == keep or not (rank == 0 if r is None else int(r) == rank or (rank == 0 and int(r) >= world)):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        except OSError as exc:
            warnings.warn(f"save_sharded: could not remove the old file {path}: {exc}", stacklevel=3)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if tag is None or tag != _current_tag(directory):
                os.unlink(path)
        except BlockingIOError:
            pass  # a save in progress, or a load, holds it
        except FileNotFoundError:
            pass
        except OSError as exc:
            warnings.warn(f"save_sharded: could not remove the old file {path}: {exc}", stacklevel=3)
        finally:
            os.close(fd)


def _check_directory(directory: Any, fn: str) -> str:
    try:
        path = os.fspath(directory)
    except TypeError:
        path = None
    if not isinstance(path, str) or path == "":
        raise TypeError(
            f"{fn}: argument 'directory' must be a non-empty str or os.PathLike path, got "
            + (repr(directory) if isinstance(directory, (str, bytes)) else type(directory).__name__)
        )
    return path


def _write_error(exc: BaseException, directory: str, name: str) -> str:
    """What went wrong writing `name`, with the space left when the disk may be full (torch.save
    reports a short write as 'unexpected pos', without the errno)."""
    text = f"{type(exc).__name__}: {exc} (writing {name}"
    try:
        st = os.statvfs(directory)
        text += f"; {st.f_bavail * st.f_frsize} bytes free on its filesystem"
    except OSError:
        pass
    return text + ")"


def save_sharded(state: Any, directory: str, group: Any = None, *, step: Optional[int] = None) -> str:
    """Save this rank's ``state`` as part of one checkpoint of every rank of ``group`` (a
    torch.distributed process group; default: the default group, or world size 1 when
    torch.distributed is not initialised). A collective: every rank calls it, with the same
    ``directory``, which every rank must see (a shared filesystem across hosts). ``step`` (an int,
    optional) is recorded in the manifest.

    Returns the path of this rank's committed shard. When any rank fails to write its shard, or
    rank 0 fails to write the manifest, every rank raises :class:`CheckpointError`, the previous
    checkpoint stays the current one and the new shards are removed. When a rank dies or stalls,
    the others raise DistributedError within FAIRSCALE_C_TIMEOUT: before every rank's shard was
    exchanged, the previous checkpoint stays the current one (the new files are left for the next
    save to remove); after it, rank 0 may still commit the new, complete checkpoint, and its error
    then says so. After a failed save, the manifest on disk says which checkpoint is current."""
    directory = _check_directory(directory, "save_sharded")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        raise TypeError(f"save_sharded: argument 'step' must be an int or None, got {type(step).__name__}")
    rank, world = _rank_and_world(group)
    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    tag = _all_gather(secrets.token_hex(8) if rank == 0 else None, group, world)[0]
    name = f"shard-{tag}-rank{rank}.pt"
    path = os.path.join(directory, name)
    header = {"format": FORMAT, "tag": tag, "rank": rank, "world_size": world, "step": step}
    held = None  # this rank's new shard, open and locked until the save ends
    try:
        held = _write_durably(path, lambda f: torch.save({_KEY: header, "state": state}, f))
        entry: Dict[str, Any] = {"rank": rank, "file": name, "bytes": os.fstat(held.fileno()).st_size}
        entry["sha256"] = _sha256_of(held)
    except Exception as exc:  # told to every rank below, then raised here
        entry = {"rank": rank, "error": _write_error(exc, directory, name)}
        error: Optional[BaseException] = exc
    else:
        error = None
    try:
        entries = _all_gather(entry, group, world)  # also: every rank has written and synced its file
        failed = [e for e in entries if "error" in e]
        if failed:
            _unlink_quietly(path)  # also a file of this rank's that failed after its rename
            raise CheckpointError(
                f"save_sharded({directory!r}): "
                + "; ".join(f"rank {e['rank']} could not write its shard ({e['error']})" for e in failed)
                + "; the previous checkpoint is unchanged"
            ) from error
        commit: Optional[Dict[str, Any]] = None
        if rank == 0:
            manifest = {"format": FORMAT, "tag": tag, "step": step, "world_size": world, "shards": entries}
            try:
                _write_durably(
                    os.path.join(directory, MANIFEST), lambda f: f.write(json.dumps(manifest, indent=1).encode())
                ).close()
            except _DirectoryNotSynced as exc:
                commit = {"replaced": True, "error": f"{type(exc).__name__}: {exc}"}
            except Exception as exc:
                commit = {"replaced": False, "error": f"{type(exc).__name__}: {exc}"}
        try:
            commit = _all_gather(commit, group, world)[0]  # nobody returns before the commit
        except DistributedError as exc:
            if rank != 0 or commit is not None:
                raise
            # a rank died or stalled after the shards were exchanged: the manifest is written
            raise DistributedError(
                f"{exc}; rank 0 had already committed this save before that ({MANIFEST} in {directory!r} names it, "
                "and every shard it names was written and synced): the new checkpoint is complete and current"
            ) from exc
        if commit is not None and commit["replaced"]:
            raise CheckpointError(
                f"save_sharded({directory!r}): {MANIFEST} now names this save, but rank 0 could not sync the "
                f"directory ({commit['error']}); the new checkpoint may not survive a crash of the machine, and "
                "the previous one's files were kept"
            )
        if commit is not None:
            _unlink_quietly(path)
            raise CheckpointError(
                f"save_sharded({directory!r}): rank 0 could not write {MANIFEST} ({commit['error']}); the previous "
                "checkpoint is unchanged"
            )
        _remove_stale(directory, tag, rank, world)
    finally:
        if held is not None:
            held.close()
    return path


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        warnings.warn(f"save_sharded: could not remove the uncommitted shard {path}: {exc}", stacklevel=3)


def _is_int(v: Any, least: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


def _manifest_problem(manifest: Any) -> Optional[str]:
    """Why `manifest` is not a well-formed manifest, or None."""
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        return f"it is not a {FORMAT} manifest"
    tag, world, step, shards = (manifest.get(k) for k in ("tag", "world_size", "step", "shards"))
    if not isinstance(tag, str) or not _TAG.match(tag):
        return f"its 'tag' is {tag!r}, expected a hexadecimal str"
    if not _is_int(world, 1):
        return f"its 'world_size' is {world!r}, expected an int >= 1"
    if step is not None and not _is_int(step, -(2**63)):
        return f"its 'step' is {step!r}, expected an int or null"
    if not isinstance(shards, list) or len(shards) != world:
        return f"it lists {len(shards) if isinstance(shards, list) else shards!r} shards for world size {world}"
    for r, e in enumerate(shards):
        ok = (
            isinstance(e, dict)
            and e.get("rank") == r
            and e.get("file") == f"shard-{tag}-rank{r}.pt"
            and _is_int(e.get("bytes"), 0)
            and isinstance(e.get("sha256"), str)
            and _SHA256.match(e["sha256"]) is not None
        )
        if not ok:
            return f"its shard entry {r} is {e!r}, expected rank {r}, file shard-{tag}-rank{r}.pt, bytes and sha256"
    return None


def read_manifest(directory: str) -> Dict[str, Any]:
    """The manifest of the checkpoint in ``directory``: format, tag, step, world_size and the
    shards' files, sizes and checksums. FileNotFoundError when there is none (nothing was ever
    committed there), CheckpointError when it is not one."""
    path = os.path.join(_check_directory(directory, "read_manifest"), MANIFEST)
    with open(path, "rb") as f:
        raw = f.read()
    try:
        manifest = json.loads(raw)
    except ValueError as exc:
        problem: Optional[str] = f"it is not JSON ({exc})"
    else:
        problem = _manifest_problem(manifest)
    if problem is not None:
        raise CheckpointError(f"{path} is not a {FORMAT} manifest: {problem}")
    return manifest


class _Superseded(Exception):
    """A shard named by the manifest was gone: another save may have committed meanwhile."""


def _load_shard(
    directory: str, manifest: Dict[str, Any], rank: int, verify: bool, map_location: Any, weights_only: bool
) -> Any:
    entry = manifest["shards"][rank]
    path = os.path.join(directory, entry["file"])
    where = f"checkpoint {directory!r} (step {manifest['step']}, tag {manifest['tag']})"
    try:
        f = open(path, "rb")  # one open file for every check and the load: a later unlink does not matter
    except FileNotFoundError:
        raise _Superseded(f"{where}: rank {rank}'s shard {entry['file']} named by the manifest is missing") from None
    with f:
        size = os.fstat(f.fileno()).st_size
        if size != entry["bytes"]:
            raise CheckpointError(
                f"{where}: rank {rank}'s shard {entry['file']} has {size} bytes, the manifest says {entry['bytes']}"
            )
        if verify and _sha256_of(f) != entry["sha256"]:
            raise CheckpointError(
                f"{where}: rank {rank}'s shard {entry['file']} does not match the manifest's checksum (a file of "
                "another checkpoint, or a damaged one)"
            )
        f.seek(0)
        try:
            payload = torch.load(f, map_location=map_location, weights_only=weights_only)
        except Exception as exc:
            raise CheckpointError(f"{where}: rank {rank}'s shard {entry['file']} cannot be loaded: {exc}") from exc
    header = payload.get(_KEY) if isinstance(payload, dict) else None
    if not isinstance(header, dict) or (header.get("tag"), header.get("rank"), header.get("world_size")) != (
        manifest["tag"],
        rank,
        manifest["world_size"],
    ):
        raise CheckpointError(
            f"{where}: {entry['file']} holds "
            + (
                "no shard header"
                if not isinstance(header, dict)
                else f"rank {header.get('rank')} of checkpoint {header.get('tag')}"
            )
            + f"; expected rank {rank} of checkpoint {manifest['tag']} (a set mixed from two saves)"
        )
    return payload["state"]


def _load_committed(directory: str, ranks: Any, world: Optional[int], fn: str, **kw: Any) -> List[Any]:
    """The states of `ranks` (all when None) from the manifest on disk. A shard that vanished after
    the manifest was read is retried with the manifest read again, when another save has
    committed since."""
    attempt = 0
    while True:
        attempt += 1
        manifest = read_manifest(directory)
        if world is not None and manifest["world_size"] != world:
            raise CheckpointError(
                f"{fn}({directory!r}): the checkpoint was saved by {manifest['world_size']} ranks and is "
                f"loaded by {world}; expected the same world size (load_all_shards + "
                "consolidate_shard_weights rebuild full weights for another one)"
            )
        todo = range(manifest["world_size"]) if ranks is None else ranks
        try:
            return [_load_shard(directory, manifest, r, **kw) for r in todo]
        except _Superseded as exc:
            if attempt < _LOAD_ATTEMPTS and _current_tag(directory) not in (None, manifest["tag"]):
                continue
            raise CheckpointError(str(exc)) from None


def load_sharded(
    directory: str,
    group: Any = None,
    *,
    map_location: Any = "cpu",
    verify: bool = True,
    weights_only: bool = True,
) -> Any:
    """This rank's state from the checkpoint last committed in ``directory`` by
    :func:`save_sharded`, checked against its manifest (size, SHA-256 when ``verify``, checkpoint
    id, rank and world size). ``group`` as for save_sharded; the world size must be the one the
    checkpoint was saved at. Not a collective. ``map_location`` and ``weights_only`` go to
    ``torch.load``."""
    directory = _check_directory(directory, "load_sharded")
    rank, world = _rank_and_world(group)
    kw = {"verify": verify, "map_location": map_location, "weights_only": weights_only}
    return _load_committed(directory, [rank], world, "load_sharded", **kw)[0]


def load_all_shards(
    directory: str, *, map_location: Any = "cpu", verify: bool = True, weights_only: bool = True
) -> List[Any]:
    """Every rank's state from the checkpoint last committed in ``directory``, in rank order and
    checked as by :func:`load_sharded`: what offline consolidation
    (``FullyShardedDataParallel.consolidate_shard_weights``) needs. Not a collective."""
    directory = _check_directory(directory, "load_all_shards")
    kw = {"verify": verify, "map_location": map_location, "weights_only": weights_only}
    return _load_committed(directory, None, None, "load_all_shards", **kw)
