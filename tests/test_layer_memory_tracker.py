"""fairscale_c.experimental.tooling.layer_memory_tracker on CPU models (the C library's heap) and,
GPU-marked, on a CUDA one: FairScale's own checks of the traces (leaf modules only, forward then
backward in reverse, activation bytes per layer, in-place layers allocating nothing, the top
producers), nested outputs, saving and loading, the checkpoint suggestions against brute force
(and FairScale's function where importable), FSDP's all-gathers reported through a
ProcessGroupTracker at world 2, and the plots."""

import itertools
import random

import pytest
import torch
from torch import nn

from dist_utils import clean_dev_shm, run_ranks  # noqa: F401 (fixture)

from fairscale_c.experimental.tooling.layer_memory_tracker import (
    LayerwiseMemoryTracker,
    ProcessGroupTracker,
    find_best_reset_points,
    suggest_checkpoint_location,
)

FEATURES = 2 * 64 * 56 * 56 * 4  # bytes of one (2, 64, 56, 56) float32 feature map


def _conv_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(
            nn.Conv2d(3, 64, kernel_size=(3, 3), padding=(1, 1), bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=False),
            nn.AdaptiveAvgPool2d(output_size=(1, 1)),
        ),
        nn.Flatten(start_dim=1),
        nn.Sequential(nn.Linear(64, 2), nn.ReLU(inplace=True)),
    )


def _check_conv_traces(tracker):
    names = [t.module_name for t in tracker.memory_traces]
    expected = ["0.0", "0.1", "0.2", "0.3", "1", "2.0", "2.1"]
    assert names == expected + expected[::-1]
    forward = tracker.forward_traces
    assert forward[2].event.memory_activations == FEATURES, "ReLU(inplace=False) allocates its output"
    assert forward[6].event.memory_activations == 0, "ReLU(inplace=True) allocates nothing"
    assert forward[4].event.memory_activations == 0, "Flatten returns a view"
    summary = tracker.summary
    assert summary.total_forward_allocations >= summary.total_activation_allocations
    top = summary.top_forward_activation_producers[:3]
    assert [t.module_name for t in top] == ["0.0", "0.1", "0.2"]
    assert [t.module_params for t in top] == [3 * 3 * 64 * 3 * 4, 64 * 2 * 4, 0]
    assert all(t.event.memory_activations == FEATURES for t in top)
    # memory measured, not estimated: the three feature maps held after the forward
    for t in top:
        assert FEATURES <= t.event.memory_diff < FEATURES + (1 << 20), (t.module_name, t.event)
    assert summary.max_memory_allocated >= forward[0].allocated + 2 * FEATURES
    backward = tracker.backward_traces
    assert [t.event.memory_activations for t in backward][-3:] == [FEATURES] * 3  # gradients of the maps


def test_traces_of_a_cpu_model():
    model = _conv_model()
    tracker = LayerwiseMemoryTracker()
    tracker.monitor(model)
    x = torch.randn(2, 3, 56, 56)
    nn.CrossEntropyLoss()(model(x), torch.tensor([0, 1])).backward()
    _check_conv_traces(tracker)
    # stop() removes the hooks; clear_traces() forgets
    tracker.stop()
    count = len(tracker.memory_traces)
    model(x).sum().backward()
    assert len(tracker.memory_traces) == count
    tracker.clear_traces()
    assert tracker.memory_traces == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_traces_of_a_cuda_model():
    model = _conv_model().cuda()
    tracker = LayerwiseMemoryTracker()
    tracker.monitor(model)
    x = torch.randn(2, 3, 56, 56, device="cuda")
    nn.CrossEntropyLoss()(model(x), torch.tensor([0, 1], device="cuda")).backward()
    _check_conv_traces(tracker)
    assert tracker.summary.max_memory_cached >= tracker.summary.max_memory_allocated


class _Nested(nn.Module):
    def forward(self, x):
        return ((x * 2, (x + 1,)), {"y": x - 1, "view": x.view(-1)})


def test_nested_outputs_and_saved_traces(tmp_path):
    """Outputs nested in tuples and dicts are counted (FairScale's collector loops forever on a
    tuple inside a tuple); traces survive a save and a load."""
    model = nn.Sequential(nn.Linear(4, 8), _Nested())
    tracker = LayerwiseMemoryTracker()
    tracker.monitor(model)
    out = model(torch.randn(3, 4))
    (a, (b,)), rest = out
    (a.sum() + b.sum() + rest["y"].sum()).backward()
    nested = [t for t in tracker.forward_traces if t.module_name == "1"][0]
    assert nested.event.memory_activations == 3 * 3 * 8 * 4  # three new (3, 8) maps; the view is not new
    path = tmp_path / "traces.json"
    tracker.save_traces(str(path))
    again = LayerwiseMemoryTracker.load(str(path))
    assert again.memory_traces == tracker.memory_traces
    assert again.summary == tracker.summary


def _brute_force(sizes, k):
    n = len(sizes)
    best = None
    for cuts in range(k + 1):
        for positions in itertools.combinations(range(1, n + 1), cuts):
            bounds = [0, *positions, n]
            score = max(sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:]))
            best = score if best is None else min(best, score)
    return best


def test_best_reset_points_are_optimal():
    rng = random.Random(0)
    for _ in range(60):
        sizes = [rng.randint(0, 50) for _ in range(rng.randint(1, 8))]
        k = rng.randint(0, 4)
        score, cuts = find_best_reset_points(sizes, k)
        assert score == _brute_force(sizes, k), (sizes, k)
        bounds = [0, *cuts, len(sizes)]
        assert cuts == sorted(cuts) and len(cuts) <= k
        assert max(sum(sizes[a:b]) for a, b in zip(bounds, bounds[1:]) if a < b) == score
    with pytest.raises(ValueError, match="'num_checkpoints'"):
        find_best_reset_points([1, 2], -1)


def test_best_reset_points_equal_fairscales():
    fs = pytest.importorskip("fairscale.experimental.tooling.layer_memory_tracker")
    if fs.__spec__.name.startswith("fairscale_c"):
        pytest.skip("fairscale is this package's alias here, not FairScale")
    rng = random.Random(1)
    for _ in range(100):
        sizes = [rng.randint(0, 20) for _ in range(rng.randint(1, 9))]
        k = rng.randint(0, 4)
        assert find_best_reset_points(sizes, k) == fs.find_best_reset_points(sizes, k), (sizes, k)


def test_suggested_checkpoints_split_the_largest_activations():
    torch.manual_seed(0)
    widths = [8, 64, 8, 64, 8, 64, 8]
    layers = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    model = nn.Sequential(*layers)
    tracker = LayerwiseMemoryTracker()
    tracker.monitor(model)
    model(torch.randn(16, 8)).sum().backward()
    suggestion = suggest_checkpoint_location(tracker.memory_traces, num_checkpoints=2)
    assert suggestion.all_modules == [str(i) for i in range(len(layers))]
    sizes = [t.event.memory_activations for t in tracker.forward_traces]
    assert suggestion.max_memory == _brute_force(sizes, 2) < sum(sizes)
    assert 1 <= len(suggestion.split_modules) <= 2
    # more checkpoints than layers: a reset after the last module names no module
    few = suggest_checkpoint_location(tracker.memory_traces[:2], num_checkpoints=3)
    assert few.all_modules == ["0", "1"] and set(few.split_modules) <= {"1"}
    skipped = suggest_checkpoint_location(tracker.memory_traces, num_checkpoints=1, num_skipped_layers=2)
    assert skipped.all_modules == [str(i) for i in range(2, len(layers))]


def test_plots():
    tracker = LayerwiseMemoryTracker()
    model = _conv_model()
    tracker.monitor(model)
    model(torch.randn(2, 3, 16, 16)).sum().backward()
    try:
        import matplotlib  # noqa: F401
        import PIL  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install matplotlib"):
            tracker.show_plots(capture=True)
        return
    import matplotlib

    matplotlib.use("Agg")
    image = tracker.show_plots(capture=True)
    assert image.mode == "RGB" and image.size[0] > 100


def test_bad_model():
    with pytest.raises(TypeError, match="'model'"):
        LayerwiseMemoryTracker().monitor("model")


def _fsdp_job(rank, world):
    import torch.distributed as dist

    from fairscale_c.nn import FullyShardedDataParallel as FSDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    failures = []
    try:
        for tracked in (True, False):
            group = ProcessGroupTracker(dist.group.WORLD) if tracked else dist.group.WORLD
            torch.manual_seed(0)
            inner = [FSDP(nn.Linear(8, 16), process_group=group), FSDP(nn.Linear(16, 4), process_group=group)]
            model = FSDP(nn.Sequential(inner[0], nn.ReLU(), inner[1]), process_group=group)
            tracker = LayerwiseMemoryTracker()
            tracker.monitor(model)
            model(torch.randn(4, 8)).sum().backward()
            tracker.stop()
            gathered_fwd = sum(t.all_gathered for t in tracker.forward_traces)
            gathered_bwd = sum(t.all_gathered for t in tracker.backward_traces)
            params = sum(p.numel() * 4 for m in inner for p in m.parameters()) * world  # each rank's shard x world
            if not tracked:
                if gathered_fwd or gathered_bwd:
                    failures.append(f"untracked group reported {gathered_fwd} / {gathered_bwd} bytes")
                continue
            # the two layers' full parameters (8*16+16 and 16*4+4 floats, padded to the world) are
            # gathered in forward, and again in backward (resharded after forward)
            full = 4 * (8 * 16 + 16 + 16 * 4 + 4)
            if not (full <= gathered_fwd <= full + 4 * 4 * world) or gathered_fwd != params:
                failures.append(f"forward gathered {gathered_fwd} bytes; full parameters {full}, shards {params}")
            if gathered_bwd != gathered_fwd:
                failures.append(f"backward gathered {gathered_bwd} bytes, forward {gathered_fwd}")
            if not any(t.cumul_all_gathered > 0 for t in tracker.forward_traces):
                failures.append("no forward trace saw gathered parameters held")
    finally:
        dist.destroy_process_group()
    return failures


def test_fsdp_all_gathers_are_traced():
    assert run_ranks(_fsdp_job, 2, timeout=120) == [[]] * 2
