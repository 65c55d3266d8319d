"""benchmarks/p2p.py end to end at tiny sizes: both patterns, both libraries, private and shared
tensors; the ranks check the bytes they received."""

from __future__ import annotations


import pytest

import p2p as p2p_script


@pytest.mark.parametrize("shared", [False, True])
def test_p2p_benchmark_reports_both_patterns(shared, capsys):
    argv = ["--sizes", "64K", "1M", "--repeats", "2"] + (["--shared"] if shared else [])
    assert p2p_script.main(argv) == 0
    rows = [
        line
        for line in capsys.readouterr().out.splitlines()
        if line.startswith("| 0.0625 MiB") or line.startswith("| 1 MiB")
    ]
    assert len(rows) == 4 and {r.split("|")[2].strip() for r in rows} == {"exchange", "one way"}
    for r in rows:
        ours, gloo = float(r.split("|")[3]), float(r.split("|")[5])
        assert ours > 0 and gloo > 0
