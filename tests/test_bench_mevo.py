"""benchmarks/mevo.py end to end at a tiny size: the time and memory runs finish, every framework
present is timed and measured after the guard compared their losses and gradients, and the table
has a row per size."""

from __future__ import annotations

import importlib.util
import json

import mevo as mevo_script


def test_mevo_benchmark_runs_and_reports_every_framework(tmp_path, capsys):
    out = tmp_path / "mevo.json"
    argv = ["--sizes", "16x8x64,32x8x128", "--rounds", "1", "--steps", "1", "--out", str(out)]
    assert mevo_script.main(argv) == 0
    results = json.loads(out.read_text())["results"]
    have_fairscale = importlib.util.find_spec("fairscale") is not None
    frameworks = ["fairscale_c", "unfused"] + (["fairscale"] if have_fairscale else [])
    assert sorted(results) == ["16 x 8 -> 64", "32 x 8 -> 128"]
    for row in results.values():
        assert sorted(row) == sorted(frameworks)
        for f in frameworks:
            assert row[f]["step_s"] > 0 and len(row[f]["rounds_s"]) == 1 and row[f]["peak_mib"] >= 0
    table = capsys.readouterr().out
    assert table.count("\n| 16 x 8 -> 64 |") == 1 and table.count("\n| 32 x 8 -> 128 |") == 1
    if not have_fairscale:
        assert "not installed" in table
