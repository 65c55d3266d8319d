"""wgit: Repo (add, commit, status, log, checkout, size_info), SHA1_Store (format, dedup, atomic
writes, concurrent adds, what get() unpickles) and the command line."""

import gzip
import hashlib
import json
import multiprocessing as mp
import os
import pickle
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from torch import nn

from fairscale_c.experimental.wgit import cli
from fairscale_c.experimental.wgit.repo import Repo, RepoStatus, SizeInfo, _SHA1_Tensor
from fairscale_c.experimental.wgit.sha1_store import SHA1_Store, _indexed_members

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="Repo needs the git program")


@pytest.fixture
def work(tmp_path, monkeypatch):
    d = tmp_path / "proj"
    d.mkdir()
    monkeypatch.chdir(d)
    return d


def _ckpt(path, seed, step=1, shared=None):
    torch.manual_seed(seed)
    sd = {"model": nn.Linear(8, 64).state_dict(), "step": step, "half": torch.randn(16).bfloat16()}
    if shared is not None:
        sd["shared"] = shared
    torch.save(sd, path)
    return sd


def _equal(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return a == b


def _commits(work):
    return subprocess.run(
        ["git", "-C", str(work / ".wgit"), "rev-list", "--reverse", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.split()


def test_status_follows_add_commit_and_change(work):
    repo = Repo(work, init=True)
    assert repo.status() == {"": RepoStatus.CLEAN}
    _ckpt("a.pt", 0)
    repo.add("a.pt")
    assert repo.status() == {"proj/a.pt": RepoStatus.CHANGES_ADDED_NOT_COMMITED}
    repo.commit("e1")
    assert repo.status() == {"proj/a.pt": RepoStatus.CLEAN}
    os.utime("a.pt", (1, 1))
    assert repo.status() == {"proj/a.pt": RepoStatus.CHANGES_NOT_ADDED}
    repo.add("a.pt")
    _ckpt("b.pt", 1)
    repo.add("b.pt", per_tensor=False)
    assert repo.status() == {
        "proj/a.pt": RepoStatus.CHANGES_ADDED_NOT_COMMITED,
        "proj/b.pt": RepoStatus.CHANGES_ADDED_NOT_COMMITED,
    }
    repo.commit("e2")
    Path("b.pt").unlink()
    assert repo.status() == {"proj/a.pt": RepoStatus.CLEAN, "proj/b.pt": RepoStatus.CHANGES_NOT_ADDED}
    assert (work / ".wgit/.git").is_dir() and (work / ".wgit/.gitignore").read_text() == "sha1_store\n"
    meta = json.loads((work / ".wgit/proj/a.pt").read_text())
    assert set(meta) == {"SHA1", "last_modified_time_stamp", "file_path"} and meta["file_path"] == "a.pt"


def test_repo_is_found_from_a_subdirectory_and_missing_repo_raises(work):
    with pytest.raises(FileNotFoundError, match="not a wgit repository"):
        Repo(work)
    Repo(work, init=True)
    sub = work / "x" / "y"
    sub.mkdir(parents=True)
    assert Repo(sub)._dot_wgit_dir_path == work / ".wgit"


def test_per_tensor_add_stores_each_tensor_once(work):
    repo = Repo(work, init=True)
    shared = torch.randn(1000)
    _ckpt("a.pt", 0, shared=shared)
    _ckpt("b.pt", 1, shared=shared)
    repo.add("a.pt")
    repo.add("b.pt")
    store = repo._sha1_store
    top = store.get(json.loads((work / ".wgit/proj/a.pt").read_text())["SHA1"])
    assert isinstance(top["shared"], _SHA1_Tensor) and top["step"] == 1
    sha1 = top["shared"].dense_sha1
    assert store.names(sha1) == {"shared": 2}
    with store._readonly_json_ctx:
        assert store._json_dict[sha1]["ref_count"] == 2
    a, b = repo.size_info("a.pt"), repo.size_info("b.pt")
    whole = repo.size_info()
    assert whole.original > whole.deduped == whole.sparsified >= whole.gzipped > 0
    assert whole.original - whole.deduped == store.size_info(sha1)[1]  # the shared tensor, stored once
    assert a.original == a.deduped and b.gzipped <= b.deduped
    assert isinstance(a, SizeInfo)


def test_a_per_tensor_add_that_fails_part_way_gives_its_references_back(work, monkeypatch):
    """Disk full after some of a checkpoint's tensors were stored: the references those took are
    dropped again, so a retried add counts each once and delete can free them."""
    repo = Repo(work, init=True)
    shared = torch.randn(1000)
    _ckpt("a.pt", 0, shared=shared)
    repo.add("a.pt")
    store = repo._sha1_store
    with store._readonly_json_ctx:
        before = {k: dict(v) for k, v in store._json_dict.items() if isinstance(v, dict)}
    _ckpt("b.pt", 1, shared=shared)
    real, calls = store.add, []

    def fails_third(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "add", fails_third)
    with pytest.raises(OSError, match="No space left"):
        repo.add("b.pt")
    monkeypatch.setattr(store, "add", real)
    with store._readonly_json_ctx:
        after = {k: dict(v) for k, v in store._json_dict.items() if isinstance(v, dict)}
    assert {k: v["ref_count"] for k, v in after.items()} == {k: v["ref_count"] for k, v in before.items()}
    repo.add("b.pt")
    sha1 = store.get(json.loads((work / ".wgit/proj/b.pt").read_text())["SHA1"])["shared"].dense_sha1
    with store._readonly_json_ctx:
        assert store._json_dict[sha1]["ref_count"] == 2  # a.pt's and b.pt's


def test_checkout_by_commit_and_by_file_version(work, capsys):
    repo = Repo(work, init=True)
    v1 = _ckpt("a.pt", 0, step=1)
    b1 = _ckpt("b.pt", 5, step=10)
    repo.add("a.pt")
    repo.add("b.pt", per_tensor=False)
    repo.commit("first")
    v2 = _ckpt("a.pt", 1, step=2)
    _ckpt("b.pt", 6, step=11)
    repo.add("a.pt")
    repo.add("b.pt", per_tensor=False)
    repo.commit("second")
    first, second = _commits(work)

    repo.checkout(first[:8])
    assert _equal(torch.load("a.pt", weights_only=True), v1)
    assert _equal(torch.load("b.pt", weights_only=True), b1)
    assert set(repo.status().values()) == {RepoStatus.CHANGES_ADDED_NOT_COMMITED}

    capsys.readouterr()
    repo.log("a.pt")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "wgit log of the file: a.pt"
    assert [line.split()[0] for line in lines[1:]] == [second, first]
    assert [line.split()[2] for line in lines[1:]] == ["second", "first"]
    v2_sha1 = lines[1].split()[-1]

    repo.checkout(v2_sha1[:10])  # one file version, by its SHA1
    assert _equal(torch.load("a.pt", weights_only=True), v2)
    assert _equal(torch.load("b.pt", weights_only=True), b1)  # untouched
    repo.commit("back to a v2, b v1")
    assert set(repo.status().values()) == {RepoStatus.CLEAN}

    with pytest.raises(ValueError, match="names no commit and no version"):
        repo.checkout("deadbeef")
    with pytest.raises(ValueError, match="sha1 must be a hex string"):
        repo.checkout("xyz!")


def test_log_prints_the_history(work, capsys):
    repo = Repo(work, init=True)
    repo.log("nothing.pt")
    assert capsys.readouterr().out == "wgit log of the file: nothing.pt\n"
    repo.commit("empty")
    repo.log()
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "wgit log" and len(out) == 2 and out[1].endswith(" empty")


def test_bad_arguments(work):
    repo = Repo(work, init=True)
    with pytest.raises(FileNotFoundError, match="in_file_path 'missing.pt' is not a file"):
        repo.add("missing.pt")
    _ckpt("a.pt", 0)
    with pytest.raises(NotImplementedError, match="sparsify"):
        repo.add("a.pt", sparsify=True)
    with pytest.raises(ValueError, match="sparsify needs per_tensor=True"):
        repo.add("a.pt", per_tensor=False, sparsify=True)
    with pytest.raises(TypeError, match="message must be a str"):
        repo.commit(3)
    torch.save([torch.ones(2)], "list.pt")
    with pytest.raises(TypeError, match="holds a list"):
        repo.add("list.pt")
    with pytest.raises(ValueError, match="not tracked"):
        repo.size_info("other.pt")
    with pytest.raises(ValueError, match="pgzip_block_size must be a positive int"):
        SHA1_Store(work / "s", init=True, pgzip_block_size=0)
    with pytest.raises(FileNotFoundError, match="no store at path"):
        SHA1_Store(work / "nowhere")


# SHA1_Store


@pytest.fixture
def store(tmp_path):
    return SHA1_Store(tmp_path / "store", init=True)


@pytest.mark.parametrize("compress", [True, False])
def test_store_object_is_the_numpy_pickle_and_its_sha1(store, compress):
    t = torch.arange(300, dtype=torch.float32)
    sha1 = store.add(t, compress=compress, name="t")
    data = pickle.dumps(t.numpy())
    assert sha1 == hashlib.sha1(data).hexdigest()  # FairScale's rule: SHA1 of pickle(to_np(obj))
    path = store._path / sha1[:2] / sha1[2:4] / sha1
    assert (gzip.decompress(path.read_bytes()) if compress else path.read_bytes()) == data
    assert torch.equal(store.get(sha1), t)
    orig, dedup, comp = store.size_info(sha1)
    assert orig == dedup == len(data) and (comp < orig if compress else comp == orig)


def test_store_compresses_in_members_and_reads_them_back(tmp_path):
    store = SHA1_Store(tmp_path / "s", init=True, pgzip_block_size=4096, pgzip_threads=2)
    t = torch.randn(10000)
    sha1 = store.add(t)
    path = store._path / sha1[:2] / sha1[2:4] / sha1
    raw = path.read_bytes()
    data = pickle.dumps(t.numpy())
    members = _indexed_members(memoryview(raw))  # each member's header gives its size (pgzip's index)
    assert len(members) == -(-len(data) // 4096) and sum(size for _, size, _ in members) == len(raw)
    assert gzip.decompress(raw) == data  # a standard gzip stream too
    assert torch.equal(store.get(sha1), t)
    path.write_bytes(gzip.compress(data))  # members without the index (e.g. gzip's): read as they come
    assert torch.equal(store.get(sha1), t)
    bad = bytearray(raw)
    bad[members[3][0] + 40] ^= 0xFF
    path.write_bytes(bytes(bad))
    with pytest.raises((OSError, zlib.error)):
        store.get(sha1)


def test_store_counts_references_and_deletes_with_the_last(store):
    sd = nn.Linear(10, 10).state_dict()
    sha1 = store.add(sd)
    assert store.add(sd, compress=False) == sha1  # already stored: compression stays as stored
    assert _equal(store.get(sha1), sd)
    assert store.size_info(sha1)[0] == 2 * store.size_info(sha1)[1]
    store.delete(sha1)
    assert _equal(store.get(sha1), sd)
    store.delete(sha1)
    with pytest.raises(ValueError, match="not found"):
        store.get(sha1)
    with pytest.raises(ValueError, match="not found"):
        store.delete(sha1)


def test_a_failed_add_leaves_the_store_as_it_was(store, monkeypatch):
    store.add(torch.ones(10))
    before = store._metadata_file_path.read_bytes()
    files_before = sorted(p for p in store._path.rglob("*") if p.is_file())

    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("fairscale_c.experimental.wgit.sha1_store._copy_compressed", boom)
    with pytest.raises(OSError, match="disk full"):
        store.add(torch.zeros(1000))
    assert store._metadata_file_path.read_bytes() == before
    assert sorted(p for p in store._path.rglob("*") if p.is_file()) == files_before


def _add_many(path, offset):
    store = SHA1_Store(Path(path))
    for i in range(12):
        store.add(torch.full((64,), float(i % 6)), name=f"p{offset}")


def test_concurrent_adds_count_every_reference(tmp_path):
    SHA1_Store(tmp_path / "s", init=True)
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_add_many, args=(str(tmp_path / "s"), k)) for k in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    store = SHA1_Store(tmp_path / "s")
    with store._readonly_json_ctx:
        d = store._json_dict
        entries = {k: v for k, v in d.items() if len(k) == 40}
    assert len(entries) == 6 and all(e["ref_count"] == 6 for e in entries.values())
    assert all(e["names"] == {"p0": 2, "p1": 2, "p2": 2} for e in entries.values())


class _Marker:
    def __reduce__(self):
        return (os.system, ("touch should_not_exist",))


def test_get_unpickles_only_store_objects_unless_told(store, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with open("obj.pkl", "wb") as f:
        pickle.dump({"x": _Marker()}, f)
    sha1 = store.add("obj.pkl")  # a pickle file is stored as its bytes, never run
    assert not Path("should_not_exist").exists()
    assert sha1 == store._get_sha1_hash("obj.pkl")
    with pytest.raises(pickle.UnpicklingError, match="references posix.system"):
        store.get(sha1)
    assert not Path("should_not_exist").exists()
    store.get(sha1, weights_only=False)
    assert Path("should_not_exist").exists()


# Command line


def test_cli_round_trip(work, capsys):
    _ckpt("c.pt", 0)
    cli.main(["init"])
    cli.main(["add", "c.pt"])
    cli.main(["commit", "-m", "epoch_1"])
    assert (work / ".wgit/.git/logs/HEAD").read_text().split()[-1] == "epoch_1"
    capsys.readouterr()
    cli.main(["status"])
    assert capsys.readouterr().out == "{'proj/c.pt': <RepoStatus.CLEAN: 1>}\n"
    cli.main(["version"])
    assert capsys.readouterr().out == "0.0.1\n"
    with pytest.raises(SystemExit) as e:
        cli.main(["checkout", "abcd1234"])
    assert e.value.code == 1 and capsys.readouterr().err.startswith("fatal: Repo.checkout: sha1 abcd1234")


def test_cli_as_a_module(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "fairscale_c.experimental.wgit", "status"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1 and proc.stderr.startswith("fatal: wgit: not a wgit repository"), proc.stderr


def test_reads_and_checks_out_a_repo_made_by_fairscale(tmp_path, monkeypatch, capsys):
    """tests/data/fairscale_wgit_repo.tar.gz: a repo made by FairScale 0.4.13's wgit (pygit2,
    pgzip): ckpt.pt added per tensor and aux.pt whole, committed ("first"), then ckpt.pt changed
    and committed ("second"); first_expected.pt is ckpt.pt's first version."""
    import tarfile

    with tarfile.open(Path(__file__).parent / "data" / "fairscale_wgit_repo.tar.gz") as tar:
        tar.extractall(tmp_path, filter="data")
    work = tmp_path / "fsrepo"
    monkeypatch.chdir(work)
    repo = Repo(work)
    assert set(repo.status()) == {"fsrepo/ckpt.pt", "fsrepo/aux.pt"}
    capsys.readouterr()
    repo.log("ckpt.pt")
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[2] for line in lines[1:]] == ["second", "first"]
    second = torch.load("ckpt.pt", weights_only=True)
    repo.checkout(lines[2].split()[0])  # the commit "first"
    assert _equal(torch.load("ckpt.pt", weights_only=True), torch.load("first_expected.pt", weights_only=True))
    assert torch.equal(torch.load("aux.pt", weights_only=True)["w"], torch.arange(6, dtype=torch.float32))
    repo.checkout(lines[1].split()[-1])  # ckpt.pt's version in "second", by its SHA1
    assert _equal(torch.load("ckpt.pt", weights_only=True), second)


def test_a_held_store_lock_times_out(store, monkeypatch):
    import fcntl

    monkeypatch.setenv("FAIRSCALE_C_TIMEOUT", "0.3")
    fd = os.open(store._path / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another process's add, stuck
        with pytest.raises(TimeoutError, match="lock .* stayed held for 0.3 s"):
            store.add(torch.ones(3))
    finally:
        os.close(fd)
    assert torch.equal(store.get(store.add(torch.ones(3))), torch.ones(3))


def test_a_repo_opened_by_a_relative_path_survives_a_change_of_directory(work, monkeypatch):
    Repo(".", init=True)
    _ckpt("a.pt", 0)
    repo = Repo(".")
    repo.add("a.pt")
    monkeypatch.chdir(work.parent)
    repo.commit("from elsewhere")  # the store and git directory stay where the repo is
    assert _commits(work) and (work / ".wgit" / "sha1_store" / "metadata.json").is_file()
