"""Lifecycle of engine groups under abuse: closed from another thread or from inside an op's own
argument import, dropped with ops pending, used before join, re-initialised; rendezvous that a
Ctrl-C, a failed creator, a tight /dev/shm, a restrictive umask or a torchrun restart meet. Each
one an exception or a correct result, never a crash or a wait for the timeout."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

from dist_utils import free_port, orphaned_segments, run_ranks

# timed against short engine timeouts, and some spawn torchrun: run alone
pytestmark = pytest.mark.serial


@pytest.fixture(autouse=True)
def clean_dev_shm():
    before = orphaned_segments()
    yield
    assert orphaned_segments() - before == set(), "shared-memory segments left in /dev/shm"


def _run_script(body: str, env: dict = None, timeout: float = 120) -> str:
    """`body` in a fresh interpreter (a crash there fails this test instead of killing pytest)."""
    proc = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(body)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_close_from_another_thread_or_from_an_argument_never_crashes():
    out = _run_script(
        """
        import os, threading, torch
        from fairscale_c import _C
        import fairscale_c.distributed as fdist

        # a thread issuing ops while another closes the group: each op runs or raises
        for trial in range(60):
            g = _C.ShmGroup(f"race{os.getpid()}_{trial}", 0, 1)
            g.join()
            errors = []
            def loop():
                t = torch.ones(64)
                while True:
                    try:
                        g.all_reduce(t)
                        g.batch([("all_reduce", t, "sum"), ("broadcast", t, 0)])
                    except RuntimeError as exc:  # DistributedError is one too
                        errors.append(str(exc))
                        return
            th = threading.Thread(target=loop)
            th.start()
            g.close()
            th.join(30)
            assert not th.is_alive() and errors and "closed" in errors[0], errors

        # a tensor whose __dlpack__ closes the group that is importing it
        class Closer:
            def __init__(self, g):
                self.g = g
            def __dlpack_device__(self):
                return (1, 0)
            def __dlpack__(self, **kw):
                self.g.close()
                return torch.zeros(4).__dlpack__(**kw)
        calls = {
            "all_reduce": lambda g, c: g.all_reduce(c),
            "batch": lambda g, c: g.batch([("all_reduce", c, "sum")]),
            "all_gather": lambda g, c: g.all_gather(torch.zeros(4), c),
            "all_to_all_single": lambda g, c: g.all_to_all_single(c, torch.zeros(4)),
        }
        for name, call in calls.items():
            g = _C.ShmGroup(f"reent{os.getpid()}{name}", 0, 1)
            g.join()
            try:
                call(g, Closer(g))
                raise AssertionError(name + ": no error")
            except RuntimeError as exc:
                assert "ShmGroup is closed" in str(exc), exc

        # Work objects come from ops only; ops need join(); a group lives once
        try:
            _C.Work()
            raise AssertionError("Work() made")
        except TypeError:
            pass
        g = _C.ShmGroup(f"unjoined{os.getpid()}", 0, 1)
        for op in (lambda: g.all_reduce(torch.ones(2)), lambda: g.barrier(async_op=True)):
            try:
                op()
                raise AssertionError("an op ran on a group that was never joined")
            except RuntimeError as exc:
                assert "join()" in str(exc), exc
        g.close()
        try:
            g.__init__("again", 0, 1)
            raise AssertionError("re-initialised")
        except RuntimeError as exc:
            assert "already initialised" in str(exc)
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_all_to_all_split_sizes_take_integer_scalars():
    from fairscale_c import _C

    g = _C.ShmGroup(f"splits{os.getpid()}", 0, 1)
    g.join()
    try:
        for splits in ([np.int64(3)], np.array([3]), [torch.tensor(3)], (3,)):
            out = torch.empty(3)
            g.all_to_all_single(out, torch.arange(3.0), splits, splits)
            assert out.tolist() == [0.0, 1.0, 2.0], splits
        for bad in ([True], [3.0], ["3"], [3, 0]):
            with pytest.raises(ValueError, match="output_split_sizes"):
                g.all_to_all_single(torch.empty(3), torch.arange(3.0), bad, [3])
    finally:
        g.close()


def _drop_pending_job(rank, world):
    import fairscale_c.distributed as fdist

    fdist.init_group(name="first")  # the default group: nothing else of this test holds "drop"
    group = fdist.init_group(name="drop")
    group.all_reduce(torch.ones(4))
    if rank == 1:
        time.sleep(8)  # alive, but never issues the op rank 0 leaves pending
        return None
    group.all_reduce(torch.ones(4), async_op=True)  # the Work is dropped at once
    start = time.perf_counter()
    del group  # the last reference: its op can never be waited for
    return time.perf_counter() - start


def test_dropped_group_with_an_unwaitable_op_is_not_held_for_the_timeout():
    results = run_ranks(_drop_pending_job, 2, env={"FAIRSCALE_C_TIMEOUT": "60"})
    assert results[0] < 6, f"dropping the group took {results[0]:.1f} s (timeout 60 s)"


def _engine_then_torch_job(rank, world):
    """The engine's rendezvous from the environment first (rank 0 hosts the store on MASTER_PORT),
    then torch.distributed's env:// on the same port: one store server serves both."""
    import torch.distributed as dist

    import fairscale_c.distributed as fdist

    group = fdist.init_group()
    mine = torch.ones(3)
    group.all_reduce(mine)
    dist.init_process_group("gloo")
    theirs = torch.ones(3)
    dist.all_reduce(theirs)
    after = torch.ones(3)
    fdist.all_reduce(after)
    dist.destroy_process_group()
    return mine.tolist(), theirs.tolist(), after.tolist()


def test_torch_distributed_initialised_after_the_engines_rendezvous():
    results = run_ranks(_engine_then_torch_job, 2, env={"FAIRSCALE_C_TIMEOUT": "60"}, timeout=120)
    assert results == [([2.0] * 3, [2.0] * 3, [2.0] * 3)] * 2


def _creator_fails_job(rank, world):
    import fairscale_c
    import fairscale_c.distributed as fdist
    from fairscale_c import _C

    if rank == 0:
        real = _C.ShmGroup

        def refuse(*args, create=False, **kw):
            if create:
                raise OSError("shm_open(/x): Read-only file system")
            return real(*args, **kw)

        _C.ShmGroup = refuse
    start = time.perf_counter()
    try:
        fdist.init_group()
    except (OSError, fairscale_c.DistributedError) as exc:
        return type(exc).__name__, str(exc), time.perf_counter() - start
    raise AssertionError("the group was built")


def test_a_creator_that_cannot_create_is_reported_at_once():
    (k0, m0, t0), (k1, m1, t1) = run_ranks(_creator_fails_job, 2, env={"FAIRSCALE_C_TIMEOUT": "60"})
    assert k0 == "OSError" and "Read-only" in m0
    assert k1 == "DistributedError" and "rank 0 could not create the shared memory" in m1 and "Read-only" in m1
    assert max(t0, t1) < 10, (t0, t1)


def test_ctrl_c_ends_a_wait_for_the_creator(monkeypatch):
    from fairscale_c import _C

    monkeypatch.setenv("FAIRSCALE_C_TIMEOUT", "60")
    segment = f"/fsc-{os.getpid()}-ctrlc-{time.monotonic_ns() & 0xFFFFFF:x}"
    timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT))
    # Python leaves SIGINT ignored when it starts with it ignored (a background job of a shell)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    start = time.perf_counter()
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            _C.ShmGroup("late", 1, 2, segment, creator_pid=os.getpid())  # a creator that never creates
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert time.perf_counter() - start < 5


def _umask_job(rank, world):
    import fairscale_c.distributed as fdist

    os.umask(0o277)  # no write bit for the owner on what is created from here on
    group = fdist.init_group()
    t = torch.full((1000,), float(rank + 1))
    group.all_reduce(t)
    group.destroy()
    return t[0].item()


def test_restrictive_umask():
    assert run_ranks(_umask_job, 2, env={"FAIRSCALE_C_TIMEOUT": "30"}) == [3.0, 3.0]


_SMALL_SHM_RANK = """
import torch, fairscale_c.distributed as fdist
try:
    fdist.init_group()
    print("built")
except Exception as exc:
    print(type(exc).__name__, exc)
"""


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_dev_shm_too_small_is_an_error_not_sigbus(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(_SMALL_SHM_RANK)
    port = free_port()
    launch = " & ".join(
        f"RANK={r} WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT={port} {sys.executable} {script} > {tmp_path}/{r}.out"
        for r in range(2)
    )
    sh = f"mount -t tmpfs -o size=2m tmpfs /dev/shm && ({launch} & wait)"
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("user namespaces are not available here")
    proc = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "--propagation", "private", "sh", "-c", sh],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "FAIRSCALE_C_TIMEOUT": "30"},
    )
    assert proc.returncode == 0, proc.stderr
    outs = [(tmp_path / f"{r}.out").read_text() for r in range(2)]
    assert outs[0].startswith("OSError") and "cannot reserve" in outs[0] and "No space left" in outs[0], outs
    assert outs[1].startswith("DistributedError") and "rank 0 could not create" in outs[1], outs


_RESTART_SCRIPT = """
import os, sys, time, torch
import fairscale_c.distributed as fdist
attempt, rank = int(os.environ["TORCHELASTIC_RESTART_COUNT"]), int(os.environ["RANK"])
if attempt == 1 and rank == 0:
    time.sleep(1)  # the peer reaches the rendezvous first, where the last attempt's keys still are
group = fdist.init_group()
t = torch.full((4,), float(rank + 1))
group.all_reduce(t)
print(f"attempt {attempt} rank {rank}: {t.tolist()}", flush=True)
if attempt == 0 and rank == 1:
    sys.exit(3)
group.barrier()
group.destroy()
"""


def test_torchrun_restart_gets_a_fresh_rendezvous(tmp_path):
    script = tmp_path / "restart.py"
    script.write_text(_RESTART_SCRIPT)
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    proc = subprocess.run(
        [*torchrun, "--standalone", "--nproc_per_node", "2", "--max_restarts", "1", str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "FAIRSCALE_C_TIMEOUT": "30"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in range(2):
        assert f"attempt 1 rank {rank}: [3.0, 3.0, 3.0, 3.0]" in proc.stdout, proc.stdout + proc.stderr
