"""benchmarks/fsdp.py's CUDA-report arithmetic and argument handling, on CPU (no GPU needed): the
--size presets, the FLOP / MFU formula, the batch picker, the per-framework report with a failed
framework, and --device cuda without CUDA."""

from __future__ import annotations

import math
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

sys.path.append(str(Path(__file__).resolve().parent.parent / "benchmarks"))

import fsdp  # noqa: E402


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
