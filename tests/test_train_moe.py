"""examples/train_moe.py under torchrun at 2 processes on CPU, as a user runs it: the task loss
falls, and the shared layers (averaged over ranks) end identical on every rank while each rank
keeps its own experts."""

import os
import re
import subprocess
import sys

import pytest
from dist_utils import free_port, orphaned_segments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_moe.py")
STEP = re.compile(r"^step\s+(\d+)/\d+ task loss (\d+\.\d+) \| l_aux (\d+\.\d+)$")

pytestmark = pytest.mark.slow


def test_train_moe_learns_and_keeps_shared_layers_in_step():
    before = orphaned_segments()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2"]
    cmd += ["--master_addr=127.0.0.1", f"--master_port={free_port()}", SCRIPT, "--steps", "40"]
    env = dict(os.environ, FAIRSCALE_C_TIMEOUT="60", OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    losses = {int(m.group(1)): float(m.group(2)) for m in map(STEP.match, r.stdout.splitlines()) if m}
    assert sorted(losses) == [1, 10, 20, 30, 40], r.stdout
    assert losses[40] < 0.1 * losses[1], losses
    assert "shared parameters identical on every rank" in r.stdout, r.stdout
    assert orphaned_segments() - before == set()
