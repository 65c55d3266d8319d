"""benchmarks/async_pipe.py end to end at a tiny size: both spawned runs finish, every pipe present
(PipeRPCWrapper's included) is timed beside the one-process reference, and the table has a row per
size."""

from __future__ import annotations

import json

import async_pipe as async_pipe_script


def test_async_pipe_benchmark_runs_and_reports_every_framework(tmp_path, capsys):
    from dist_utils import orphaned_segments

    before = orphaned_segments()
    out = tmp_path / "async_pipe.json"
    argv = ["--sizes", "8x4x1,8x4x2", "--rounds", "1", "--steps", "2", "--out", str(out)]
    assert async_pipe_script.main(argv) == 0
    results = json.loads(out.read_text())["results"]
    have_fairscale = async_pipe_script.load_fairscale_async_pipe() is not None
    frameworks = ["fairscale_c", "fairscale_c rpc", "local"] + (["fairscale"] if have_fairscale else [])
    assert sorted(results) == ["w8 b4 c1", "w8 b4 c2"]
    for row in results.values():
        assert sorted(row) == sorted(frameworks)
        assert all(row[f]["step_s"] > 0 for f in frameworks)
    captured = capsys.readouterr()
    assert captured.out.count("\n| w8 b4 c1 |") == 1 and captured.out.count("\n| w8 b4 c2 |") == 1
    if not have_fairscale:
        assert "not installed" in captured.err
    assert orphaned_segments() - before == set()
