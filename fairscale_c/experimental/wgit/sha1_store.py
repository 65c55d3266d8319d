"""SHA1_Store: a content-addressed store of files, tensors and state dicts — mirrors
fairscale.experimental.wgit.sha1_store, with FairScale's on-disk layout.

Layout under the store's directory (FairScale 0.4.13's, so either library reads the other's):
``metadata.json`` (the store's sizes and creation date, then one entry per object: reference count,
whether it is compressed, original / deduplicated / compressed sizes, the names it was added
under) and one file per object at ``<sha1[:2]>/<sha1[2:4]>/<sha1>``. An object is the pickle of
the input with every tensor turned into a numpy array (``fairscale_c.internal.containers.to_np``),
or a pickle file's own bytes; its SHA1 is that of those bytes. Compressed objects are gzip
streams of 10 MiB members, compressed on several threads (the format FairScale's pgzip writes and
reads).

What differs from FairScale:
- Every write is atomic: an object or ``metadata.json`` is written to a temporary file, flushed to
  disk and renamed into place, under an exclusive lock on the store, so processes adding at once
  and a crash at any point leave a consistent store.
- Reading an object unpickles only what the store writes (numpy arrays, dicts, lists, tuples,
  OrderedDicts, numbers, strings, torch.Size, wgit's tensor references), like
  ``torch.load(weights_only=True)``; ``get(sha1, weights_only=False)`` unpickles anything, for
  pickle files of your own. A file is recognised as a pickle without running it.
- Tensors of a dtype numpy lacks (bfloat16, float8 kinds) are stored bit for bit as an integer
  array with their dtype's name, and come back as themselves.
- An object keeps the compression it was first stored with (FairScale records the last add's flag
  even when that add stored nothing, and then cannot read the object).
- Errors are exceptions naming the argument; FairScale asserts or exits the process.
"""

from __future__ import annotations

import contextlib
import fcntl
import gzip
import hashlib
import io
import json
import logging
import os
import pickle
import pickletools
import struct
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple, Union

import numpy as np
import torch
from torch import Tensor

from fairscale_c.distributed import timeout_s
from fairscale_c.internal.containers import apply_to_type

__all__ = ["SHA1_Store"]

# metadata.json keys, FairScale's (a store written by either library is read by the other).
ENTRY_RF_KEY = "ref_count"
ENTRY_COMP_KEY = "compressed"
ENTRY_OS_KEY = "original_size"
ENTRY_DS_KEY = "deduped_size"
ENTRY_CS_KEY = "compressed_size"
ENTRY_NAMES_KEY = "names"
STORE_CREATE_DATE_KEY = "created_on"
STORE_OS_KEY = "original_size"
STORE_DS_KEY = "deduped_size"
STORE_CS_KEY = "compressed_size"

_GZIP_LEVEL = 5
_LOCK_NAME = ".lock"


@dataclass
class _BitcastArray:
    """A tensor whose dtype numpy lacks, kept as an integer array of the same bits."""

    dtype: str  # torch dtype name, e.g. "bfloat16"
    array: np.ndarray


_NUMPY_LESS = {torch.bfloat16: torch.int16}
for _name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _NUMPY_LESS[getattr(torch, _name)] = torch.uint8


def _tensor_to_np(t: Tensor) -> Any:
    t = t.detach().cpu()
    if t.dtype in _NUMPY_LESS:
        return _BitcastArray(str(t.dtype).removeprefix("torch."), t.view(_NUMPY_LESS[t.dtype]).numpy())
    try:
        return t.numpy()
    except TypeError as e:
        raise TypeError(f"SHA1_Store.add: a tensor of dtype {t.dtype} cannot be stored ({e})") from None


def _np_to_tensor(x: Any) -> Tensor:
    if isinstance(x, _BitcastArray):
        return torch.from_numpy(x.array).view(getattr(torch, x.dtype))
    return torch.from_numpy(x)


def _to_np(obj: Any) -> Any:
    return apply_to_type(torch.is_tensor, _tensor_to_np, obj)


def _from_np(obj: Any) -> Any:
    return apply_to_type(lambda x: isinstance(x, (np.ndarray, _BitcastArray)), _np_to_tensor, obj)


# Globals a store object may reference when read with weights_only=True.
_SAFE_GLOBALS = {
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    ("builtins", "complex"),
    ("builtins", "slice"),
    ("builtins", "bytearray"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("torch", "Size"),
    ("_codecs", "encode"),
}
# wgit's own records, under FairScale's module path as well as this package's.
_WGIT_CLASSES = {"_SHA1_Tensor": "repo", "_BitcastArray": "sha1_store"}


class _StoreUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _WGIT_CLASSES and module in (
            f"fairscale.experimental.wgit.{_WGIT_CLASSES[name]}",
            f"fairscale_c.experimental.wgit.{_WGIT_CLASSES[name]}",
        ):
            import importlib

            return getattr(importlib.import_module(f"fairscale_c.experimental.wgit.{_WGIT_CLASSES[name]}"), name)
        if (module, name) in _SAFE_GLOBALS or (module == "numpy.dtypes" and name.endswith("DType")):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(
            f"SHA1_Store.get: the object references {module}.{name}, which weights_only=True does not load; "
            "pass weights_only=False for an object you trust"
        )


def _is_single_pickle(path: Path) -> bool:
    """True when the file is exactly one pickle stream, checked by parsing its opcodes (nothing
    in it runs)."""
    try:
        with open(path, "rb") as f:
            for op, _, _ in pickletools.genops(f):
                if op.name == "STOP":
                    break
            else:
                return False
            return f.read(1) == b""
    except Exception:
        return False


def _blocks(f: io.BufferedReader, size: int) -> Iterator[bytes]:
    while True:
        block = f.read(size)
        if not block:
            return
        yield block


def _gzip_member(block: bytes) -> bytes:
    """One gzip member holding `block`, in pgzip's indexed form: the header's extra field ("IG")
    gives the member's total size, so a reader can find every member without inflating."""
    c = zlib.compressobj(_GZIP_LEVEL, zlib.DEFLATED, -15)  # -15: raw deflate, header written here
    body = c.compress(block) + c.flush()
    size = _IG_HEADER.size + len(body) + 8
    header = _IG_HEADER.pack(b"\x1f\x8b", 8, _FEXTRA, 0, 0, 255, 8, b"IG", 4, size)
    return header + body + struct.pack("<II", zlib.crc32(block), len(block) & 0xFFFFFFFF)


# magic, method (deflate), flags, mtime, extra flags, OS, XLEN, subfield id, subfield length,
# member size: the fixed 20-byte header of an indexed member.
_IG_HEADER = struct.Struct("<2sBBIBBH2sHI")
_FEXTRA = 4
_FNAME = 8


def _indexed_members(data: memoryview) -> Optional[List[Tuple[int, int, int]]]:
    """(start, size, header size) of every member when each carries its size (pgzip's "IG"
    field, optionally followed by a file name); None otherwise."""
    members = []
    pos = 0
    while pos < len(data):
        if len(data) - pos < _IG_HEADER.size:
            return None
        magic, method, flags, _, _, _, xlen, sid, slen, size = _IG_HEADER.unpack_from(data, pos)
        if magic != b"\x1f\x8b" or method != 8 or flags & ~_FNAME != _FEXTRA or xlen != 8 or sid != b"IG" or slen != 4:
            return None
        if size < _IG_HEADER.size + 8 or pos + size > len(data):
            return None
        header = _IG_HEADER.size
        if flags & _FNAME:
            end = bytes(data[pos + header : pos + size]).find(b"\0")
            if end < 0:
                return None
            header += end + 1
        members.append((pos, size, header))
        pos += size
    return members


def _inflate_member(member: memoryview, header: int) -> bytes:
    out = zlib.decompress(member[header:-8], -15)
    crc, isize = struct.unpack_from("<II", member, len(member) - 8)
    if zlib.crc32(out) != crc or len(out) & 0xFFFFFFFF != isize:
        raise OSError("SHA1_Store: a compressed object fails its CRC or size check")
    return out


class _ParallelInflater(io.RawIOBase):
    """A readable stream of indexed gzip members inflated on threads, a bounded number ahead of
    the reader."""

    def __init__(self, data: bytes, members: List[Tuple[int, int, int]], threads: Optional[int]) -> None:
        super().__init__()
        self._view = memoryview(data)
        self._todo = iter(members)
        workers = threads or os.cpu_count() or 1
        self._pool = ThreadPoolExecutor(workers)
        self._ahead = 2 * workers
        self._pending: List[Any] = []
        self._buf = memoryview(b"")
        self._fill()

    def _fill(self) -> None:
        while len(self._pending) < self._ahead:
            nxt = next(self._todo, None)
            if nxt is None:
                return
            start, size, header = nxt
            self._pending.append(self._pool.submit(_inflate_member, self._view[start : start + size], header))

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        while not self._buf and self._pending:
            self._buf = memoryview(self._pending.pop(0).result())
            self._fill()
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        return n

    def close(self) -> None:
        if not self.closed:
            self._pool.shutdown(wait=True, cancel_futures=True)
        super().close()


def _open_compressed(path: Path, threads: Optional[int]) -> io.BufferedIOBase:
    """A readable stream of a compressed object: inflated on threads when its members are
    indexed (what this store and pgzip write), else by gzip as it reads."""
    data = path.read_bytes()
    members = _indexed_members(memoryview(data))
    if members is None:
        return gzip.GzipFile(fileobj=io.BytesIO(data), mode="rb")
    return io.BufferedReader(_ParallelInflater(data, members, threads), buffer_size=1 << 20)


_MIN_MEMBER = 256 * 1024


def _copy_compressed(src: Path, dest: io.BufferedWriter, threads: Optional[int], blocksize: int) -> None:
    """Writes src to dest as gzip members compressed on `threads` threads (None: one per CPU;
    zlib releases the GIL while it compresses). A member holds at most `blocksize` input bytes,
    and fewer when that gives every thread a member (not under 256 KiB), so a file smaller than
    threads × blocksize is compressed in parallel too."""
    workers = threads or os.cpu_count() or 1
    size = src.stat().st_size
    blocksize = min(blocksize, max(_MIN_MEMBER, -(-size // workers)))
    with open(src, "rb") as f, ThreadPoolExecutor(workers) as pool:
        pending = []
        for block in _blocks(f, blocksize):
            pending.append(pool.submit(_gzip_member, block))
            if len(pending) > 2 * workers:  # bounded: at most this many blocks in memory
                dest.write(pending.pop(0).result())
        for fut in pending:
            dest.write(fut.result())
        if size == 0:
            dest.write(_gzip_member(b""))


@contextlib.contextmanager
def atomic_file(path: Path, tmp_dir: Path) -> Iterator[io.BufferedWriter]:
    """A file written under a temporary name in tmp_dir, flushed to disk and renamed to `path`
    when the block ends without an exception (removed otherwise)."""
    fd, name = tempfile.mkstemp(dir=tmp_dir, prefix=".w-")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(name, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)
        raise


def _entry(d: Dict[str, Any]) -> Dict[str, Any]:
    """An object's metadata entry with every key present (older stores may lack some)."""
    for key in (ENTRY_RF_KEY, ENTRY_OS_KEY, ENTRY_DS_KEY, ENTRY_CS_KEY):
        d.setdefault(key, 0)
    d.setdefault(ENTRY_COMP_KEY, False)
    d.setdefault(ENTRY_NAMES_KEY, {})
    return d


def _lock_store(path: Path) -> int:
    """An exclusive lock on the store (a descriptor of its lock file; closing it unlocks), waited
    for at most FAIRSCALE_C_TIMEOUT seconds (TimeoutError after)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + timeout_s()
    pause = 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise TimeoutError(
                    f"SHA1_Store: the store's lock {path} stayed held for {timeout_s():g} s (FAIRSCALE_C_TIMEOUT)"
                ) from None
            time.sleep(pause)
            pause = min(2 * pause, 0.05)


class _JSON_DictContext:
    """Loads metadata.json into the store's ``_json_dict`` for the block, and writes it back
    atomically at the end unless read-only. Writable blocks hold the store's lock."""

    def __init__(self, s: "SHA1_Store", readonly: bool) -> None:
        self._s = s
        self._readonly = readonly
        self._lock: Optional[int] = None

    def __enter__(self) -> None:
        if self._s._json_dict is not None:
            raise RuntimeError("SHA1_Store: metadata contexts do not nest")
        if not self._readonly:
            self._lock = _lock_store(self._s._path / _LOCK_NAME)
        try:
            path = self._s._metadata_file_path
            self._s._json_dict = json.loads(path.read_text()) if path.exists() else {}
        except BaseException:
            self._unlock()
            raise

    def __exit__(self, exc_type: Any, exc_value: Any, exc_traceback: Any) -> None:
        try:
            if not self._readonly and exc_type is None:
                with atomic_file(self._s._metadata_file_path, self._s._path) as f:
                    f.write(json.dumps(self._s._json_dict, ensure_ascii=False, indent=2).encode())
        finally:
            self._s._json_dict = None
            self._unlock()

    def _unlock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)  # closing the descriptor releases the lock
            self._lock = None


class SHA1_Store:
    """A directory of objects keyed by the SHA1 of their bytes, so identical content is stored
    once (deduplication), each with a reference count: every ``add`` of an object must be matched
    by a ``delete`` before it is removed.

    Args:
        path (Path): the store's directory.
        init (bool): create the store when the directory does not exist. Default: False.
        sha1_buf_size (int): bytes read at a time while hashing. Default: 100 MiB.
        tmp_dir (str): directory for temporary files ("" = ``<path>/tmp``); on the store's file
            system, so finished files are renamed into place.
        pgzip_threads (int, optional): threads compressing an object (None: one per CPU).
        pgzip_block_size (int): input bytes per gzip member. Default: 10 MiB.
    """

    def __init__(
        self,
        path: Path,
        init: bool = False,
        sha1_buf_size: int = 100 * 1024 * 1024,
        tmp_dir: str = "",
        pgzip_threads: Optional[int] = None,
        pgzip_block_size: int = 10 * 1024 * 1024,
    ) -> None:
        for name, value in (("sha1_buf_size", sha1_buf_size), ("pgzip_block_size", pgzip_block_size)):
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"SHA1_Store: {name} must be a positive int, got {value!r}")
        if pgzip_threads is not None and (not isinstance(pgzip_threads, int) or pgzip_threads <= 0):
            raise ValueError(f"SHA1_Store: pgzip_threads must be None or a positive int, got {pgzip_threads!r}")
        self._path = Path(path)
        self._sha1_buf_size = sha1_buf_size
        self._pgzip_threads = pgzip_threads
        self._pgzip_block_size = pgzip_block_size
        self._metadata_file_path = self._path / "metadata.json"
        self._json_dict: Optional[Dict[str, Any]] = None
        self._json_ctx = _JSON_DictContext(self, readonly=False)
        self._readonly_json_ctx = _JSON_DictContext(self, readonly=True)

        if init and not self._path.exists():
            self._path.mkdir(parents=False)
        if not self._metadata_file_path.exists():
            if not self._path.is_dir():
                raise FileNotFoundError(f"SHA1_Store: no store at path {self._path} (pass init=True to create one)")
            if not init:
                raise FileNotFoundError(f"SHA1_Store: {self._path} has no metadata.json, so it is not a store")
            with self._json_ctx:
                if not self._json_dict:  # another process may have created it meanwhile
                    self._json_dict = {
                        STORE_CREATE_DATE_KEY: time.ctime(),
                        STORE_OS_KEY: 0,
                        STORE_DS_KEY: 0,
                        STORE_CS_KEY: 0,
                    }
        with self._readonly_json_ctx:
            if STORE_CREATE_DATE_KEY not in self._json_dict:
                raise ValueError(f"SHA1_Store: {self._metadata_file_path} is not a store's metadata")

        if tmp_dir:
            if not Path(tmp_dir).is_dir():
                raise ValueError(f"SHA1_Store: tmp_dir must be an existing directory, got {tmp_dir!r}")
            self._tmp_dir = Path(tmp_dir)
        else:
            self._tmp_dir = self._path / "tmp"
            self._tmp_dir.mkdir(exist_ok=True)

    def add(
        self, file_or_obj: Union[Path, str, Tensor, Dict], compress: bool = True, name: Optional[str] = None
    ) -> str:
        """Adds a file (a pickle file as it is, a ``torch.save`` file as the object it holds), a
        tensor or a dict (e.g. a state_dict), and returns its SHA1. Adding content that is
        already stored only counts a reference. ``name`` is recorded with the object's names."""
        start = time.time()
        if isinstance(file_or_obj, (Path, str)):
            src = Path(file_or_obj)
            if not src.is_file():
                raise FileNotFoundError(f"SHA1_Store.add: file_or_obj {str(src)!r} is not a file")
            if not _is_single_pickle(src):
                file_or_obj = torch.load(src, map_location="cpu", weights_only=True)
        elif not isinstance(file_or_obj, (Tensor, dict)):
            raise TypeError(
                f"SHA1_Store.add: file_or_obj must be a path, a tensor or a dict, got {type(file_or_obj).__name__}"
            )
        tmp: Optional[Path] = None
        try:
            if not isinstance(file_or_obj, (Path, str)):
                tmp = self._get_tmp_file_path()
                with open(tmp, "wb") as f:
                    pickle.dump(_to_np(file_or_obj), f)
                src = tmp
            sha1 = self._get_sha1_hash(src)
            with self._json_ctx:
                self._store_and_count(sha1, src, compress, name)
        finally:
            if tmp is not None:
                tmp.unlink(missing_ok=True)
        duration = time.time() - start
        if duration > 60:
            logging.warning(f"SHA1_Store.add took {duration:.0f} s")
        return sha1

    def _store_and_count(self, sha1: str, src: Path, compress: bool, name: Optional[str]) -> None:
        """Under the store's lock: writes the object if it is new, then counts the reference."""
        assert self._json_dict is not None
        entry = _entry(self._json_dict.get(sha1, {}))
        dest = self._sha1_to_dir(sha1) / sha1
        size = src.stat().st_size
        if entry[ENTRY_RF_KEY] == 0 or not dest.exists():
            dest.parent.mkdir(parents=True, exist_ok=True)
            with atomic_file(dest, self._tmp_dir) as out:
                if compress:
                    _copy_compressed(src, out, self._pgzip_threads, self._pgzip_block_size)
                else:
                    with open(src, "rb") as f:
                        for block in _blocks(f, self._pgzip_block_size):
                            out.write(block)
            comp_size = dest.stat().st_size
            entry = _entry({ENTRY_NAMES_KEY: entry[ENTRY_NAMES_KEY]})
            entry.update({ENTRY_COMP_KEY: compress, ENTRY_OS_KEY: size, ENTRY_DS_KEY: size, ENTRY_CS_KEY: comp_size})
            d_diff, c_diff = size, comp_size
        else:
            entry[ENTRY_OS_KEY] += size
            d_diff = c_diff = 0
        entry[ENTRY_RF_KEY] += 1
        if name:
            entry[ENTRY_NAMES_KEY][name] = entry[ENTRY_NAMES_KEY].get(name, 0) + 1
        self._json_dict[sha1] = entry
        self._json_dict[STORE_OS_KEY] += size
        self._json_dict[STORE_DS_KEY] += d_diff
        self._json_dict[STORE_CS_KEY] += c_diff

    def get(self, sha1: str, weights_only: bool = True) -> Union[Tensor, Dict]:
        """The object stored under `sha1`, numpy arrays turned back into tensors. ValueError
        when there is none. ``weights_only=False`` unpickles any object (only for a store you
        trust)."""
        path = self._object_path(sha1, "get")
        with self._readonly_json_ctx:
            assert self._json_dict is not None
            compressed = self._json_dict.get(sha1, {}).get(ENTRY_COMP_KEY, False)
        with _open_compressed(path, self._pgzip_threads) if compressed else open(path, "rb") as f:
            obj = _StoreUnpickler(f).load() if weights_only else pickle.load(f)
        return _from_np(obj)

    def delete(self, sha1: str) -> None:
        """Drops one reference to `sha1`, and the object with the last one. ValueError when
        there is no such object."""
        path = self._object_path(sha1, "delete")
        with self._json_ctx:
            assert self._json_dict is not None
            if sha1 not in self._json_dict:
                raise ValueError(f"SHA1_Store.delete: sha1 {sha1} has a file but no metadata entry")
            entry = _entry(self._json_dict[sha1])
            entry[ENTRY_RF_KEY] -= 1
            if entry[ENTRY_RF_KEY] > 0:
                self._json_dict[sha1] = entry
                return
            del self._json_dict[sha1]
            path.unlink()

    def size_info(self, sha1: Optional[str] = None) -> Tuple[int, int, int]:
        """(original, deduplicated, compressed) bytes of one object (every add of it counted in
        original) or, without `sha1`, of the whole store."""
        with self._readonly_json_ctx:
            d = self._json_dict
            assert d is not None
            if sha1:
                if sha1 not in d:
                    raise ValueError(f"SHA1_Store.size_info: sha1 {sha1} not found")
                d = d[sha1]
            return d[STORE_OS_KEY], d[STORE_DS_KEY], d[STORE_CS_KEY]

    def names(self, sha1: Optional[str] = None) -> Dict[str, int]:
        """The names an object was added under, each with how many times."""
        with self._readonly_json_ctx:
            assert self._json_dict is not None
            if sha1 not in self._json_dict:
                raise ValueError(f"SHA1_Store.names: sha1 {sha1} not found")
            return dict(_entry(self._json_dict[sha1])[ENTRY_NAMES_KEY])

    def _object_path(self, sha1: str, op: str) -> Path:
        if not isinstance(sha1, str) or len(sha1) <= 4:
            raise ValueError(f"SHA1_Store.{op}: sha1 must be a SHA1 hex string, got {sha1!r}")
        path = self._sha1_to_dir(sha1) / sha1
        if not path.exists():
            raise ValueError(f"SHA1_Store.{op}: sha1 {sha1} not found")
        return path

    def _get_sha1_hash(self, file_path: Union[str, Path]) -> str:
        """The SHA1 of a file's bytes."""
        sha1 = hashlib.sha1()
        with open(file_path, "rb") as f:
            for block in _blocks(f, self._sha1_buf_size):
                sha1.update(block)
        return sha1.hexdigest()

    def _get_tmp_file_path(self) -> Path:
        """A new empty file in the temporary directory."""
        fd, name = tempfile.mkstemp(dir=self._tmp_dir)
        os.close(fd)
        return Path(name)

    def _sha1_to_dir(self, sha1: str) -> Path:
        """The directory an object lives in: two levels named by its first four hex digits."""
        if len(sha1) <= 4:
            raise ValueError(f"SHA1_Store: sha1 {sha1!r} is too short")
        return self._path / sha1[:2] / sha1[2:4]
