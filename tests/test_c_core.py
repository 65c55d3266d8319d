"""The C-level tests in tests/c, built with make and the C compiler the extension needs: the shm
engine without Python (every op at 2-4 ranks, mismatches, dead peers, /dev/shm left clean), and
the NCCL backend's error paths and watchdog against a fake CUDA driver and NCCL, so they run
without a GPU."""

import os
import shutil
import subprocess

import pytest

C_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "c")

pytestmark = [
    pytest.mark.skipif(
        shutil.which("make") is None or shutil.which(os.environ.get("CC", "cc")) is None,
        reason="needs make and a C compiler",
    ),
    pytest.mark.serial,  # the C tests time their dead and stalled peers against 1 s timeouts
]


def _make(target: str) -> None:
    env = dict(os.environ)
    env.pop("FAIRSCALE_C_TIMEOUT", None)  # the Makefile sets what each test needs
    jobs = str(len(os.sched_getaffinity(0)))  # compiles side by side; the test itself runs alone
    cmd = ["make", "-j", jobs, "-C", C_TESTS, target]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, f"make {target} failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"


def test_shm_engine_in_c():
    _make("shm")


def test_nccl_backend_watchdog_with_fake_nccl():
    _make("nccl_fake")
