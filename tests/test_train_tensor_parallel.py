"""examples/train_tensor_parallel.py under torchrun on CPU, as a user runs it: 2-way tensor
parallelism at 2 processes and 2 x 2 with data parallelism at 4; the loss falls and the
data-parallel replicas end with identical weights."""

import os
import re
import subprocess

import pytest
from dist_utils import orphaned_segments, torchrun_cmd, torchrun_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_tensor_parallel.py")
STEP = re.compile(r"^step\s+(\d+)/\d+ loss (\d+\.\d+)$")

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    "procs,layout", [(2, "model parallel 2 x data parallel 1"), (4, "model parallel 2 x data parallel 2")]
)
def test_train_tensor_parallel_learns_and_keeps_replicas_in_step(procs, layout):
    before = orphaned_segments()
    cmd = torchrun_cmd(SCRIPT, procs, "--model-parallel", "2", "--steps", "40")
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=torchrun_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    losses = {int(m.group(1)): float(m.group(2)) for m in map(STEP.match, r.stdout.splitlines()) if m}
    assert sorted(losses) == [1, 10, 20, 30, 40], r.stdout
    assert losses[40] < 0.1 * losses[1], losses
    assert f"{layout}; replicas identical" in r.stdout, r.stdout
    assert orphaned_segments() - before == set()
