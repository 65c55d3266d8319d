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

Directory layout::

    manifest.json              {"format", "tag", "step", "world_size", "shards": [{"rank", "file", "bytes", "sha256"}]}
    shard-<tag>-rank<r>.pt     rank r's state of checkpoint <tag>
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["CheckpointError", "save_sharded", "load_sharded", "load_all_shards", "read_manifest"]

MANIFEST = "manifest.json"
FORMAT = "fairscale_c.sharded_checkpoint/1"
_KEY = "__fairscale_c_shard__"  # the header every shard file carries next to the state
_SHARD = re.compile(r"^\.?shard-([0-9a-f]+)-rank([0-9]+)\.pt(\.tmp)?$")


class CheckpointError(ValueError):
    """A sharded checkpoint that cannot be loaded as one consistent set, or a save that failed on
    some rank (the previous checkpoint is then unchanged)."""


def _rank_and_world(group: Any) -> Tuple[int, int]:
    if group is None and not (dist.is_available() and dist.is_initialized()):
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


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _write_durably(path: str, write: Any) -> None:
    """write(file) into a temporary name next to `path`, fsync, rename over `path`."""
    tmp = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(os.path.dirname(path))


def _remove_stale(directory: str, keep: str, rank: int, world: int) -> None:
    """After a commit: this rank's shard files of other checkpoints (and leftovers of saves that
    never committed); rank 0 also those of ranks the new world no longer has."""
    for name in os.listdir(directory):
        m = _SHARD.match(name)
        if m is None or name == keep:
            continue
        r = int(m.group(2))
        if r == rank or (rank == 0 and r >= world):
            try:
                os.unlink(os.path.join(directory, name))
            except FileNotFoundError:
                pass


def save_sharded(state: Any, directory: str, group: Any = None, *, step: Optional[int] = None) -> str:
    """Save this rank's ``state`` as part of one checkpoint of every rank of ``group`` (a
    torch.distributed process group; default: the default group, or world size 1 when
    torch.distributed is not initialised). A collective: every rank calls it, with the same
    ``directory``, which every rank must see (a shared filesystem across hosts). ``step`` (an int,
    optional) is recorded in the manifest.

    Returns the path of this rank's committed shard. When any rank fails to write its shard,
    every rank raises :class:`CheckpointError` and the previous checkpoint stays the current one;
    when a rank dies or stalls, the others raise DistributedError within FAIRSCALE_C_TIMEOUT, with
    the same guarantee."""
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        raise TypeError(f"save_sharded: argument 'step' must be an int or None, got {type(step).__name__}")
    rank, world = _rank_and_world(group)
    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    tag = _all_gather(secrets.token_hex(8) if rank == 0 else None, group, world)[0]
    name = f"shard-{tag}-rank{rank}.pt"
    path = os.path.join(directory, name)
    header = {"format": FORMAT, "tag": tag, "rank": rank, "world_size": world, "step": step}
    try:
        _write_durably(path, lambda f: torch.save({_KEY: header, "state": state}, f))
        entry: Dict[str, Any] = {"rank": rank, "file": name, "bytes": os.path.getsize(path), "sha256": _sha256(path)}
    except Exception as exc:  # told to every rank below, then raised here
        entry = {"rank": rank, "error": f"{type(exc).__name__}: {exc}"}
        error: Optional[BaseException] = exc
    else:
        error = None
    entries = _all_gather(entry, group, world)  # also: every rank has written and synced its file
    failed = [e for e in entries if "error" in e]
    if failed:
        if error is None and os.path.exists(path):
            os.unlink(path)
        raise CheckpointError(
            f"save_sharded({directory!r}): "
            + "; ".join(f"rank {e['rank']} could not write its shard ({e['error']})" for e in failed)
            + "; the previous checkpoint is unchanged"
        ) from error
    commit_error = None
    if rank == 0:
        manifest = {"format": FORMAT, "tag": tag, "step": step, "world_size": world, "shards": entries}
        try:
            _write_durably(
                os.path.join(directory, MANIFEST), lambda f: f.write(json.dumps(manifest, indent=1).encode())
            )
        except Exception as exc:
            commit_error = f"{type(exc).__name__}: {exc}"
    commit_error = _all_gather(commit_error, group, world)[0]  # nobody returns before the commit
    if commit_error is not None:
        raise CheckpointError(
            f"save_sharded({directory!r}): rank 0 could not write {MANIFEST} ({commit_error}); the previous "
            "checkpoint is unchanged"
        )
    _remove_stale(directory, name, rank, world)
    return path


def read_manifest(directory: str) -> Dict[str, Any]:
    """The manifest of the checkpoint in ``directory``: format, tag, step, world_size and the
    shards' files, sizes and checksums. FileNotFoundError when there is none (nothing was ever
    committed there), CheckpointError when it is not one."""
    path = os.path.join(directory, MANIFEST)
    with open(path, "rb") as f:
        raw = f.read()
    try:
        manifest = json.loads(raw)
        ok = manifest["format"] == FORMAT and [s["rank"] for s in manifest["shards"]] == list(
            range(manifest["world_size"])
        )
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise CheckpointError(f"{path} is not a {FORMAT} manifest")
    return manifest


def _load_shard(
    directory: str, manifest: Dict[str, Any], rank: int, verify: bool, map_location: Any, weights_only: bool
) -> Any:
    entry = manifest["shards"][rank]
    path = os.path.join(directory, entry["file"])
    where = f"checkpoint {directory!r} (step {manifest['step']}, tag {manifest['tag']})"
    if not os.path.isfile(path):
        raise CheckpointError(f"{where}: rank {rank}'s shard {entry['file']} named by the manifest is missing")
    size = os.path.getsize(path)
    if size != entry["bytes"]:
        raise CheckpointError(
            f"{where}: rank {rank}'s shard {entry['file']} has {size} bytes, the manifest says {entry['bytes']}"
        )
    if verify and _sha256(path) != entry["sha256"]:
        raise CheckpointError(
            f"{where}: rank {rank}'s shard {entry['file']} does not match the manifest's checksum (a file of "
            "another checkpoint, or a damaged one)"
        )
    payload = torch.load(path, map_location=map_location, weights_only=weights_only)
    header = payload.get(_KEY) if isinstance(payload, dict) else None
    if header is None or (header["tag"], header["rank"], header["world_size"]) != (
        manifest["tag"],
        rank,
        manifest["world_size"],
    ):
        raise CheckpointError(
            f"{where}: {entry['file']} holds "
            + ("no shard header" if header is None else f"rank {header['rank']} of checkpoint {header['tag']}")
            + f"; expected rank {rank} of checkpoint {manifest['tag']} (a set mixed from two saves)"
        )
    return payload["state"]


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
    rank, world = _rank_and_world(group)
    manifest = read_manifest(directory)
    if manifest["world_size"] != world:
        raise CheckpointError(
            f"load_sharded({directory!r}): the checkpoint was saved by {manifest['world_size']} ranks and is "
            f"loaded by {world}; expected the same world size (load_all_shards + "
            "consolidate_shard_weights rebuild full weights for another one)"
        )
    return _load_shard(directory, manifest, rank, verify, map_location, weights_only)


def load_all_shards(
    directory: str, *, map_location: Any = "cpu", verify: bool = True, weights_only: bool = True
) -> List[Any]:
    """Every rank's state from the checkpoint last committed in ``directory``, in rank order and
    checked as by :func:`load_sharded`: what offline consolidation
    (``FullyShardedDataParallel.consolidate_shard_weights``) needs. Not a collective."""
    manifest = read_manifest(directory)
    return [
        _load_shard(directory, manifest, r, verify, map_location, weights_only) for r in range(manifest["world_size"])
    ]
