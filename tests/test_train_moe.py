"""examples/train_moe.py under torchrun at 2 processes on CPU, as a user runs it: the task loss
falls, and the shared layers (averaged over ranks) end identical on every rank while each rank
keeps its own experts."""

import os
import re
import subprocess

import pytest
from dist_utils import orphaned_segments, torchrun_cmd, torchrun_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_moe.py")
STEP = re.compile(r"^step\s+(\d+)/\d+ task loss (\d+\.\d+) \| l_aux (\d+\.\d+)$")

pytestmark = pytest.mark.slow


def test_train_moe_learns_and_keeps_shared_layers_in_step():
    before = orphaned_segments()
    cmd = torchrun_cmd(SCRIPT, 2, "--steps", "40")
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=torchrun_env())
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    losses = {int(m.group(1)): float(m.group(2)) for m in map(STEP.match, r.stdout.splitlines()) if m}
    assert sorted(losses) == [1, 10, 20, 30, 40], r.stdout
    assert losses[40] < 0.1 * losses[1], losses
    assert "shared parameters identical on every rank" in r.stdout, r.stdout
    assert orphaned_segments() - before == set()
