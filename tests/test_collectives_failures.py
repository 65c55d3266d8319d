"""Failure behaviour of fairscale_c.distributed on CPU: dead and missing peers, diverging ranks,
bad arguments, groups spanning hosts — each an error that names what went wrong, never a hang,
and nothing left in /dev/shm."""

from __future__ import annotations

import os
import re
import struct
import time

import pytest
import torch

from dist_utils import free_port, join_gloo, orphaned_segments, run_ranks, shm_segments

# dead, stalled and missing ranks, timed against short engine timeouts: run alone
pytestmark = pytest.mark.serial

FAST = {"FAIRSCALE_C_TIMEOUT": "3"}


@pytest.fixture(autouse=True)
def clean_dev_shm():
    before = orphaned_segments()
    yield
    assert orphaned_segments() - before == set(), "shared-memory segments left in /dev/shm"


def _expect_error(fn, *needles):
    import fairscale_c

    start = time.perf_counter()
    try:
        fn()
    except fairscale_c.DistributedError as exc:
        msg = str(exc)
        missing = [n for n in needles if n not in msg]
        assert not missing, f"{missing} not in: {msg}"
        return msg, time.perf_counter() - start
    raise AssertionError("no DistributedError raised")


def _dead_peer_job(rank, world):
    import fairscale_c.distributed as fdist

    group = fdist.init_group(name="dying")
    if rank == 1:
        os._exit(1)  # killed peer: no cleanup, no goodbye
    msg, elapsed = _expect_error(lambda: group.all_reduce(torch.ones(1000)), "all_reduce", "'dying'", "rank 1")
    # the group is broken now; later ops fail at once with the same message
    msg2, _ = _expect_error(lambda: group.barrier(), "all_reduce", "rank 1")
    group.destroy()
    return elapsed


def test_dead_peer_is_reported_quickly():
    elapsed, _ = run_ranks(_dead_peer_job, 2, env={"FAIRSCALE_C_TIMEOUT": "30"}, may_die=[1])
    assert elapsed < 10, f"dead peer found after {elapsed:.1f} s; expected well before the 30 s timeout"


def _dead_peer_mid_exchange_job(rank, world, mode):
    """Rank 2 of 3 dies after the ranks' first exchange; ranks 0 and 1 are then inside an
    all_to_all_single (sync or async) or a batch whose recv from rank 2 is pending."""
    import fairscale_c.distributed as fdist

    group = fdist.init_group(name=f"dying-{mode}")
    x = torch.arange(6.0) + 10 * rank
    out = torch.empty(6)
    group.all_to_all_single(out, x)  # everyone alive: one round completes
    if rank == 2:
        time.sleep(0.3)  # let the others enter the next exchange first
        os._exit(1)
    if mode == "a2a":
        call = lambda: group.all_to_all_single(out, x)  # noqa: E731
    elif mode == "a2a_async":
        call = lambda: group.all_to_all_single(out, x, async_op=True).wait()  # noqa: E731
    else:
        peer = 1 - rank  # the live peer's message arrives; the dead rank's recv never completes
        items = [("send", x[:2], peer), ("recv", out[:2], peer), ("recv", out[2:4], 2), ("copy", out[4:], x[4:])]
        call = lambda: group.batch(items, async_op=True).wait()  # noqa: E731
    msg, elapsed = _expect_error(call, f"'dying-{mode}'", "rank 2")
    _expect_error(lambda: group.all_reduce(torch.ones(4)), "rank 2")  # the group stays broken
    group.destroy()
    return elapsed


@pytest.mark.parametrize("mode", ["a2a", "a2a_async", "batch"])
def test_dead_peer_during_all_to_all_or_batch_is_reported_quickly(mode):
    results = run_ranks(_dead_peer_mid_exchange_job, 3, mode, env={"FAIRSCALE_C_TIMEOUT": "30"}, may_die=[2])
    elapsed = [e for e in results if e is not None]
    assert len(elapsed) == 2 and max(elapsed) < 10, f"dead peer found after {elapsed} s; expected well before 30 s"


def _fork_child_job(rank, world):
    import fairscale_c.distributed as fdist

    group = fdist.init_group(name="forked")
    group.all_reduce(torch.ones(8))  # the progress thread is running when the fork happens
    if rank == 1:
        time.sleep(0.5)
    pending = group.all_reduce(torch.ones(8), async_op=True)  # rank 0's waits for rank 1's
    pid = os.fork()
    if pid == 0:  # the child must get an error, not a hang, and destroy() must return
        code = 1
        try:
            _expect_error(lambda: group.all_reduce(torch.ones(8)), "'forked'", "fork() child")
            _expect_error(pending.wait, "fork() child", "the parent's progress thread runs it")
            del pending  # the Work it inherited is dropped without a wait (as at a normal exit)
            group.destroy()
            code = 0
        finally:
            os._exit(code)
    pending.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        raise AssertionError("the fork() child hung")
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"
    t = torch.ones(8)
    group.all_reduce(t)  # the parents' group is intact
    group.destroy()
    return t[0].item()


def test_fork_child_gets_an_error_not_a_hang():
    assert run_ranks(_fork_child_job, 2, env=FAST) == [2.0, 2.0]


def _signal_handler_job(rank, world):
    """A signal handler that raises while an op waits (torch's DataLoader raises from SIGCHLD when a
    worker dies): the op finishes and the handler's exception follows, as with gloo, and the group
    stays usable; a handler that issues an op on the same group gets a RuntimeError, not a wait for
    ever."""
    import signal
    import threading

    import fairscale_c.distributed as fdist

    group = fdist.init_group(name="handled")
    results = []
    for handler_does in ("raise", "an op"):

        def handler(signum, frame, what=handler_does):
            if what == "raise":
                raise RuntimeError("DataLoader worker (pid 1) is killed by signal")
            group.barrier()

        signal.signal(signal.SIGUSR1, handler)
        t = torch.ones(4)
        if rank == 0:
            threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        else:
            time.sleep(1.0)  # rank 0 waits in the op meanwhile
        try:
            group.all_reduce(t)
            results.append("no error")
        except RuntimeError as e:
            results.append(str(e))
        assert t.tolist() == [2.0] * 4, (handler_does, t)  # the op finished
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)
        t = torch.ones(4)
        group.all_reduce(t)  # the group is still usable
        assert t.tolist() == [2.0] * 4, handler_does
    group.destroy()
    return results


def _signal_handler_threads_job(rank, world):
    """While the main thread waits in an op: another thread's op on the same group (it may not run
    inline: the guard still knows the main thread's op) and on another group (the handler's
    exception is not raised there, only in the main thread's op)."""
    import signal
    import threading

    import fairscale_c.distributed as fdist

    group, other = fdist.init_group(name="busy"), fdist.init_group(name="other")
    seen = {}

    def handler(signum, frame):
        try:
            group.barrier()
        except RuntimeError as e:
            seen["handler"] = str(e)
            raise ValueError("from the handler") from None

    def side():
        time.sleep(0.3)
        for g, name in ((group, "same group"), (other, "other group")):
            t = torch.ones(2)
            g.all_reduce(t)
            seen[name] = t.tolist()

    signal.signal(signal.SIGUSR1, handler)
    if rank == 0:
        thread = threading.Thread(target=side)
        thread.start()
        threading.Timer(0.8, os.kill, (os.getpid(), signal.SIGUSR1)).start()
    else:
        time.sleep(2.0)
    t = torch.ones(4)
    try:
        group.all_reduce(t)
        seen["main"] = "no error"
    except ValueError as e:
        seen["main"] = str(e)
    if rank == 0:
        thread.join()
    else:
        seen.update(zip(("same group", "other group"), [torch.ones(2), torch.ones(2)]))
        for g, name in ((group, "same group"), (other, "other group")):
            g.all_reduce(seen[name])
            seen[name] = seen[name].tolist()
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    assert t.tolist() == [2.0] * 4
    group.destroy()
    other.destroy()
    return seen


def _nested_handlers_job(rank, world):
    """Handler 1, run while the main thread's op on group A waits, runs an op on group B; handler 2,
    run while that op waits, issues an op on A and then destroy()s A: both are refused (they
    could only wait for the op on A) instead of hanging. Then Ctrl-C still ends a wait after a
    handler has run an op."""
    import signal
    import threading

    import fairscale_c.distributed as fdist

    ga, gb = fdist.init_group(name="nest-a"), fdist.init_group(name="nest-b")
    seen = {}
    if rank == 0:

        def h1(signum, frame):
            gb.all_reduce(torch.ones(2))
            seen["h1"] = "B op ran"

        def h2(signum, frame):
            for what, call in (("op", lambda: ga.all_reduce(torch.ones(2))), ("destroy", ga.destroy)):
                try:
                    call()
                except RuntimeError as e:
                    seen[what] = str(e)

        signal.signal(signal.SIGUSR1, h1)
        signal.signal(signal.SIGUSR2, h2)
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        threading.Timer(0.6, os.kill, (os.getpid(), signal.SIGUSR2)).start()
    else:
        time.sleep(1.0)
        gb.all_reduce(torch.ones(2))
    t = torch.ones(2)
    ga.all_reduce(t)
    seen["A"] = t.tolist()
    if rank == 0:  # the peer comes 3 s late: Ctrl-C at 0.6 s ends the wait then
        signal.signal(signal.SIGUSR1, lambda *a: gb.all_reduce(torch.ones(2)))
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR1)).start()
        threading.Timer(0.6, os.kill, (os.getpid(), signal.SIGINT)).start()
        start = time.monotonic()
        try:
            ga.all_reduce(torch.ones(2))
        except KeyboardInterrupt:
            seen["ctrl-c after"] = time.monotonic() - start
    else:
        gb.all_reduce(torch.ones(2))
        time.sleep(3.0)
    signal.signal(signal.SIGUSR1, signal.SIG_DFL)
    signal.signal(signal.SIGUSR2, signal.SIG_DFL)
    gb.destroy()
    ga.destroy()
    return seen


def test_nested_signal_handlers_are_refused_not_hung():
    env = {"FAIRSCALE_C_TIMEOUT": "6"}
    results = run_ranks(_nested_handlers_job, 2, env=env, timeout=60)
    assert results[0]["h1"] == "B op ran" and results[0]["A"] == results[1]["A"] == [2.0, 2.0], results
    assert "issued from inside another op of the group" in results[0]["op"], results
    assert "destroy() from inside an op of the group" in results[0]["destroy"], results
    assert results[0]["ctrl-c after"] < 2.0, results


def test_a_signal_handler_while_other_threads_use_the_groups():
    results = run_ranks(_signal_handler_threads_job, 2, env={"FAIRSCALE_C_TIMEOUT": "5"}, timeout=60)
    assert results[0]["main"] == "from the handler", results
    assert "issued from inside another op of the group on the same thread" in results[0]["handler"], results
    assert results[0]["same group"] == results[0]["other group"] == [2.0, 2.0], results


def test_a_signal_handler_that_raises_or_runs_an_op_during_an_op():
    results = run_ranks(_signal_handler_job, 2, env=FAST)
    assert results[1] == ["no error", "no error"], results
    assert "killed by signal" in results[0][0], results
    assert "issued from inside another op of the group on the same thread" in results[0][1], results


def _never_joins_job(rank, world):
    import fairscale_c.distributed as fdist

    if rank == 2:
        time.sleep(4)
        return None
    msg, elapsed = _expect_error(lambda: fdist.init_group(name="lonely"), "'lonely'", "rank(s) 2")
    return elapsed


def test_peer_that_never_joins():
    results = run_ranks(_never_joins_job, 3, env=FAST)
    assert all(r is None or r < 15 for r in results), results


def _dies_after_publishing_job(rank, world):
    import signal
    import threading

    import fairscale_c
    import fairscale_c.distributed as fdist

    # rank 1 publishes its part at once (within 1.5 s even on a loaded machine), then dies while
    # rank 2 is still on its way (a rank that dies before publishing is reported at the timeout)
    if rank == 1:
        threading.Timer(1.5, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    if rank == 2:
        time.sleep(4.0)
    start = time.perf_counter()
    try:
        fdist.init_group(name="late")
    except fairscale_c.DistributedError as exc:
        return str(exc), time.perf_counter() - start
    return "joined", time.perf_counter() - start


def test_a_rank_that_dies_after_publishing_its_part_is_named_at_once():
    # Its pid is in the part every rank reads: rank 0, waiting for every rank to confirm it read
    # the parts, names it instead of waiting out FAIRSCALE_C_TIMEOUT.
    results = run_ranks(_dies_after_publishing_job, 3, env={"FAIRSCALE_C_TIMEOUT": "60"}, may_die=[1], timeout=120)
    message, seconds = results[0]
    assert "rank 1 (pid" in message and "exited" in message, message
    assert seconds < 20, seconds
    assert results[2][0] != "joined", results[2]


# Rank 1 of 2 under torchrun's variables, the store's port either closed ("absent": nothing
# listens there) or held by a server that accepts connections and never answers ("silent").
_STORE_SCRIPT = """
import os, socket, sys, threading, time
server = socket.socket(); server.bind(("127.0.0.1", 0)); port = server.getsockname()[1]
if sys.argv[1] == "silent":
    server.listen(4)
    held = []
    threading.Thread(target=lambda: [held.append(server.accept()) for _ in range(4)], daemon=True).start()
else:
    server.close()
os.environ.update(RANK="1", WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
os.environ["FAIRSCALE_C_TIMEOUT"] = sys.argv[2]
import fairscale_c, fairscale_c.distributed as fdist
t = time.perf_counter()
try:
    fdist.init_group()
except fairscale_c.DistributedError as e:
    print(f"{time.perf_counter() - t:.2f} {e}")
"""


@pytest.mark.parametrize("host", ["absent", "silent"])
def test_a_store_host_absent_or_silent_is_reported_at_the_timeout(host):
    # absent: torch's client retries with pauses that outgrow its timeout (14.8 s at 8 s), so the
    # connect is retried in short tries up to FAIRSCALE_C_TIMEOUT instead. silent: torch's client
    # waits without a deadline once connected, so the connect runs on a thread of its own.
    import subprocess
    import sys

    timeout = {"absent": 8, "silent": 4}[host]
    cmd = [sys.executable, "-c", _STORE_SCRIPT, host, str(timeout)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout
    seconds, message = out.split(" ", 1)
    assert "cannot reach the TCPStore" in message and f"FAIRSCALE_C_TIMEOUT={timeout} s" in message, out
    assert ("did not answer" in message) == (host == "silent"), out  # absent: torch's own error says why
    assert timeout - 0.1 < float(seconds) < timeout + 3, seconds


def _dead_pid() -> int:
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: the pid no longer exists
    return child.pid


def _segment_name() -> str:
    import secrets

    return f"/fsc-{os.getpid()}-{secrets.token_hex(4)}"


def test_rank0_dies_before_creating_the_segment():
    # Rank 0 publishes the name first, then creates the segment; the peer waits for it, learns
    # that rank 0 is gone, and fails at once rather than at the timeout.
    from fairscale_c import _C

    pid, name = _dead_pid(), _segment_name()
    msg, elapsed = _expect_error(
        lambda: _C.ShmGroup("orphan", 1, 2, name, creator_pid=pid), "'orphan'", f"rank 0 (pid {pid}) exited"
    )
    assert elapsed < 2, elapsed


def test_rank0_dies_while_setting_up_the_segment():
    # The name exists but the segment was never set up (rank 0 died between creating and
    # initialising it): the peer removes the half-made name.
    from fairscale_c import _C

    pid, name = _dead_pid(), _segment_name()
    fd = os.open("/dev/shm" + name, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)  # as the creator makes it
    os.write(fd, bytes(1 << 16))
    os.close(fd)
    _expect_error(lambda: _C.ShmGroup("half", 1, 2, name, creator_pid=pid), "did not finish setting up")
    assert not os.path.exists("/dev/shm" + name)


def test_rank0_that_never_creates_times_out(monkeypatch):
    from fairscale_c import _C

    monkeypatch.setenv("FAIRSCALE_C_TIMEOUT", "1")
    msg, elapsed = _expect_error(
        lambda: _C.ShmGroup("late", 1, 2, _segment_name(), creator_pid=os.getpid()), "within 1 s"
    )
    assert 0.9 < elapsed < 5, elapsed


def _create_and_die(name, conn):
    from fairscale_c import _C

    group = _C.ShmGroup("abandoned", 0, 2, name, create=True)  # noqa: F841 (kept alive until the exit)
    conn.send(os.getpid())
    os._exit(0)  # no cleanup: the segment's name stays until a peer attaches


def test_rank0_dies_after_creating_the_segment():
    # Rank 0 set the segment up and died before any peer attached: the last rank to attach
    # removes the name, and joining names the dead rank (it never agreed on direct reads).
    import multiprocessing as mp

    import fairscale_c
    from fairscale_c import _C

    name = _segment_name()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_create_and_die, args=(name, child))
    proc.start()
    pid = parent.recv()
    proc.join(30)
    g = _C.ShmGroup("abandoned", 1, 2, name, creator_pid=pid)
    try:
        assert not os.path.exists("/dev/shm" + name)
        start = time.perf_counter()
        with pytest.raises(fairscale_c.DistributedError, match=rf"rank 0 \(pid {pid}\) exited while joining"):
            g.join()
        assert time.perf_counter() - start < 5
        with pytest.raises(fairscale_c.DistributedError, match="rank 0"):
            g.all_reduce(torch.ones(4))
    finally:
        g.close()


def _gives_up_job(rank, world):
    import fairscale_c.distributed as fdist

    group = fdist.init_group(name="giving-up")
    group.barrier()
    if rank == 2:  # after an error of its own, it will not send what rank 0 waits for
        time.sleep(0.5)
        group.abort()
        group.abort()  # idempotent
        msg, _ = _expect_error(lambda: group.all_reduce(torch.ones(4)), "'giving-up'", "this rank gave up")
        group.destroy()
        return msg
    if rank == 0:  # waiting on the calling thread
        msg, elapsed = _expect_error(
            lambda: group.recv(torch.ones(4), 2), "recv(count=4", "'giving-up'", "rank 2", "gave up"
        )
    else:  # waiting for the progress thread
        work = group.all_reduce(torch.ones(4), async_op=True)
        msg, elapsed = _expect_error(lambda: work.wait(), "all_reduce(count=4", "'giving-up'", "rank 2", "gave up")
    _expect_error(lambda: group.barrier(), "rank 2", "gave up")  # unusable from now on
    group.destroy()
    return elapsed


def test_a_rank_that_gives_up_is_reported_at_once():
    # FAIRSCALE_C_TIMEOUT is long: the waits end because rank 2 said it gave up, not at the timeout
    results = run_ranks(_gives_up_job, 3, env={"FAIRSCALE_C_TIMEOUT": "60"})
    assert all(0.3 < t < 10 for t in results[:2]), results
    assert "this rank gave up" in results[2]


def _stalled_job(rank, world):
    import fairscale_c.distributed as fdist

    group = fdist.init_group(name="stalled")
    if rank == 1:
        time.sleep(5)  # alive, but never calls the broadcast
        group.destroy()
        return None
    msg, elapsed = _expect_error(
        lambda: group.broadcast(torch.ones(3), root=0), "broadcast", "'stalled'", "rank 1 did not arrive"
    )
    group.destroy()
    return elapsed


def test_stalled_peer_times_out():
    elapsed, _ = run_ranks(_stalled_job, 2, env=FAST)
    assert 2.5 < elapsed < 10, elapsed


def _direct_send_or_recv(group, rank):
    import fairscale_c.distributed as fdist

    src = fdist.shared_empty(300_000, group=group)
    return group.send(src, 1) if rank == 0 else group.recv(torch.ones(300_001), 0)


def _mismatch_job(rank, world):
    import fairscale_c.distributed as fdist

    messages = []
    cases = [
        (
            "op",
            lambda g: g.all_reduce(torch.ones(8)) if rank == 0 else g.all_gather(torch.empty(16), torch.ones(8)),
            ["all_reduce(count=8", "all_gather(count=8"],
        ),
        ("count", lambda g: g.all_reduce(torch.ones(8 + rank)), ["count=8", "count=9"]),
        (
            "dtype",
            lambda g: g.all_reduce(torch.ones(8, dtype=torch.float32 if rank == 0 else torch.float64)),
            ["dtype=float32", "dtype=float64"],
        ),
        (  # a send completes once its data is in the shared buffer: the sender learns of the
            # refusal at its next op
            "send/recv",
            lambda g: (g.send(torch.ones(4), 1), g.barrier()) if rank == 0 else g.recv(torch.ones(5), 0),
            ["send(count=4", "recv(count=5"] if rank == 1 else ["refused", "recv(count=5"],
        ),
        (  # a message of more than two chunks from a shared tensor goes direct: its send waits for
            # the receiver's copy, so the sender learns of the refusal in the send itself
            "send/recv direct",
            lambda g: _direct_send_or_recv(g, rank),
            ["send(count=300000", "recv(count=300001"],
        ),
    ]
    for what, call, needles in cases:
        name = what.replace("/", "-").replace(" ", "-")
        group = fdist.init_group(name=f"mismatch-{name}")
        msg, _ = _expect_error(
            lambda call=call, group=group: call(group),
            f"'mismatch-{name}'",
            "rank 0",
            "rank 1",
            *needles,
        )
        messages.append(msg)
        group.destroy()
    return messages


def test_diverging_ranks_are_reported_on_every_rank():
    results = run_ranks(_mismatch_job, 2, env=FAST)
    assert all(len(m) == 5 for m in results)


def _cross_host_job(rank, world, how):
    import fairscale_c.distributed as fdist

    if how == "torch":
        import torch.distributed as dist

        dist.init_process_group("gloo")
        group = fdist.init_group()
        t = torch.full((10,), float(rank + 1))
        group.all_reduce(t, op="avg")
        assert t.tolist() == [1.5] * 10
        out = torch.empty(4)
        group.reduce_scatter(out, torch.arange(8.0), op="sum")
        assert out.tolist() == [2.0 * (4 * rank + i) for i in range(4)]
        full = torch.empty(6)
        group.all_gather(full, torch.full((3,), float(rank)))
        assert full.tolist() == [0.0] * 3 + [1.0] * 3
        b = torch.full((5,), float(rank))
        group.broadcast(b, root=1)
        assert b.tolist() == [1.0] * 5
        for op, want in (("max", 2.0), ("avg", 1.5)):
            r = torch.full((3,), float(rank + 1))
            group.reduce(r, root=1, op=op)
            if rank == 1:
                assert r.tolist() == [want] * 3, (op, r)
        got = torch.empty(4)
        if rank == 0:
            group.send(torch.arange(4.0), 1, tag=7)
        else:
            group.recv(got, 0, tag=7)
            assert got.tolist() == [0.0, 1.0, 2.0, 3.0]
        # a ring exchange as one batch, sends listed first on both ranks, then a collective in it
        mine, theirs, total = torch.full((2,), float(rank)), torch.empty(2), torch.ones(1)
        peer = 1 - rank
        group.batch([fdist.P2POp("send", mine, peer), fdist.P2POp("recv", theirs, peer), ("all_reduce", total, "sum")])
        assert theirs.tolist() == [float(peer)] * 2 and total.tolist() == [2.0]
        # all-to-all: torch's, under the engine's argument rules; the list form as a batch with a copy
        a2a = torch.empty(3)
        group.all_to_all_single(
            a2a, torch.arange(3.0) + 10 * rank, [1, 2] if rank == 0 else [2, 1], [1, 2] if rank == 0 else [2, 1]
        )
        assert a2a.tolist() == ([0.0, 10.0, 11.0] if rank == 0 else [1.0, 2.0, 12.0]), a2a
        with pytest.raises(ValueError, match="output overlaps input"):
            group.all_to_all_single(a2a, a2a)
        outs = [torch.empty(2), torch.empty(2)]
        group.all_to_all(outs, [torch.full((2,), 10.0 * rank + j) for j in range(2)])
        assert [o.tolist() for o in outs] == [[float(rank)] * 2, [10.0 + rank] * 2]
        # the engine's argument rules hold on torch's path too, before anything is sent
        with pytest.raises(ValueError, match=r"reduce_scatter: input has 2 elements; expected group size \(2\)"):
            group.reduce_scatter(torch.empty(2), torch.ones(2))
        with pytest.raises(ValueError, match=r"op: expected one of 'sum', 'avg', 'max', 'min', got 'prod'"):
            group.all_reduce(torch.ones(2), op="prod")
        ints = torch.ones(2, dtype=torch.int32)
        with pytest.raises(ValueError, match=r"op='avg' needs a floating dtype"):
            group.all_reduce(ints, op="avg")
        assert ints.tolist() == [1, 1]
        with pytest.raises(ValueError, match=r"'tensor' must be contiguous"):
            group.broadcast(torch.ones(3, 3).t(), root=0)
        with pytest.raises(ValueError, match=rf"send: dst={rank} is not a valid group rank"):
            group.batch([("send", torch.ones(1), rank)])
        r = torch.full((2,), float(rank))
        group.all_reduce(r, op=dist.ReduceOp.MAX)  # torch's ReduceOp names an op too
        assert r.tolist() == [1.0, 1.0]
        group.barrier()
        assert "torch" in repr(group)
        # a subgroup of a group that spans hosts runs through a torch subgroup too
        sub = group.new_group([1, 0])
        s = torch.full((2,), float(rank + 1))
        sub.all_reduce(s)
        assert s.tolist() == [3.0, 3.0] and "torch" in repr(sub)
        sub.destroy()
        group.destroy()
        return "fallback"
    msg, _ = _expect_error(fdist.init_group, "spans hosts", "one host")
    return msg


@pytest.mark.parametrize("how", ["torch", "env"])
def test_group_spanning_hosts(how, monkeypatch):
    results = run_ranks(_cross_host_job, 2, how, env={**FAST, "FAIRSCALE_C_HOSTNAME": "__per_rank__"})
    assert results[0] == results[1]


# ---------------------------------------------------------------- argument errors (one rank, in process)
class _FakeCuda:
    def __dlpack_device__(self):
        return (2, 0)


def test_argument_errors(solo):
    x = torch.ones(4)
    with pytest.raises(ValueError, match=r"all_gather: output has 3 elements; expected .* = 4"):
        solo.all_gather(torch.empty(3), x)
    with pytest.raises(ValueError, match=r"reduce_scatter: input has 4 elements; expected .* = 2"):
        solo.reduce_scatter(torch.empty(2), x)
    with pytest.raises(ValueError, match=r"output has dtype float64 but input has dtype float32"):
        solo.all_gather(torch.empty(4, dtype=torch.float64), x)
    with pytest.raises(ValueError, match=r"'tensor'.*contiguous"):
        solo.all_reduce(torch.ones(4, 4).t())
    with pytest.raises(ValueError, match=r"input is on cuda but output is on cpu"):
        solo.all_gather(torch.empty(4), _FakeCuda())
    with pytest.raises(ValueError, match=r"op='avg' needs a floating dtype"):
        solo.all_reduce(torch.ones(4, dtype=torch.int32), op="avg")
    with pytest.raises(ValueError, match=r"dtype int16"):
        solo.all_reduce(torch.ones(4, dtype=torch.int16))
    with pytest.raises(ValueError, match=r"'sum', 'avg', 'max', 'min'"):
        solo.all_reduce(x, op="prod")
    with pytest.raises(ValueError, match=r"root=1 is not a valid group rank"):
        solo.broadcast(x, root=1)
    with pytest.raises(ValueError, match=r"dst=0 is not a valid group rank"):
        solo.send(x, 0)
    # ranks beyond a C int are refused, not wrapped round to a valid rank
    with pytest.raises(ValueError, match=r"broadcast: root=4294967296 is not a valid group rank"):
        solo.broadcast(x, root=2**32)
    with pytest.raises(ValueError, match=r"recv: src=4294967297 is not a valid group rank"):
        solo.recv(x, 2**32 + 1)
    with pytest.raises(ValueError, match=r"item 0 \(send\): dst=4294967297 is not a valid group rank"):
        solo.batch([("send", x, 2**32 + 1)])
    with pytest.raises(TypeError, match=r"reduce: argument 'root' must be an int \(a group rank\), got float"):
        solo.reduce(x, root=0.0)
    with pytest.raises(TypeError, match=r"DLPack"):
        solo.all_reduce([1.0, 2.0])
    work = solo.all_reduce(torch.ones(4), async_op=True)
    with pytest.raises(ValueError, match=r"wait: timeout must be >= 0 or None, got -0.5"):
        work.wait(-0.5)
    with pytest.raises(TypeError, match=r"wait: timeout must be a number of seconds or None, got str"):
        work.wait("1")
    assert work.wait(10)
    with pytest.raises(ValueError, match=r"close: grace must be >= 0 or None, got -1"):
        solo._shm.close(grace=-1)
    # nothing was sent: the group still works
    solo.all_reduce(x)
    assert x.tolist() == [1.0] * 4


def test_destroyed_group_and_context_manager(solo):
    with solo:
        solo.barrier()
    with pytest.raises(RuntimeError, match="destroyed"):
        solo.all_reduce(torch.ones(1))


# A rank whose peer is alive but never joins (stuck elsewhere, in a debugger, waiting for input):
# Ctrl-C, an exception leaving a ``with group`` block, or plain interpreter exit with an op still
# queued must let the process go within a couple of seconds, not after FAIRSCALE_C_TIMEOUT (60 s
# here) or when the peer finally exits.
_EXIT_SCRIPT = """
import os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # subprocesses may start with SIGINT ignored
import torch
import fairscale_c.distributed as fdist
mode = sys.argv[1]
group = fdist.init_group(name="absent-peer")
print("joined", flush=True)
if group.rank == 1:
    time.sleep(120)  # alive, never takes part
    sys.exit(0)
t = torch.ones(1000)
if mode == "exit":
    group.all_reduce(t, async_op=True)  # left pending: the interpreter exits with it queued
elif mode == "sigint":
    print("waiting", flush=True)
    group.all_reduce(t)  # blocks until the test interrupts it
elif mode == "with":
    with group:
        group.all_reduce(t, async_op=True)
        raise RuntimeError("boom")
"""


def _start_pair(tmp_path, mode):
    import subprocess
    import sys

    script = tmp_path / "absent_peer.py"
    script.write_text(_EXIT_SCRIPT)
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1")
        env.update(MASTER_PORT=port, FAIRSCALE_C_TIMEOUT="60")
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), mode],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


@pytest.mark.parametrize("mode", ["exit", "sigint", "with"])
def test_rank_leaves_promptly_while_its_peer_is_absent(tmp_path, mode):
    import signal

    rank0, rank1 = _start_pair(tmp_path, mode)
    try:
        assert rank0.stdout.readline().strip() == "joined", rank0.stderr.read()
        if mode == "sigint":
            assert rank0.stdout.readline().strip() == "waiting"
            time.sleep(0.5)  # let it block inside the collective
            rank0.send_signal(signal.SIGINT)
        start = time.perf_counter()
        out, err = rank0.communicate(timeout=30)
        elapsed = time.perf_counter() - start
        assert rank1.poll() is None, "the peer was supposed to stay alive throughout"
    finally:
        for p in (rank0, rank1):
            if p.poll() is None:
                p.kill()
            p.communicate()
    assert elapsed < 10, f"rank 0 took {elapsed:.1f} s to exit ({mode}); stderr: {err[-2000:]}"
    if mode == "sigint":
        assert "KeyboardInterrupt" in err, err[-2000:]
    if mode == "with":
        assert "RuntimeError: boom" in err, err[-2000:]
    if mode == "exit":
        assert rank0.returncode == 0, err[-2000:]


# ---------------------------------------------------------------- shared-memory trust
# A segment is attached only when it is this user's and private to it, and only after its layout
# has been checked; a planted or corrupted one is a DistributedError, never a crash or a hang.

_HEADER = struct.Struct("<QIiQQQQQQQQQ")  # magic, version, size, chunk, p2p_chunk, piece, total, off_ranks..off_p2p
_FIELDS = ("magic", "version", "size", "chunk", "p2p_chunk", "piece", "total", "off_ranks", "off_chans",
           "off_slots", "off_result", "off_p2p")  # fmt: skip


def _genuine_segment(size=2):
    """The bytes of a real segment of `size` ranks just after its creator set it up."""
    from fairscale_c import _C

    name = _C._shm_segment_name()
    g = _C.ShmGroup("genuine", 0, size, name, create=True)
    try:
        with open("/dev/shm" + name, "rb") as f:
            data = bytearray(f.read())
    finally:
        g.close()  # removes the name
    data[128:132] = bytes(4)  # nattached: nobody yet
    return data


def test_segment_piece_follows_the_cpus_the_ranks_can_use():
    """all_gather, broadcast and reduce step through a quarter of the chunk only when every rank of
    the group can have a CPU of the creator's affinity mask; rank 0 writes the choice in the header."""
    cpus = len(os.sched_getaffinity(0))
    for size in sorted({2, cpus, cpus + 1} - {1}):
        header = dict(zip(_FIELDS, _HEADER.unpack_from(_genuine_segment(size))))
        want = header["chunk"] // 4 if size <= cpus else header["chunk"]
        assert header["piece"] == want, (size, cpus, header)


def _plant(data, mode=0o600, **fields):
    """Write `data` (header fields replaced by `fields`) as a new segment; returns its name."""
    from fairscale_c import _C

    values = dict(zip(_FIELDS, _HEADER.unpack_from(data)))
    values.update(fields)
    data = bytearray(data)
    _HEADER.pack_into(data, 0, *(values[f] for f in _FIELDS))
    name = _C._shm_segment_name()
    fd = os.open("/dev/shm" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.write(fd, data)
    os.fchmod(fd, mode)
    os.close(fd)
    return name


def _unlink(name):
    try:
        os.unlink("/dev/shm" + name)
    except FileNotFoundError:
        pass


def test_segment_open_to_other_users_is_refused():
    from fairscale_c import _C

    name = _plant(_genuine_segment(), mode=0o666)
    try:
        _expect_error(
            lambda: _C.ShmGroup("planted", 1, 2, name, creator_pid=os.getpid()),
            "'planted'",
            f"belongs to uid {os.geteuid()}",
            "mode 0666",
            "refusing to attach",
        )
    finally:
        _unlink(name)


@pytest.mark.skipif(os.geteuid() != 0, reason="planting a segment of another uid needs root")
def test_segment_of_another_user_is_refused():
    from fairscale_c import _C

    name = _plant(_genuine_segment())
    os.chown("/dev/shm" + name, 65534, 65534)  # a private segment, but of nobody
    try:
        _expect_error(
            lambda: _C.ShmGroup("planted", 1, 2, name, creator_pid=os.getpid()),
            "belongs to uid 65534",
            "mode 0600",
            f"expected this process's uid {os.geteuid()}",
        )
    finally:
        _unlink(name)


# Each case attaches both ranks of a planted 2-rank segment in one process and, if that succeeds,
# runs an all_reduce and a send/recv between them. Before the layout was validated these
# crashed (SIGSEGV, SIGFPE) or spun forever; now each is refused at attach.
_PLANTED_SCRIPT = """
import json, os, sys
import torch
from fairscale_c import _C
for case, name in json.loads(sys.argv[1]).items():
    try:
        g0 = _C.ShmGroup("planted", 0, 2, name, create=False, creator_pid=os.getpid())
        g1 = _C.ShmGroup("planted", 1, 2, name, creator_pid=os.getpid())
    except _C.DistributedError as exc:
        print(case, "refused:", exc, flush=True)
        continue
    g0.join(); g1.join()
    a, b = torch.ones(1000), torch.ones(1000)
    w = [g0.all_reduce(a, async_op=True), g1.all_reduce(b, async_op=True)]
    w += [g0.send(a, 1, async_op=True), g1.recv(b, 0, async_op=True)]
    for x in w:
        x.wait(10)
    print(case, "attached and ran", flush=True)
    g0.close(); g1.close()
"""


def test_planted_segment_layout_is_refused():
    import json
    import subprocess
    import sys

    real = _genuine_segment()
    header = dict(zip(_FIELDS, _HEADER.unpack_from(real)))
    cases = {
        "chunk 0": dict(chunk=0),
        "chunk smaller than an item": dict(chunk=1),
        "chunk not a multiple of 4096": dict(chunk=header["chunk"] + 8),
        "p2p_chunk 0": dict(p2p_chunk=0),
        "piece neither the chunk nor a quarter of it": dict(piece=header["chunk"] // 2),
        "piece larger than the chunk": dict(piece=header["chunk"] * 2),
        "off_ranks outside the mapping": dict(off_ranks=1 << 50),
        "off_slots outside the mapping": dict(off_slots=1 << 50),
        "off_p2p overlapping the slots": dict(off_p2p=header["off_slots"]),
        "total larger than the file": dict(total=header["total"] + 4096),
        "made for another world size": dict(size=3),
    }
    names = {case: _plant(real, **fields) for case, fields in cases.items()}
    try:
        r = subprocess.run(
            [sys.executable, "-c", _PLANTED_SCRIPT, json.dumps(names)],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, FAIRSCALE_C_TIMEOUT="10"),
        )
    finally:
        for name in names.values():
            _unlink(name)
    lines = {line.split(" refused:")[0]: line for line in r.stdout.splitlines() if " refused:" in line}
    assert r.returncode == 0, f"exit status {r.returncode}: {r.stdout[-2000:]} {r.stderr[-2000:]}"
    for case in cases:
        assert case in lines, f"{case}: not refused: {r.stdout[-3000:]}"
        assert "refusing to attach" in lines[case] and "'planted'" in lines[case], lines[case]


# Every rank killed (SIGTERM) while rank 0 waits for its peer to attach: nothing can remove the
# segment's name then, so the next group built on this host sweeps it (its creator has exited).
_DOOMED_SCRIPT = """
import time
import fairscale_c.distributed as fdist
from fairscale_c import _C
if fdist._rendezvous.os.environ["RANK"] == "1":
    _C.ShmGroup = lambda *a, **k: time.sleep(600)  # takes part in the exchange, never attaches
fdist.init_group(name="doomed")
"""


def test_segments_of_ranks_killed_during_rendezvous_are_swept():
    import signal
    import subprocess
    import sys

    from fairscale_c import _C

    before = shm_segments()
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        env["FAIRSCALE_C_TIMEOUT"] = "120"
        procs.append(subprocess.Popen([sys.executable, "-c", _DOOMED_SCRIPT], env=env, stderr=subprocess.PIPE))
    try:
        deadline = time.monotonic() + 120
        while not any(n.startswith(f"fsc-{procs[0].pid}-") for n in shm_segments() - before):
            assert time.monotonic() < deadline, "rank 0 never created its segment"
            assert procs[0].poll() is None, procs[0].stderr.read().decode()[-2000:]
            time.sleep(0.05)
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            p.stderr.close()
    left = {n for n in shm_segments() - before if n.startswith(f"fsc-{procs[0].pid}-")}
    assert left, "the killed rank 0 left no segment (nothing to sweep)"
    g = _C.ShmGroup("sweeper", 0, 1)  # building any group sweeps
    g.close()
    assert not left & shm_segments(), f"{left} left in /dev/shm after a new group was built"


def _dies_before_attaching_job(rank, world):
    import fairscale_c.distributed as fdist
    from fairscale_c import _C

    if rank == 1:
        _C.ShmGroup = lambda *a, **k: os._exit(0)  # dies between the exchange and the attach
    msg, elapsed = _expect_error(lambda: fdist.init_group(name="deserted"), "'deserted'", "rank 1 (pid")
    return elapsed


def test_rank_that_dies_before_attaching_is_named_at_once():
    elapsed, _ = run_ranks(_dies_before_attaching_job, 2, env={"FAIRSCALE_C_TIMEOUT": "40"}, may_die=[1])
    assert elapsed < 10, f"found after {elapsed:.1f} s; expected about a second, not the 40 s timeout"


@pytest.mark.parametrize("value", ["abc", "nan", "inf", "1e400", "-1", "0", "5s"])
def test_invalid_timeout_is_a_value_error(monkeypatch, value):
    import fairscale_c.distributed as fdist
    from fairscale_c import _C

    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("FAIRSCALE_C_TIMEOUT", value)
    needle = f"FAIRSCALE_C_TIMEOUT='{value}'"
    for build in (fdist.init_group, fdist.timeout_s, lambda: _C.ShmGroup("t", 0, 1)):
        with pytest.raises(ValueError, match=re.escape(needle)):
            build()
    monkeypatch.setenv("FAIRSCALE_C_TIMEOUT", "2.5")
    assert fdist.timeout_s() == 2.5


class _FailingStore:
    """A torch Store stand-in whose `fail` operation raises as a TCPStore whose host is gone does."""

    def __init__(self, fail: str) -> None:
        self.fail, self.data = fail, {}

    def _maybe_fail(self, op: str) -> None:
        if op == self.fail:
            raise RuntimeError("Connection reset by peer")

    def set(self, key, value):
        self._maybe_fail("set")
        self.data[key] = value if isinstance(value, bytes) else value.encode()

    def check(self, keys):
        self._maybe_fail("check")
        return all(k in self.data for k in keys)

    def get(self, key):
        self._maybe_fail("get")
        return self.data[key]


@pytest.mark.parametrize(
    "fail, when",
    [("set", "while publishing this rank's part"), ("check", "while waiting for rank"), ("get", "while reading")],
)
def test_rendezvous_store_failure_is_a_distributed_error(fail, when):
    """A store that fails at any step of an exchange (its host's process gone, the connection
    reset) gives DistributedError naming the group and the step, not torch's own exception."""
    from fairscale_c import DistributedError
    from fairscale_c.distributed._rendezvous import StoreExchange

    ex = StoreExchange(_FailingStore(fail), "p", 0, 1, "g")
    with pytest.raises(DistributedError, match=rf"rendezvous \(all_gather\) of group 'g' .*{when}.*Connection reset"):
        ex.all_gather(b"x")
    assert StoreExchange(_FailingStore("none"), "p", 0, 1, "g").all_gather(b"x") == [b"x"]
    with pytest.raises(DistributedError, match=r"rendezvous \(broadcast\) of group 'g'"):
        StoreExchange(_FailingStore(fail), "q", 0, 1, "g").broadcast(b"y")


def _outlasting_op_job(rank, world):
    """A collective that takes longer than FAIRSCALE_C_TIMEOUT while both ranks keep moving: rank 1
    is stopped for 0.2 s at a time (SIGSTOP from rank 0), so no wait of rank 0's lasts the 0.5 s
    timeout, though the whole op does."""
    import os
    import signal
    import threading

    import torch.distributed as dist

    import fairscale_c.distributed as fdist

    join_gloo(rank, world)
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    group = fdist.init_group()
    t = torch.ones(64 << 20)
    group.barrier()
    stop = threading.Event()

    def pulse():
        while not stop.is_set():
            os.kill(pids[1], signal.SIGSTOP)
            time.sleep(0.2)
            os.kill(pids[1], signal.SIGCONT)
            time.sleep(0.005)

    if rank == 0:
        pulser = threading.Thread(target=pulse)
        pulser.start()
    started = time.monotonic()
    try:
        group.all_reduce(t)
    finally:
        took = time.monotonic() - started
        if rank == 0:
            stop.set()
            pulser.join()
            os.kill(pids[1], signal.SIGCONT)
    return bool((t == world).all()), took


def test_a_collective_that_keeps_moving_may_outlast_the_timeout():
    results = run_ranks(_outlasting_op_job, 2, env={"FAIRSCALE_C_TIMEOUT": "0.5"}, timeout=120)
    assert all(ok for ok, _ in results), results
    assert max(took for _, took in results) > 0.5, results  # else the op did not outlast the timeout
