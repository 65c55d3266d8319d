"""benchmarks/model_parallel.py end to end at a tiny size: both spawned runs (times, then peaks)
finish, every framework present is timed and measured, and the table has a row per size."""

from __future__ import annotations

import json

import model_parallel as mp_script


def test_model_parallel_benchmark_runs_and_reports_every_framework(tmp_path, capsys):
    from dist_utils import orphaned_segments

    before = orphaned_segments()
    out = tmp_path / "mp.json"
    argv = ["--sizes", "64x16,128x32", "--rounds", "1", "--steps", "1", "--out", str(out)]
    assert mp_script.main(argv) == 0
    results = json.loads(out.read_text())["results"]
    frameworks = ["fairscale_c", "floor"] + (["fairscale"] if mp_script.load_fairscale_mpu() else [])
    assert sorted(results) == ["128x32", "64x16"]
    for row in results.values():
        for f in frameworks:
            assert row[f]["step_s"] > 0 and len(row[f]["rounds_s"]) == 1 and row[f]["peak_mib"] >= 0
    table = capsys.readouterr().out
    assert table.count("\n| 64x16 |") == 1 and table.count("\n| 128x32 |") == 1
    assert orphaned_segments() - before == set()
