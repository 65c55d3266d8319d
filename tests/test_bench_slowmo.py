"""benchmarks/slowmo.py end to end at a tiny size: both spawned runs (times, then peaks) finish,
every framework present is timed and measured, and the table has a row per size."""

from __future__ import annotations

import importlib.util
import json

import slowmo as slowmo_script


def test_slowmo_benchmark_runs_and_reports_every_framework(tmp_path, capsys):
    from dist_utils import orphaned_segments

    before = orphaned_segments()
    out = tmp_path / "slowmo.json"
    argv = ["--sizes", "8x1x2,16x2x2", "--rounds", "1", "--steps", "3", "--out", str(out)]
    assert slowmo_script.main(argv) == 0
    results = json.loads(out.read_text())["results"]
    have_fairscale = slowmo_script.load_fairscale_slowmo() is not None
    frameworks = ["floor", "ddp"] + slowmo_script.OURS + (["fs_slowmo1"] if have_fairscale else [])
    assert sorted(results) == ["1x8 b2", "2x16 b2"]
    for row in results.values():
        assert sorted(f for f in row) == sorted(frameworks)
        for f in frameworks:
            assert row[f]["step_s"] > 0 and len(row[f]["rounds_s"]) == 1 and row[f]["peak_mib"] >= 0
    captured = capsys.readouterr()
    assert captured.out.count("\n| 1x8 b2 (") == 1 and captured.out.count("\n| 2x16 b2 (") == 1
    if importlib.util.find_spec("fairscale") is None:
        assert "not installed" in captured.err
    assert orphaned_segments() - before == set()
