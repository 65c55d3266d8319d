"""Whole-number arguments given as numpy integers (read from an array or a config), which
FairScale takes since it never checks their type: every constructor and function that checks an
int argument takes them, stores a Python int, and still refuses bools, floats and strings."""

from __future__ import annotations

import pytest
import torch
from torch import nn

np = pytest.importorskip("numpy")


def _builders():
    from fairscale_c.experimental.nn import MEVO
    from fairscale_c.experimental.nn.auto_shard import shard_model
    from fairscale_c.experimental.optim import DynamicLossScaler
    from fairscale_c.experimental.tooling.layer_memory_tracker import find_best_reset_points
    from fairscale_c.nn import Top2Gate
    from fairscale_c.nn.pipe.balance import balance_by_size
    from fairscale_c.optim.layerwise_gradient_scaler import LayerwiseGradientScaler

    lin = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    return {
        "Top2Gate": (lambda n: Top2Gate(n(8), n(4)), lambda g: (g.wg.in_features, g.wg.out_features)),
        "DynamicLossScaler": (
            lambda n: DynamicLossScaler(scale_window=n(8)),
            lambda s: (type(s.scale_window), s.scale_window),
        ),
        "LayerwiseGradientScaler": (
            lambda n: LayerwiseGradientScaler(lin, {"0": 1.0}, growth_interval=n(8)),
            lambda s: (type(s._growth_interval), s._growth_interval),
        ),
        "MEVO": (lambda n: MEVO(nn.Parameter(torch.randn(6, 4)), tile_factor=n(2)), lambda m: (type(m.tf_in), m.tf_in)),
        "shard_model": (lambda n: shard_model(lin, shard_count=n(2)), len),
        "find_best_reset_points": (lambda n: find_best_reset_points([1, 2, 3], num_checkpoints=n(1)), lambda r: r),
        "balance_by_size": (lambda n: balance_by_size(n(2), lin, torch.randn(2, 4), device="cpu"), sum),
    }


@pytest.mark.parametrize("name", sorted(_builders()))
def test_numpy_integers_count_as_ints(name):
    build, look = _builders()[name]
    plain = look(build(int))
    with_numpy = look(build(np.int64))
    assert plain == with_numpy
    for bad in (lambda v: float(v) + 0.5, lambda v: "8", lambda v: True):
        with pytest.raises((TypeError, ValueError)):
            build(bad)
