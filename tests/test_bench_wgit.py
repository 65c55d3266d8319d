"""benchmarks/wgit.py end to end at a tiny size: every framework present runs every round, the
read-back check passes inside the workers, and the table and JSON report what was measured."""

from __future__ import annotations

import json
import shutil

import pytest

import wgit as wgit_script


@pytest.mark.skipif(shutil.which("git") is None, reason="Repo needs the git program")
def test_wgit_benchmark_runs_and_reports_every_framework(tmp_path, capsys):
    out = tmp_path / "wgit.json"
    argv = ["--mib", "2", "--tensors", "4", "--versions", "2", "--rounds", "1", "--out", str(out)]
    assert wgit_script.main(argv) == 0
    data = json.loads(out.read_text())
    frameworks = ["fairscale_c"] + ([] if data["skipped"] else ["fairscale"])
    assert sorted(data["results"]) == sorted(frameworks)
    for r in data["results"].values():
        assert len(r["rounds"]) == 1 and len(r["rounds"][0]["add_commit_s"]) == 2
        assert r["add_commit_s"] > 0 and r["read_s"] > 0 and 0 < r["store_mib"] < 4
    table = capsys.readouterr().out
    assert "| fairscale_c |" in table
    if data["skipped"]:
        assert "FairScale skipped" in table
