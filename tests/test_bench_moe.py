"""benchmarks/moe.py end to end at a tiny size: both spawned runs (times, then peaks) finish,
every framework present is timed and measured, and the table has a row per token count."""

from __future__ import annotations

import importlib.util
import json

import moe as moe_script


def test_moe_benchmark_runs_and_reports_every_framework(tmp_path, capsys):
    from dist_utils import orphaned_segments

    before = orphaned_segments()
    out = tmp_path / "moe.json"
    assert moe_script.main(["--tokens", "64,128", "--rounds", "1", "--steps", "1", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    have_fairscale = importlib.util.find_spec("fairscale") is not None
    frameworks = ["fairscale_c", "floor"] + (["fairscale"] if have_fairscale else [])
    assert sorted(results) == ["128", "64"]
    for row in results.values():
        for f in frameworks:
            assert row[f]["step_s"] > 0 and len(row[f]["rounds_s"]) == 1 and row[f]["peak_mib"] >= 0
        assert row["all_to_all"]["fairscale_c"] > 0 and row["all_to_all"]["gloo"] > 0
    table = capsys.readouterr().out
    assert table.count("\n| 64 |") == 1 and table.count("\n| 128 |") == 1
    if not have_fairscale:
        assert "not installed" in table
    assert orphaned_segments() - before == set()
