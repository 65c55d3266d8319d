"""benchmarks/oss.py's paired CPU run: one tiny spawned job at world 2."""

from __future__ import annotations

from dataclasses import asdict

import fsdp
import oss as oss_script


def test_oss_paired_run_steps_every_framework_and_records_faults():
    """A real (tiny) paired OSS run at world 2, one spawned job: every framework steps once per
    round (the balanced orders), fairscale_c's losses equal plain DDP's bit for bit (world 2: one
    summation order), and each step's page faults are recorded for the report."""
    from dist_utils import orphaned_segments, run_ranks

    cfg = fsdp.quick_config()
    cfg.warmup, cfg.steps, cfg.threads = 1, 3, 1
    fws = ["fairscale_c", "ddp", "local"]
    before = orphaned_segments()
    ranks = run_ranks(oss_script.rank_main_paired, 2, fws, asdict(cfg), timeout=300)
    for r in ranks:
        for fw in fws:
            assert len(r[fw]["times"]) == len(r[fw]["minflt"]) == cfg.warmup + cfg.steps
            assert all(f >= 0 for f in r[fw]["minflt"])
        assert r["fairscale_c"]["losses"] == r["ddp"]["losses"]
    assert orphaned_segments() - before == set()


def test_paired_verdicts_take_the_median_of_per_step_ratios(capsys):
    """The paired run decides on ratios taken within each round (as fsdp.py does), not on the
    ratio of two medians: here every step but one is 1.04x the floor's step of its round, while
    the median steps, taken over rounds of different lengths, are 1.3x apart."""
    cfg = fsdp.quick_config()
    cfg.warmup, cfg.steps = 0, 3
    floor_ms, ours_ms, fs_ms = [100, 300, 200], [104, 312, 260], [140, 420, 280]

    def rank(fw_ms, engine_ms=(0.0, 0.0, 0.0)):
        return {
            "times": [t / 1e3 for t in fw_ms],
            "phases": [(0.0, 0.0, 0.0)] * 3,
            "minflt": [0, 0, 0],
            "losses": [1.0, 0.9, 0.8],
            "engine_ms": list(engine_ms),
        }

    # the progress threads' CPU per step: the slowest rank's each step (5, 9, 7), then the median
    engines = [(5.0, 2.0, 7.0), (1.0, 9.0, 3.0)]
    ranks = [
        {"local": rank(floor_ms), "fairscale_c": rank(ours_ms, engines[r]), "fairscale": rank(fs_ms)} for r in range(2)
    ]
    state = {"state_bytes": [100, 100], "param_numel": [10, 10], "largest_param_numel": [1, 1]}
    rows = {
        fw: {
            "framework": fw,
            "losses": [[1.0, 0.9, 0.8]] * 2,
            **state,
            **dict.fromkeys(("step_ms", "fwd_ms", "bwd_ms", "opt_ms"), 0.0),
            "step_ms_each": [],
        }
        for fw in ("local", "fairscale_c", "fairscale")
    }
    rows["local"]["state_bytes"] = [200, 200]
    oss_script._apply_paired(rows, ranks, cfg)
    assert rows["fairscale_c"]["paired_step_ratio_to_floor"] == 1.04
    assert rows["fairscale_c"]["step_ms"] / rows["local"]["step_ms"] == 1.3
    assert rows["fairscale_c"]["paired_engine_cpu_ms"] == 7.0 and rows["local"]["paired_engine_cpu_ms"] == 0.0
    # own per step: 4/40, 12/120, 60/80 -> median 0.1
    assert abs(rows["fairscale_c"]["paired_own_ratio_to_fairscale"] - 0.1) < 1e-12
    out = oss_script.verdicts(rows, cfg)
    assert out["target_step_met"] and out["target_own_time_met"]
    text = capsys.readouterr().out
    assert "target step <= 1.05x the floor: met (1.040x, median per-step ratio)" in text
    assert "median per-step ratio 0.100" in text


def test_separate_run_reports_memory_with_shared_pages_split():
    """A separate run's memory at the end: RSS above the baseline, and the same with shared-memory
    pages split among the ranks that map them. fairscale_c's ranks share the engine's segment and
    OSS's parameter buffer, so the split figure is below RSS; the floor shares nothing. The
    report line carries both for every row."""
    from dist_utils import run_ranks

    cfg = fsdp.quick_config()
    cfg.warmup, cfg.steps, cfg.threads = 1, 2, 1
    rows = []
    for fw in ("fairscale_c", "local"):
        ranks = run_ranks(oss_script.rank_main, 2, fw, asdict(cfg), None, timeout=300)
        for r in ranks:
            assert r["end_split_mib"] <= r["end_rss_mib"] + 1e-9, (fw, r["end_rss_mib"], r["end_split_mib"])
            shared = r["end_rss_mib"] - r["end_split_mib"]
            assert (shared > 0) == (fw == "fairscale_c"), (fw, shared, r["shmem_mib"])
        rows.append({"framework": fw, **{k: [r[k] for r in ranks] for k in ("end_rss_mib", "end_split_mib")}})
    line = fsdp.memory_end_line(rows)
    assert line is not None and "fairscale_c " in line and "local " in line
    assert fsdp.memory_end_line([{"framework": "x"}]) is None
