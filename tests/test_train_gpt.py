"""examples/train_gpt.py under torchrun, as a user runs it: training, a resume that goes on exactly
where the run stopped, and Ctrl-C on a terminal, which must stop every process and leave
/dev/shm clean."""

import os
import pty
import queue
import re
import shutil
import signal
import subprocess
import threading
import time

import pytest
from dist_utils import orphaned_segments, torchrun_cmd, torchrun_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_gpt.py")
STEP_LINE = re.compile(r"^step\s+(\d+)/\d+ \[[#.]+\] loss (\d+\.\d+) \| [\d,]+ tok/s \| peak RSS [\d,]+ MiB$")

pytestmark = pytest.mark.slow


def torchrun(*args):
    return torchrun_cmd(SCRIPT, 2, *args)


def env():
    return torchrun_env()


def run(cwd, *args):
    r = subprocess.run(torchrun(*args), cwd=cwd, capture_output=True, text=True, timeout=300, env=env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def losses(stdout):
    """{step: loss} from the progress lines."""
    found = {}
    for line in stdout.splitlines():
        m = STEP_LINE.match(line)
        if m:
            found[int(m.group(1))] = float(m.group(2))
    return found


def test_resume_continues_the_loss_curve(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    common = ["--steps", "6", "--save-every", "3", "--log-every", "1", "--ckpt-dir", ckpt]
    # Run from another directory: the script needs only the installed package.
    first = run(tmp_path, *common)
    full = losses(first)
    assert sorted(full) == [1, 2, 3, 4, 5, 6], first
    assert full[6] < full[1] - 0.2, full  # it learns
    assert sorted(os.listdir(ckpt)) == ["step-000003", "step-000006"]
    assert sorted(os.listdir(os.path.join(ckpt, "step-000003"))) == ["rank-0-of-2.pt", "rank-1-of-2.pt"]

    # Pretend the run stopped after the checkpoint at step 3, then resume it. A later run killed
    # while saving left a torn folder: one rank's file and the other's temporary one.
    shutil.rmtree(os.path.join(ckpt, "step-000006"))
    torn = os.path.join(ckpt, "step-000009")
    os.makedirs(torn)
    shutil.copy(os.path.join(ckpt, "step-000003", "rank-0-of-2.pt"), torn)
    open(os.path.join(torn, "rank-1-of-2.pt.tmp.12345"), "wb").close()
    second = run(tmp_path, *common, "--resume", "--keep", "1")
    assert "resumed from step 3" in second, second
    resumed = losses(second)
    assert sorted(resumed) == [4, 5, 6], second
    # Same batches, weights and AdamW state: the same curve (printed to 4 decimals).
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(full[step], abs=2e-4), (step, full, resumed)
    # --keep 1 kept the newest complete checkpoint, not the torn folder, which went too
    assert sorted(os.listdir(ckpt)) == ["step-000006"], os.listdir(ckpt)


def test_resume_skips_a_damaged_checkpoint_and_refuses_another_world_size(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    common = ["--steps", "6", "--save-every", "3", "--log-every", "1", "--ckpt-dir", ckpt]
    run(tmp_path, *common)
    newest = os.path.join(ckpt, "step-000006", "rank-1-of-2.pt")
    with open(newest, "r+b") as f:  # damaged on disk: cut short
        f.truncate(100)
    r = subprocess.run(
        torchrun(*common, "--resume"), cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env()
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "resumed from step 3" in r.stdout and f"cannot load {newest}" in r.stderr, r.stdout + r.stderr
    assert "checkpoint step 6" in r.stderr and "trying an older one" in r.stderr, r.stderr
    # the damaged one was set aside, so the resumed run's own step 6 replaced it and pruning kept it
    assert sorted(os.listdir(ckpt)) == ["step-000003", "step-000006", "step-000006.damaged"], os.listdir(ckpt)
    # A newer complete checkpoint of a 3-rank run: resuming 2 ranks from an older one would go back
    # in time silently, so it is refused; a 2-rank run's pruning leaves the 3-rank one alone.
    other = os.path.join(ckpt, "step-000099")
    os.makedirs(other)
    for rank in range(3):
        shutil.copy(os.path.join(ckpt, "step-000003", "rank-0-of-2.pt"), os.path.join(other, f"rank-{rank}-of-3.pt"))
    r = subprocess.run(
        torchrun(*common, "--resume"), cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env()
    )
    assert r.returncode != 0 and "(step 99) was saved by 3 ranks and this run has 2" in r.stdout + r.stderr, r.stderr
    run(tmp_path, *common, "--keep", "1")
    assert sorted(os.listdir(ckpt)) == ["step-000006", "step-000006.damaged", "step-000099"], os.listdir(ckpt)


def _read_terminal(fd, q):
    """Lines written to the pseudo-terminal `fd`; a progress bar's redraws (\\r) count as lines."""
    pending = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: every process holding the terminal has exited
            chunk = b""
        if not chunk:
            break
        *lines, pending = re.split(rb"[\r\n]", pending + chunk.replace(b"\x1b[K", b""))
        for line in lines:
            if line:
                q.put(line.decode(errors="replace"))
    if pending:
        q.put(pending.decode(errors="replace"))
    q.put(None)


@pytest.mark.serial  # interrupts and kills ranks
def test_ctrl_c_on_a_terminal_stops_every_rank_and_leaves_no_shared_memory(tmp_path):
    before = orphaned_segments()
    args = ["--steps", "100000", "--ckpt-dir", str(tmp_path / "ckpt"), "--save-every", "2"]
    args += ["--bf16", "--activation-checkpointing"]
    # On a terminal (the progress bar redraws every step) and in a session of its own, so the
    # signal reaches torchrun and its workers together, as a terminal's Ctrl-C does.
    main_fd, worker_fd = pty.openpty()
    proc = subprocess.Popen(
        torchrun(*args),
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        stdout=worker_fd,
        stderr=worker_fd,
        env=env(),
        start_new_session=True,
    )
    os.close(worker_fd)
    lines = queue.Queue()
    threading.Thread(target=_read_terminal, args=(main_fd, lines), daemon=True).start()
    seen = []
    try:
        deadline = time.monotonic() + 180
        while not any(STEP_LINE.match(s) and int(STEP_LINE.match(s).group(1)) >= 3 for s in seen):
            assert time.monotonic() < deadline and proc.poll() is None, "\n".join(seen)
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            if line is not None:
                seen.append(line)
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
        while (line := lines.get(timeout=10)) is not None:
            seen.append(line)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        os.close(main_fd)
    out = "\n".join(seen)
    assert "bf16, activation checkpointing" in out, out
    assert [int(STEP_LINE.match(s).group(1)) for s in seen if STEP_LINE.match(s)][:3] == [1, 2, 3], out
    stopped = re.search(r"interrupted; last checkpoint: step (\d+) in ", out)
    assert stopped and int(stopped.group(1)) >= 2, out
    # torchrun prints its own traceback for the signal; the workers print none.
    assert 'train_gpt.py", line' not in out, out
    assert proc.returncode != 0
    assert orphaned_segments() <= before
    assert _processes_running(SCRIPT, str(tmp_path)) == []


def _processes_running(*words):
    """Pids whose command line contains every word."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        if all(w in cmdline for w in words):
            pids.append(int(pid))
    return pids
