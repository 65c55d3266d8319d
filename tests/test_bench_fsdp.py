"""benchmarks/fsdp.py's CUDA-report arithmetic and argument handling, on CPU (no GPU needed): the
--size presets, the FLOP / MFU formula, the batch picker, the per-framework report with a failed
framework, and --device cuda without CUDA."""

from __future__ import annotations

import math
from dataclasses import asdict

import pytest
import torch

import fsdp


def test_presets_have_the_advertised_sizes():
    counts = {size: fsdp.n_params(fsdp.preset_config(size)) for size in fsdp.PRESETS}
    assert counts == {"125m": 124_475_904, "350m": 354_871_296, "1.3b": 1_313_722_368}
    with pytest.raises(ValueError, match="size must be one of"):
        fsdp.preset_config("7b")


def test_flops_and_mfu():
    cfg = fsdp.preset_config("125m")
    cfg.world, cfg.batch = 2, 8
    n = 100_000_000
    per_token = 6 * n + 12 * 12 * 1024 * 768
    assert fsdp.model_flops_per_token(cfg, n) == per_token
    # 2 ranks x 8 x 1024 tokens in 0.5 s on one GPU of 1000 TFLOP/s
    assert math.isclose(fsdp.mfu(cfg, n, 0.5, 1, 1000.0), per_token * 16384 / (0.5 * 1e15))
    assert math.isclose(fsdp.mfu(cfg, n, 0.5, 2, 1000.0), fsdp.mfu(cfg, n, 0.5, 1, 1000.0) / 2)
    with pytest.raises(ValueError, match="mfu"):
        fsdp.mfu(cfg, n, 0.0, 1, 1000.0)


def test_batch_picker_fits_the_budget_and_shrinks_with_sharing():
    cfg = fsdp.preset_config("1.3b")
    cfg.bf16 = True
    n = fsdp.n_params(cfg)
    one = fsdp.pick_batch(cfg, n, 60.0, fsdp.CUDA_FRAMEWORKS)
    cfg.world = 2
    two = fsdp.pick_batch(cfg, n, 30.0, fsdp.CUDA_FRAMEWORKS)
    assert two < one
    trial = fsdp.Config(**{**asdict(cfg), "batch": two})
    assert max(fsdp.estimate_peak_gib(trial, fw, n) for fw in fsdp.CUDA_FRAMEWORKS) <= 30.0


def test_parse_args_size_overrides_and_reduce_dtype():
    a, cfg = fsdp.parse_args(["--device", "cuda", "--size", "350m", "--bf16", "--batch", "4", "--layers", "2"])
    assert (cfg.layers, cfg.d_model, cfg.heads, cfg.seq, cfg.vocab, cfg.batch) == (2, 1024, 16, 1024, 50304, 4)
    assert cfg.reduce_fp32 and cfg.size == "350m" and not a.batch_from_estimate
    _, cfg = fsdp.parse_args(["--quick"])
    assert not cfg.reduce_fp32  # the CPU path keeps its bf16 reduce
    _, cfg = fsdp.parse_args(["--size", "125m", "--bf16", "--frameworks", "fairscale_c,local"])
    assert cfg.batch >= 1
    for bad in (["--frameworks", "ddp"], ["--quick", "--size", "125m"], ["--batch", "0"], ["--world", "0"]):
        with pytest.raises(SystemExit):
            fsdp.parse_args(bad)


def _row(fw, step_ms, peak, losses, cfg):
    return {
        "framework": fw,
        "step_ms": step_ms,
        "tokens_per_s": cfg.world * cfg.batch * cfg.seq / (step_ms / 1e3),
        "peak_mib": [peak] * cfg.world,
        "losses": [losses] * cfg.world,
        "reduce_dtype": fsdp.reduce_dtype_of(fw, cfg),
    }


def test_cuda_report_targets_and_a_failed_framework(capsys):
    cfg = fsdp.preset_config("125m")
    cfg.world, cfg.batch, cfg.bf16, cfg.reduce_fp32 = 1, 8, True, True
    rows = [
        _row("torch_fsdp2", 120.0, 1000.0, [5.0, 4.0], cfg),
        _row("fairscale_c", 101.0, 990.0, [5.0, 4.25], cfg),
        {"framework": "fairscale", "error": "RuntimeError: boom", "reduce_dtype": "fp32"},
        _row("local", 100.0, 1500.0, [5.0, 4.5], cfg),
    ]
    targets = fsdp.cuda_report(rows, cfg, 124_475_904, 1, fsdp.H100_SXM_BF16_DENSE_TFLOPS)
    ours = rows[1]
    assert math.isclose(ours["own_ms_above_floor"], 1.0) and math.isclose(ours["step_vs_floor"], 1.01)
    assert ours["max_loss_diff_vs_fsdp2"] == 0.25 and ours["max_loss_diff_vs_floor"] == 0.25
    assert targets["step_vs_floor"]["met"] and targets["mem_vs_fsdp2"]["met"]
    assert targets["step_vs_fsdp2"]["met"] is True  # 101 / 120 = 0.84
    assert targets["tokens_vs_fairscale"]["met"] is None  # FairScale failed
    fsdp.print_cuda_table(rows, cfg, targets, 1, fsdp.H100_SXM_BF16_DENSE_TFLOPS)
    out = capsys.readouterr().out
    assert "fairscale   fails: RuntimeError: boom" in out
    assert "tokens/s >= 1.2x FairScale's: n/a" in out and "NOT met" not in out
    assert "12*layers*seq*d_model" in out and "fp32" in out


def test_failure_reason_takes_the_exception_line():
    err = RuntimeError('rank 0 failed:\nTraceback:\n  File "x.py", line 1\n    f()\nValueError: bad dtype\n')
    assert fsdp._failure_reason(err) == "ValueError: bad dtype"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given without CUDA")
def test_device_cuda_without_cuda_is_a_clear_error(capsys, tmp_path):
    assert fsdp.main(["--device", "cuda", "--quick", "--out", str(tmp_path / "x.json")]) == 2
    assert "--device cuda needs a GPU" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


# ---------------------------------------------------------------- the paired CPU method


def test_paired_orders_balance_positions_and_predecessors():
    for n in (2, 3, 4, 5):
        orders = fsdp.paired_orders(n)
        assert all(sorted(o) == list(range(n)) for o in orders)
        for pos in range(n):  # every framework in every position equally often
            counts = [sum(o[pos] == f for o in orders) for f in range(n)]
            assert len(set(counts)) == 1, (n, pos, counts)
        pairs = [(o[k], o[k + 1]) for o in orders for k in range(n - 1)]  # who directly follows whom
        assert len(set(pairs)) == n * (n - 1) and len(set(pairs.count(p) for p in set(pairs))) == 1
    assert fsdp.paired_orders(1) == [[0]]
    with pytest.raises(ValueError, match="n must be >= 1"):
        fsdp.paired_orders(0)


def _paired_ranks(cfg, steps_ms):
    """Synthetic rank results of rank_main_paired: framework -> per-step ms (rank 1 a little faster)."""
    ranks = []
    for slow in (0.0, -1.0):
        per = {}
        for fw, ms in steps_ms.items():
            times = [(m + slow) / 1e3 for m in ms]
            per[fw] = {
                "times": times,
                "phases": [(t / 4, t / 2, t / 4 - 1e-4, 1e-4) for t in times],
                "losses": [5.0 - 0.1 * i for i in range(len(ms))],
                "minflt": [10] * len(ms),
                "minflt_by_phase": [(4, 5, 1)] * len(ms),
                "engine_ms": [0.5 if fw == "fairscale_c" else 0.0] * len(ms),
                "cpu_ms": [m * 1.1 for m in ms],
                "main_cpu_ms": list(ms),
            }
        ranks.append(per)
    return ranks


def test_paired_summary_is_computed_within_rounds():
    cfg = fsdp.quick_config()
    cfg.warmup, cfg.steps = 1, 4
    # the floor drifts by 100 ms over the run; within each round ours is 1% above it and FSDP2 10%
    floor = [1000.0, 1000.0, 1050.0, 1100.0, 950.0]
    steps = {
        "torch_fsdp2": [f * 1.10 for f in floor],
        "fairscale_c": [f * 1.01 for f in floor],
        "local": floor,
    }
    out = fsdp.paired_summary(_paired_ranks(cfg, steps), cfg)
    ours = out["fairscale_c"]
    assert ours["ratio_to_floor"]["n"] == 4 and math.isclose(ours["ratio_to_floor"]["median"], 1.01)
    assert math.isclose(ours["own_vs_fsdp2"]["median"], 0.1)
    assert math.isclose(ours["own_ms"]["median"], 10.25)  # 1% of the timed floors' median, 1025 ms
    assert "own_vs_fsdp2" not in out["local"] and "own_vs_fsdp2" not in out["torch_fsdp2"]
    assert ours["engine_cpu_ms_total"] == 5.0 and out["local"]["engine_cpu_ms_total"] == 0.0
    # phases are the slowest rank's and sum to its step
    assert math.isclose(sum(ours["phase_ms"].values()), ours["step_ms"]["median"], rel_tol=1e-9)
    # separate medians would compare 1.01 * median(ours) with median(floor) of other runs; the paired
    # ratio is unaffected by how the floor moves between rounds
    with pytest.raises(ValueError, match="local"):
        fsdp.paired_summary([{"fairscale_c": r["fairscale_c"]} for r in _paired_ranks(cfg, steps)], cfg)


def test_cpu_verdicts_decide_on_the_paired_medians(capsys):
    cfg = fsdp.quick_config()
    cfg.warmup, cfg.steps = 1, 4
    floor = [1000.0, 1000.0, 1050.0, 1100.0, 950.0]
    steps = {"torch_fsdp2": [f + 100 for f in floor], "fairscale_c": [f + 5 for f in floor], "local": floor}
    paired = fsdp.paired_summary(_paired_ranks(cfg, steps), cfg)
    by = {}
    # separate runs: the floor's run happened to be 30 ms faster than the others' runs
    for fw, sep_ms, peak in (("torch_fsdp2", 1100.0, 500.0), ("fairscale_c", 1030.0, 450.0), ("local", 1000.0, 400)):
        by[fw] = {
            "framework": fw,
            "step_ms": sep_ms,
            "tokens_per_s": 1.0,
            "peak_mib": [peak, peak],
            "losses": paired[fw]["losses"],
            "hwm_reset": True,
            "paired": paired[fw],
        }
    out = fsdp._cpu_verdicts(by, cfg, paired=True)
    assert out["target_step_met"] and out["target_own_time_met"] and out["target_mem_met"]
    assert math.isclose(out["own_vs_fsdp2"], 0.05) and out["paired_max_loss_diff"] == 0
    assert not out["separate_target_own_time_met"]  # 30 ms of own time in the separate numbers
    fsdp.print_paired_table(list(by.values()), cfg)
    text = capsys.readouterr().out
    assert "target own time <= 0.1x FSDP2's: met (paired: median per-round ratio 0.050" in text
    assert "separate runs: own 30.0 vs FSDP2's 100.0 ms = 0.300x" in text
    assert "during the other frameworks' steps, all ranks, all steps: torch_fsdp2 0.000 ms, local 0.000 ms" in text


def test_cpu_verdicts_without_the_paired_run_use_the_separate_runs(capsys):
    cfg = fsdp.quick_config()
    by = {
        fw: {"framework": fw, "step_ms": ms, "peak_mib": [400.0, 410.0], "losses": [[5.0, 4.0]] * 2, "hwm_reset": True}
        for fw, ms in (("torch_fsdp2", 1100.0), ("fairscale_c", 1030.0), ("local", 1000.0))
    }
    out = fsdp._cpu_verdicts(by, cfg, paired=False)
    assert not out["target_own_time_met"] and not out["target_step_met"]  # 30 vs 100 ms; 1.03x
    assert out["target_own_time_met"] == out["separate_target_own_time_met"] and "paired_max_loss_diff" not in out
    assert "own time <= 0.1x FSDP2's: NOT met (separate runs: own 30.0 vs FSDP2's 100.0 ms" in capsys.readouterr().out


def test_paired_run_trains_every_framework_in_one_process_set():
    """A real (tiny) paired run at world 2, one spawned job: the floor's losses equal plain
    single-process PyTorch trained on the same rank's batches (so sharing the processes does not
    disturb a model), fairscale_c's equal FSDP2's bit for bit, and fairscale_c's progress threads
    stay asleep while the other frameworks step."""
    from dist_utils import orphaned_segments, run_ranks

    cfg = fsdp.quick_config()
    cfg.warmup, cfg.steps, cfg.threads = 1, 2, 1
    before = orphaned_segments()
    ranks = run_ranks(fsdp.rank_main_paired, 2, ["torch_fsdp2", "fairscale_c", "local"], asdict(cfg), timeout=300)
    out = fsdp.paired_summary(ranks, cfg)
    assert fsdp.max_loss_diff(out["fairscale_c"], out["torch_fsdp2"]) == 0
    for rank in range(2):
        torch.manual_seed(cfg.seed)
        model = fsdp.GPT(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        _, losses = fsdp._train(model, opt, fsdp.make_batches(cfg, rank, torch.device("cpu")), lambda: None)
        torch.testing.assert_close(out["local"]["losses"][rank], losses, atol=1e-6, rtol=0)
    assert out["fairscale_c"]["engine_cpu_ms_total"] > 0  # the threads are found at all
    # asleep on their condition variable: at most a wake-up's tail (microseconds) may land here
    assert out["torch_fsdp2"]["engine_cpu_ms_total"] < 5 and out["local"]["engine_cpu_ms_total"] < 5
    assert orphaned_segments() - before == set()


def test_malloc_env_adds_the_tunables_for_the_spawn_and_restores(monkeypatch):
    """The paired run's glibc settings reach the ranks through GLIBC_TUNABLES, after any tunables
    the caller set, and the parent's environment is as before afterwards."""
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    with fsdp.malloc_env("kept"):
        assert fsdp.os.environ["GLIBC_TUNABLES"] == fsdp.PAIRED_MALLOC["kept"]
    assert "GLIBC_TUNABLES" not in fsdp.os.environ
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2")
    with fsdp.malloc_env("kept"):
        assert fsdp.os.environ["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2:" + fsdp.PAIRED_MALLOC["kept"]
    with fsdp.malloc_env("default"):
        assert fsdp.os.environ["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"
    assert fsdp.os.environ["GLIBC_TUNABLES"] == "glibc.malloc.arena_max=2"
    with pytest.raises(KeyError):
        with fsdp.malloc_env("none such"):
            pass
