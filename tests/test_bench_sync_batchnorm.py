"""benchmarks/sync_batchnorm.py end to end at a tiny size: both spawned runs (times, then peaks)
finish, every framework present is timed and measured, and the table has a row per size."""

from __future__ import annotations

import importlib.util
import json

import sync_batchnorm as sbn_script


def test_sync_batchnorm_benchmark_runs_and_reports_every_framework(tmp_path, capsys):
    from dist_utils import orphaned_segments

    before = orphaned_segments()
    out = tmp_path / "sbn.json"
    argv = ["--sizes", "4x2x4,8x2x4", "--rounds", "1", "--steps", "1", "--out", str(out)]
    assert sbn_script.main(argv) == 0
    results = json.loads(out.read_text())["results"]
    have_fairscale = importlib.util.find_spec("fairscale") is not None
    frameworks = ["fairscale_c", "floor"] + (["fairscale"] if have_fairscale else [])
    assert sorted(results) == ["C4 N2 4x4", "C8 N2 4x4"]
    for row in results.values():
        for f in frameworks:
            assert row[f]["step_s"] > 0 and len(row[f]["rounds_s"]) == 1 and row[f]["peak_mib"] >= 0
    table = capsys.readouterr().out
    assert table.count("\n| C4 N2 4x4 |") == 1 and table.count("\n| C8 N2 4x4 |") == 1
    if not have_fairscale:
        assert "not installed" in table
    assert orphaned_segments() - before == set()
