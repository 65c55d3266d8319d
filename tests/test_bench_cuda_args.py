"""The `--device cuda` choice of benchmarks/oss.py, pipe_stages.py and collectives.py, checked without a
GPU: a clear exit where CUDA ranks cannot run, the sharing rule of _harness.check_cuda_ranks (with
torch.cuda's answers stood in), and the CUDA-only flags. Nothing here spawns a process."""

from __future__ import annotations

import os
import time

import pytest
import torch

import _harness
import collectives
import oss as oss_script
import pipe_stages

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")


@no_cuda
@pytest.mark.parametrize(
    "main, out_flag",
    [(oss_script.main, "--out"), (pipe_stages.main, "--out"), (collectives.main, "--json")],
    ids=["oss", "pipe_stages", "collectives"],
)
def test_device_cuda_without_cuda_exits_with_a_message(main, out_flag, tmp_path):
    out = str(tmp_path / "r.json")
    with pytest.raises(SystemExit) as e:
        main(["--device", "cuda", out_flag, out])
    assert "--device cuda: no CUDA device: torch.cuda.is_available() is False" in str(e.value.code)
    assert not (tmp_path / "r.json").exists()


def _gpus(monkeypatch, count, nccl):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: nccl)


def test_check_cuda_ranks_sharing_rule(monkeypatch, tmp_path):
    env = _harness.NCCL_SHARE_ENV
    monkeypatch.delenv(env, raising=False)
    _gpus(monkeypatch, 2, (2, 28, 9))
    assert "one each" in _harness.check_cuda_ranks(2)
    assert env not in os.environ

    _gpus(monkeypatch, 1, (2, 28, 9))
    with pytest.raises(SystemExit, match=r"must share a GPU, which needs NCCL >= 2.30 .* torch's NCCL is 2.28.9"):
        _harness.check_cuda_ranks(2)
    _gpus(monkeypatch, 1, 22809)  # an old torch's single version code
    with pytest.raises(SystemExit, match="torch's NCCL is 2.28.9"):
        _harness.check_cuda_ranks(2)

    _gpus(monkeypatch, 1, (2, 31, 2))
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    note = _harness.check_cuda_ranks(2)
    assert "share 1 GPU" in note and "without MPS: they time-slice the GPU" in note
    assert os.environ[env] == "1"  # inherited by the ranks spawned next
    (tmp_path / "control").touch()  # what a running MPS control daemon leaves in its pipe directory
    assert "under MPS: their kernels run at the same time" in _harness.check_cuda_ranks(2)

    monkeypatch.setenv(env, "1")  # set by the user: trusted whatever torch reports
    _gpus(monkeypatch, 1, (2, 28, 9))
    assert "share 1 GPU" in _harness.check_cuda_ranks(2)
    monkeypatch.setenv(env, "0")
    with pytest.raises(SystemExit, match="forbids sharing"):
        _harness.check_cuda_ranks(2)
    with pytest.raises(ValueError, match="world must be an int >= 1"):
        _harness.check_cuda_ranks(0)
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        _harness.RankPool(2, device="gpu")


def test_cuda_only_flags_and_models():
    for bad in (["--bf16"], ["--deterministic"], ["--preset", "350m"], ["--device", "cuda", "--profile", "x"]):
        with pytest.raises(SystemExit) as e:
            oss_script.parse_args(bad)
        assert e.value.code == 2
    with pytest.raises(SystemExit):
        oss_script.parse_args(["--device", "cuda", "--quick", "--preset", "350m"])
    args, cfg, fws = oss_script.parse_args(["--device", "cuda"])
    assert args.out == oss_script.RESULTS_CUDA and cfg.vocab == 50304 and fws[-1] == "local"
    assert not args.deterministic and oss_script.parse_args(["--device", "cuda", "--deterministic"])[0].deterministic
    assert 120e6 < oss_script.base.n_params(cfg) < 130e6
    _, cfg, _ = oss_script.parse_args(["--device", "cuda", "--preset", "350m", "--layers", "2"])
    assert (cfg.layers, cfg.d_model) == (2, 1024)
    args, cfg, _ = oss_script.parse_args([])  # the CPU run keeps its model and file
    assert args.out == oss_script.RESULTS and cfg == oss_script.default_config()

    args, cfg = pipe_stages.parse_args(["--device", "cuda"])
    assert args.out == pipe_stages.RESULTS_CUDA and cfg == pipe_stages.cuda_config()
    assert all(cfg.batch % m == 0 for m in cfg.microbatches)
    args, cfg = pipe_stages.parse_args([])
    assert args.out == pipe_stages.RESULTS and cfg == pipe_stages.Config()
    _, cfg = pipe_stages.parse_args(["--device", "cuda", "--quick"])
    assert cfg == pipe_stages.quick_config()


class _HostEvent:
    """Stands in for torch.cuda.Event: records the host clock."""

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


def test_pipe_meter_times_by_events_on_cuda(monkeypatch):
    """pipe_stages.Meter(cuda=True) keeps forward and backward intervals as event pairs and adds
    them up in collect(); a backward with no parameter gradient after its start counts nothing."""
    monkeypatch.setattr(torch.cuda, "Event", _HostEvent)
    meter = pipe_stages.Meter(cuda=True)
    probe = pipe_stages.Probe(torch.nn.Linear(4, 4), meter)
    meter.reset(track=True)
    for _ in range(2):
        probe(torch.randn(3, 4)).sum().backward()
    meter.backward_starts()  # opened, never closed by a gradient
    meter.flush()
    assert [k for k, _, _ in meter._intervals] == ["fwd", "fwd", "bwd", "bwd"]
    assert meter.fwd_s == meter.bwd_s == 0.0  # nothing is read before collect()
    meter.collect()
    assert meter.fwd_s > 0 and meter.bwd_s > 0 and meter._intervals == []
    assert meter.tracker.peak > 0  # the activation count is device-independent


def test_oss_cuda_step_loop_matches_the_cpu_loop(monkeypatch):
    """oss.train_cuda (events and synchronisation stood in, autocast off) trains exactly as the CPU
    loop does and returns one (forward, backward, step) interval triple per step."""
    monkeypatch.setattr(torch.cuda, "Event", _HostEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    cfg = oss_script.base.quick_config()
    batches = oss_script.base.make_batches(cfg, 0, torch.device("cpu"))[:3]
    out = []
    for loop in (oss_script.train, oss_script.train_cuda):
        torch.manual_seed(cfg.seed)
        model, opt = oss_script.build_local(oss_script.base.GPT(cfg), cfg)
        out.append(loop(model, opt, batches, "local"))
    (_, _, cpu_losses), (times, phases, losses) = out
    assert losses == cpu_losses and len(times) == len(phases) == 3
    assert all(len(p) == 3 and min(p) >= 0 for p in phases)
