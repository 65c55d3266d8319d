"""fairscale_c.utils.checkpoint: sharded saves are all-or-nothing across ranks. A rank killed at any
point of a save leaves the previous checkpoint whole; a set mixed from two saves, a damaged
shard or another world size is refused on load."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from dist_utils import run_ranks
from fairscale_c.utils.checkpoint import CheckpointError, load_all_shards, load_sharded, read_manifest, save_sharded


def _state(step, rank=0):
    return {"step": step, "w": torch.full((1000,), 10.0 * step + rank), "meta": {"shapes": [torch.Size([1000])]}}


def test_round_trip_and_the_manifest(tmp_path):
    d = str(tmp_path)
    path = save_sharded(_state(1), d, step=1)
    m = read_manifest(d)
    assert m["step"] == 1 and m["world_size"] == 1 and [s["rank"] for s in m["shards"]] == [0]
    assert os.path.basename(path) == m["shards"][0]["file"] and m["shards"][0]["bytes"] == os.path.getsize(path)
    got = load_sharded(d)
    assert got["step"] == 1 and torch.equal(got["w"], _state(1)["w"]) and got["meta"]["shapes"] == [torch.Size([1000])]
    save_sharded(_state(2), d, step=2)
    assert sorted(os.listdir(d)) == sorted(["manifest.json", read_manifest(d)["shards"][0]["file"]])  # old shard gone
    assert load_all_shards(d)[0]["step"] == 2


def test_mixed_damaged_and_missing_shards_are_refused(tmp_path):
    old, new = str(tmp_path / "old"), str(tmp_path / "new")
    save_sharded(_state(1), old, step=1)
    save_sharded(_state(2), new, step=2)
    name = read_manifest(new)["shards"][0]["file"]
    target = os.path.join(new, name)
    # the shard of another save under this checkpoint's name: a mixed set
    shutil.copy(os.path.join(old, read_manifest(old)["shards"][0]["file"]), target)
    with pytest.raises(CheckpointError, match="checksum"):
        load_sharded(new)
    manifest = read_manifest(new)
    manifest["shards"][0]["bytes"] = os.path.getsize(target)
    with open(os.path.join(new, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(CheckpointError, match="mixed from two saves"):
        load_sharded(new, verify=False)
    with open(target, "r+b") as f:  # damaged: cut short
        f.truncate(100)
    with pytest.raises(CheckpointError, match="has 100 bytes, the manifest says"):
        load_all_shards(new)
    os.unlink(target)
    with pytest.raises(CheckpointError, match="named by the manifest is missing"):
        load_sharded(new)
    with pytest.raises(FileNotFoundError):
        load_sharded(str(tmp_path / "never-saved"))


def test_a_failed_save_leaves_the_previous_checkpoint(tmp_path):
    d = str(tmp_path)
    save_sharded(_state(1), d, step=1)
    with pytest.raises(CheckpointError, match="rank 0 could not write its shard.*previous checkpoint is unchanged"):
        save_sharded({"unpicklable": lambda: None}, d, step=2)
    assert read_manifest(d)["step"] == 1 and load_sharded(d)["step"] == 1
    assert [n for n in os.listdir(d) if n.endswith(".tmp")] == []
    with pytest.raises(CheckpointError, match=r"\(writing shard-[0-9a-f]+-rank0\.pt; [0-9]+ bytes free"):
        save_sharded({"unpicklable": lambda: None}, d, step=2)
    with pytest.raises(TypeError, match="argument 'step'"):
        save_sharded(_state(3), d, step="3")
    for bad in ("", b"dir", None, 3):
        with pytest.raises(TypeError, match="argument 'directory' must be a non-empty str"):
            save_sharded(_state(3), bad, step=3)
        with pytest.raises(TypeError, match="argument 'directory'"):
            load_sharded(bad)
    assert read_manifest(d)["step"] == 1


# ---------------------------------------------------------------- a rank killed during a save


def _kill_during_save(where):
    """Make this rank SIGKILL itself at `where` in the next save."""
    import signal

    from fairscale_c.utils import checkpoint

    real_replace = os.replace

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    if where == "mid-write":

        def partial_save(obj, f):  # half a file, then gone
            f.write(b"\0" * 4096)
            f.flush()
            die()

        checkpoint.torch.save = partial_save
    elif where == "after-write":

        def replace_then_die(src, dst):  # its new shard is complete and in place
            real_replace(src, dst)
            die()

        checkpoint.os.replace = replace_then_die
    elif where == "while-committing":

        def die_before_manifest(src, dst):
            if dst.endswith("manifest.json"):
                die()
            real_replace(src, dst)

        checkpoint.os.replace = die_before_manifest


def _save_twice_job(rank, world, directory, victim, where):
    import torch.distributed as dist

    dist.init_process_group("gloo")
    save_sharded(_state(1, rank), directory, step=1)
    if rank == victim:
        _kill_during_save(where)
    try:
        save_sharded(_state(2, rank), directory, step=2)
    except Exception as exc:  # the survivor: the engine reports the dead peer
        return f"{type(exc).__name__}: {exc}"
    return "saved"


@pytest.mark.parametrize(
    "victim, where", [(1, "mid-write"), (1, "after-write"), (0, "while-committing")], ids=lambda v: str(v)
)
@pytest.mark.serial  # kills a rank
def test_rank_killed_during_a_save_leaves_the_previous_checkpoint_whole(tmp_path, victim, where):
    d = str(tmp_path)
    results = run_ranks(_save_twice_job, 2, d, victim, where, timeout=240, may_die=[victim])
    survivor = results[1 - victim]
    assert survivor is not None and survivor != "saved", survivor
    manifest = read_manifest(d)
    assert manifest["step"] == 1 and manifest["world_size"] == 2
    shards = load_all_shards(d)
    for rank, state in enumerate(shards):
        assert state["step"] == 1 and torch.equal(state["w"], _state(1, rank)["w"]), (rank, state["step"])
    with pytest.raises(CheckpointError, match="saved by 2 ranks and is loaded by 1"):
        load_sharded(d)


def _dies_after_the_exchange_job(rank, world, directory):
    import signal

    import torch.distributed as dist

    from fairscale_c.utils import checkpoint

    dist.init_process_group("gloo")
    save_sharded(_state(1, rank), directory, step=1)
    if rank == 1:  # dies once every rank's shard is written and exchanged, before rank 0 commits
        exchange, calls = checkpoint._all_gather, []

        def exchange_then_die(*args, **kwargs):
            out = exchange(*args, **kwargs)
            calls.append(None)
            if len(calls) == 2:  # the tag, then the shard entries
                os.kill(os.getpid(), signal.SIGKILL)
            return out

        checkpoint._all_gather = exchange_then_die
    try:
        save_sharded(_state(2, rank), directory, step=2)
    except Exception as exc:  # noqa: BLE001 - returned to the test
        return f"{type(exc).__name__}: {exc}"
    return "saved"


@pytest.mark.serial  # kills a rank
def test_a_rank_killed_after_the_exchange_may_leave_the_new_checkpoint_committed_and_rank_0_says_so(tmp_path):
    d = str(tmp_path)
    message = run_ranks(_dies_after_the_exchange_job, 2, d, timeout=240, may_die=[1])[0]
    assert message.startswith("DistributedError") and "rank 1" in message, message
    assert "already committed this save" in message and "complete and current" in message, message
    assert read_manifest(d)["step"] == 2
    for rank, state in enumerate(load_all_shards(d)):
        assert state["step"] == 2 and torch.equal(state["w"], _state(2, rank)["w"])


def _stalled_peer_job(rank, world, directory):
    import time

    import torch.distributed as dist

    dist.init_process_group("gloo")  # torch's own timeout stays at its default (30 minutes)
    save_sharded(_state(1, rank), directory, step=1)
    if rank == 1:
        time.sleep(25)  # alive but not saving (torch would notice its exit, not the stall)
        return "stalled"
    start = time.monotonic()
    try:
        save_sharded(_state(2, rank), directory, step=2)
    except Exception as exc:
        return (type(exc).__name__, time.monotonic() - start)
    return "saved"


@pytest.mark.serial  # times how soon the timeout fires
def test_a_stalled_peer_makes_a_save_raise_within_the_engine_timeout(tmp_path):
    d = str(tmp_path)
    results = run_ranks(_stalled_peer_job, 2, d, env={"FAIRSCALE_C_TIMEOUT": "3"}, timeout=120)
    name, waited = results[0]
    assert name == "DistributedError" and waited < 15, results
    assert read_manifest(d)["step"] == 1


# ---------------------------------------------------------------- failures that are not deaths


def test_a_manifest_that_cannot_be_written_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    from fairscale_c.utils import checkpoint

    d = str(tmp_path)
    save_sharded(_state(1), d, step=1)
    real = checkpoint._write_durably

    def no_manifest(path, write):
        if path.endswith("manifest.json"):
            raise OSError(28, "No space left on device")
        return real(path, write)

    monkeypatch.setattr(checkpoint, "_write_durably", no_manifest)
    with pytest.raises(CheckpointError, match="rank 0 could not write manifest.json .*No space left.*unchanged"):
        save_sharded(_state(2), d, step=2)
    monkeypatch.undo()
    assert read_manifest(d)["step"] == 1
    assert load_sharded(d)["step"] == 1 and torch.equal(load_sharded(d)["w"], _state(1)["w"])
    # the new shard went again: on a full disk a retry needs that space
    assert sorted(os.listdir(d)) == sorted(["manifest.json", read_manifest(d)["shards"][0]["file"]])


def test_a_manifest_that_is_not_one_is_refused(tmp_path):
    d = str(tmp_path)
    for text in ("not json", json.dumps({"format": "other"}), json.dumps([1, 2])):
        with open(os.path.join(d, "manifest.json"), "w") as f:
            f.write(text)
        with pytest.raises(CheckpointError, match="is not a .* manifest"):
            read_manifest(d)
    save_sharded(_state(1), d, step=1)
    manifest = read_manifest(d)
    manifest["world_size"] = 2  # a shard missing from the list
    with open(os.path.join(d, "manifest.json"), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(CheckpointError, match="is not a .* manifest"):
        load_sharded(d)
    manifest["world_size"] = 1
    good = dict(manifest, shards=[dict(manifest["shards"][0])])
    broken = {
        "'step'": dict(good, step="1"),
        "'tag'": {k: v for k, v in good.items() if k != "tag"},
        "shard entry 0": dict(good, shards=[dict(good["shards"][0], file=7)]),
        "shard entry 0 ": dict(good, shards=[dict(good["shards"][0], file="/etc/passwd")]),
        "shard entry 0  ": dict(good, shards=[{k: v for k, v in good["shards"][0].items() if k != "sha256"}]),
        "'world_size'": dict(good, world_size=0, shards=[]),
    }
    for what, bad in broken.items():
        with open(os.path.join(d, "manifest.json"), "w") as f:
            json.dump(bad, f)
        with pytest.raises(CheckpointError, match="is not a .* manifest: its " + what.strip()):
            load_all_shards(d)
    with open(os.path.join(d, "manifest.json"), "w") as f:
        json.dump(good, f)
    assert load_sharded(d)["step"] == 1


def _one_rank_fails_job(rank, world, directory, how):
    import torch.distributed as dist

    from fairscale_c.utils import checkpoint

    dist.init_process_group("gloo")
    save_sharded(_state(1, rank), directory, step=1)
    state = _state(2, rank)
    if rank == 1 and how == "unpicklable":
        state = {"unpicklable": lambda: None}
    if rank == 1 and how == "directory not synced":  # its new shard is complete and renamed into place

        def eio(directory):
            raise OSError(5, "Input/output error")

        checkpoint._fsync_dir = eio
    try:
        save_sharded(state, directory, step=2)
    except CheckpointError as exc:
        return str(exc)
    finally:
        dist.destroy_process_group()
    return "saved"


@pytest.mark.parametrize("how", ["unpicklable", "directory not synced"])
def test_a_rank_that_cannot_write_makes_every_rank_raise_and_keeps_the_previous_checkpoint(tmp_path, how):
    d = str(tmp_path)
    results = run_ranks(_one_rank_fails_job, 2, d, how, timeout=240)
    for msg in results:  # the same error on both ranks, naming the rank that failed
        assert "rank 1 could not write its shard" in msg and "previous checkpoint is unchanged" in msg, msg
    manifest = read_manifest(d)
    assert manifest["step"] == 1
    for rank, state in enumerate(load_all_shards(d)):
        assert state["step"] == 1 and torch.equal(state["w"], _state(1, rank)["w"])
    # rank 0 wrote its new shard before it learnt of rank 1's failure, and rank 1's may be in
    # place when only syncing the directory failed: both are removed again
    assert sorted(os.listdir(d)) == sorted(["manifest.json"] + [s["file"] for s in manifest["shards"]])


# ---------------------------------------------------------------- saves and loads at the same time


def test_a_save_in_the_middle_of_another_saves_commit_removes_nothing_either_needs(tmp_path, monkeypatch):
    """Save B runs whole between save A's commit and A's clean-up (two jobs, one directory): each
    commits, the later one is the checkpoint, and no clean-up removes a file the manifest names."""
    from fairscale_c.utils import checkpoint

    d = str(tmp_path)
    save_sharded(_state(1), d, step=1)
    real = checkpoint._remove_stale
    calls = []

    def other_save_first(*args):
        calls.append(args)
        if len(calls) == 1:
            save_sharded(_state(3), d, step=3)  # B: its clean-up finds A's new shard locked
        real(*args)

    monkeypatch.setattr(checkpoint, "_remove_stale", other_save_first)
    save_sharded(_state(2), d, step=2)  # A
    monkeypatch.undo()
    assert read_manifest(d)["step"] == 3 and load_sharded(d)["step"] == 3
    save_sharded(_state(4), d, step=4)  # A's shard is no longer held: the next save removes it
    assert sorted(os.listdir(d)) == sorted(["manifest.json", read_manifest(d)["shards"][0]["file"]])


def test_a_failed_clean_up_is_a_warning_after_the_commit(tmp_path, monkeypatch):
    from fairscale_c.utils import checkpoint

    d = str(tmp_path)
    save_sharded(_state(1), d, step=1)
    real_unlink = os.unlink

    def refuse(path, *a, **kw):
        if os.path.basename(str(path)).startswith("shard-"):
            raise PermissionError(1, "Operation not permitted", str(path))
        return real_unlink(path, *a, **kw)

    monkeypatch.setattr(checkpoint.os, "unlink", refuse)
    with pytest.warns(UserWarning, match="could not remove the old file .*Operation not permitted"):
        save_sharded(_state(2), d, step=2)
    monkeypatch.undo()
    assert load_sharded(d)["step"] == 2


_CONCURRENT = """
import sys, time
import torch
from fairscale_c.utils.checkpoint import CheckpointError, load_all_shards, save_sharded
d, role, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
ok = failed = 0
deadline = time.monotonic() + 60
for i in range(n):
    if time.monotonic() > deadline:
        break
    try:
        if role == "reader":
            state = load_all_shards(d)[0]
            assert torch.equal(state["w"], torch.full((1000,), float(state["step"]))), state["step"]
        else:
            save_sharded({"step": i, "w": torch.full((1000,), float(i))}, d, step=i)
        ok += 1
    except CheckpointError as exc:
        failed += 1
        print(role, "failed:", exc, flush=True)
print(role, ok, failed, flush=True)
"""


def test_two_jobs_saving_and_a_reader_in_one_directory(tmp_path):
    """Two one-rank jobs save into one directory while a third process loads: every save commits
    (none removes the other's files), every load returns a whole checkpoint."""
    import subprocess
    import sys

    d = str(tmp_path / "ckpt")
    save_sharded({"step": 0, "w": torch.zeros(1000)}, d, step=0)
    script = tmp_path / "job.py"
    script.write_text(_CONCURRENT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen([sys.executable, str(script), d, role, "60"], env=env, stdout=subprocess.PIPE, text=True)
        for role in ("writer", "writer", "reader")
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for out in outs:
        role, ok, failed = out.strip().splitlines()[-1].split()
        assert failed == "0" and int(ok) > 0, out
    state = load_all_shards(d)[0]
    assert torch.equal(state["w"], torch.full((1000,), float(state["step"])))


def test_a_filesystem_without_locks_fails_the_save_and_leaves_nothing(tmp_path, monkeypatch):
    from fairscale_c.utils import checkpoint

    d = str(tmp_path)
    save_sharded(_state(1), d, step=1)
    before = sorted(os.listdir(d))

    def no_locks(*args):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(checkpoint.fcntl, "flock", no_locks)
    with pytest.raises(CheckpointError, match="No locks available.*previous checkpoint is unchanged"):
        save_sharded(_state(2), d, step=2)
    monkeypatch.undo()
    assert sorted(os.listdir(d)) == before and load_sharded(d)["step"] == 1


def test_each_file_is_synced_before_its_rename_and_the_directory_after(tmp_path, monkeypatch):
    """Durability of a save: the shard and then the manifest are each written to a temporary
    name, flushed and fsynced (all their bytes on disk), renamed over their name, and the
    directory is fsynced after the rename (so the new name survives a crash of the machine)
    before the next file is committed and before save_sharded returns."""
    import stat

    from fairscale_c.utils import checkpoint

    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        st = os.fstat(fd)
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"), stat.S_ISDIR(st.st_mode), st.st_size))
        return real_fsync(fd)

    def replace(src, dst, *a, **k):
        events.append(("replace", os.path.realpath(src), os.path.realpath(dst)))
        return real_replace(src, dst, *a, **k)

    d = os.path.realpath(tmp_path)
    monkeypatch.setattr(checkpoint.os, "fsync", fsync)
    monkeypatch.setattr(checkpoint.os, "replace", replace)
    shard = os.path.realpath(save_sharded(_state(1), d, step=1))
    monkeypatch.undo()
    manifest = os.path.join(d, "manifest.json")
    renames = [i for i, e in enumerate(events) if e[0] == "replace"]
    assert [events[i][2] for i in renames] == [shard, manifest], events
    for n, i in enumerate(renames):
        tmp, dst = events[i][1:]
        synced = [e for e in events[:i] if e[0] == "fsync" and e[1] == tmp]
        assert synced, f"{dst} renamed before its temporary file was fsynced: {events}"
        assert synced[-1][3] == os.path.getsize(dst), f"{dst} fsynced before all its bytes were written: {events}"
        end = renames[n + 1] if n + 1 < len(renames) else len(events)
        after = [e for e in events[i + 1 : end] if e[0] == "fsync" and e[2] and e[1] == d]
        assert after, f"the directory was not fsynced after {dst} was renamed (before the next step): {events}"
    assert load_sharded(d)["step"] == 1
