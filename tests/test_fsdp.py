"""FullyShardedDataParallel against single-process PyTorch, at world sizes 1, 2 and 4 (CPU)."""

import os
import tempfile

import pytest
import torch.multiprocessing as mp

import fsdp_scenarios


def spawn(world, names, fn=fsdp_scenarios.worker, extra=()):
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        mp.spawn(fn, args=(world, init_file, names, tmp) + tuple(extra), nprocs=world, join=True)
        failures = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.txt")) as f:
                text = f.read()
            if text:
                failures.append(text)
    assert not failures, "\n\n".join(failures)


ALL = sorted(fsdp_scenarios.SCENARIOS)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_fsdp_matches_pytorch(world):
    spawn(world, ALL)
