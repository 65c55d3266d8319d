"""examples/train_tensor_parallel.py under torchrun on CPU, as a user runs it: 2-way tensor
parallelism at 2 processes and 2 x 2 with data parallelism at 4; the loss falls and the
data-parallel replicas end with identical weights."""

import os
import re
import subprocess
import sys

import pytest
from dist_utils import free_port, orphaned_segments

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_tensor_parallel.py")
STEP = re.compile(r"^step\s+(\d+)/\d+ loss (\d+\.\d+)$")

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "procs,layout", [(2, "model parallel 2 x data parallel 1"), (4, "model parallel 2 x data parallel 2")]
)
def test_train_tensor_parallel_learns_and_keeps_replicas_in_step(procs, layout):
    before = orphaned_segments()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={procs}"]
    cmd += ["--master_addr=127.0.0.1", f"--master_port={free_port()}", SCRIPT, "--model-parallel", "2", "--steps", "40"]
    env = dict(os.environ, FAIRSCALE_C_TIMEOUT="60", OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    losses = {int(m.group(1)): float(m.group(2)) for m in map(STEP.match, r.stdout.splitlines()) if m}
    assert sorted(losses) == [1, 10, 20, 30, 40], r.stdout
    assert losses[40] < 0.1 * losses[1], losses
    assert f"{layout}; replicas identical" in r.stdout, r.stdout
    assert orphaned_segments() - before == set()
