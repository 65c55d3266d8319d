"""fairscale_c.experimental.wgit.signal_sparsity and .signal_sparsity_profiling: FFT SST / DST /
reconstructions equal FairScale's expected tensors (fixed cases from FairScale's tests); full
top-k reconstructs the input for FFT and DCT along every dim; the DCT equals a direct float64
DCT-II and its inverse undoes it; DCT compression error shrinks as k grows; random masks keep
exactly k ones per slice; EnergyConcentrationProfile gives FairScale's values; bad arguments
raise errors that name them."""

import math
from typing import Optional

import pytest
import torch

from fairscale_c.experimental.wgit.signal_sparsity import (
    Algo,
    SignalSparsity,
    _dct_transform,
    _idct_transform,
    random_sparse_mask,
)
from fairscale_c.experimental.wgit.signal_sparsity_profiling import EnergyConcentrationProfile

RTOL = 1e-5
ATOL = 1e-6


def _close(actual: Optional[torch.Tensor], expected: torch.Tensor, rtol: float = RTOL, atol: float = ATOL) -> None:
    assert actual is not None
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


# ---------------------------------------------------------------------------------------------
# FFT: FairScale's expected values
# ---------------------------------------------------------------------------------------------


def _fixed_cases():
    """(dense, expected sst, expected dst, expected reconstruction, dim, k), from FairScale's tests."""
    t0 = torch.arange(12).sin().reshape(4, 3).float()
    sst0 = torch.tensor(
        [
            [0, 0, -1.3618 - 5.7650j],
            [0, 0, 0],
            [0, 0, 0],
            [0, -1.3618 + 5.7650j, 0],
        ],
        dtype=torch.complex64,
    )
    dst0 = torch.tensor([[0.22696666419506072998, 0, 0], [0, 0, 0], [0, 0, 0], [0.18515183031558990479, 0, 0]])
    rt0 = torch.tensor(
        [
            [0.00000000000000000000, 0.71862268447875976562, 0.94558942317962646484],
            [0.22696666419506072998, -0.71862268447875976562, -0.94558942317962646484],
            [-0.22696666419506072998, 0.71862268447875976562, 0.94558942317962646484],
            [0.41211849451065063477, -0.71862268447875976562, -0.94558942317962646484],
        ]
    )
    t1 = torch.tensor([0.0, 2, 3, 1, 6, 5, 7, 4, 8, 11, 9, 10, 0, 2, 5]).reshape(3, 5)
    sst1 = torch.tensor(
        [
            [
                12,
                0,
                -5.23606777191162109375 + 4.25325393676757812500j,
                -5.23606777191162109375 - 4.25325393676757812500j,
                0,
            ],
            [
                35,
                0,
                -5.85410213470458984375 - 1.45308518409729003906j,
                -5.85410213470458984375 + 1.45308518409729003906j,
                0,
            ],
            [
                26,
                12.01722049713134765625 - 3.57971239089965820312j,
                0,
                0,
                12.01722049713134765625 + 3.57971239089965820312j,
            ],
        ],
        dtype=torch.complex64,
    )
    dst1 = torch.tensor(
        [
            [0, -1.09442710876464843750, 0, 0.86524754762649536133, 0.90557289123535156250],
            [0, -2.23606777191162109375, -1.72360706329345703125, 0, 2.44721317291259765625],
            [0, 1.95278644561767578125, -2.15278673171997070312, 1.53049504756927490234, 0],
        ]
    )
    rt1 = torch.tensor(
        [
            [0.30557289719581604004, 2, 3.37082076072692871094, 1, 6],
            [4.65835905075073242188, 7, 4, 6.82917928695678710938, 11],
            [10.00688838958740234375, 10, 0, 2, 5.32360696792602539062],
        ]
    )
    t2 = torch.arange(12).cos().reshape(3, 2, 2).float()
    sst2 = torch.tensor(
        [
            [[0, 0], [1.41614687442779541016, 1.53029489517211914062]],
            [[0, 1.03756451606750488281], [-1.61381387710571289062, 0]],
            [[-0.98457157611846923828, 0], [0, -0.91555595397949218750]],
        ],
        dtype=torch.complex64,
    )
    dst2 = torch.tensor(
        [
            [[0, -0.22484511137008666992], [0.29192659258842468262, 0]],
            [[0.15326333045959472656, -0.23512005805969238281], [0, 0]],
            [[0.34678575396537780762, -0.45335227251052856445], [0, 0]],
        ]
    )
    rt2 = torch.tensor(
        [
            [[0.70807343721389770508, 0.54030233621597290039], [-0.41614684462547302246, -0.76514744758605957031]],
            [[-0.65364360809326171875, 0.28366219997406005859], [0.80690693855285644531, 0.51878225803375244141]],
            [[-0.14550003409385681152, -0.91113024950027465820], [-0.49228578805923461914, 0.45777797698974609375]],
        ]
    )
    return [
        pytest.param(t0, sst0, dst0, rt0, None, 2, id="4x3-dimNone-top2"),
        pytest.param(t1, sst1, dst1, rt1, 1, 3, id="3x5-dim1-top3"),
        pytest.param(t2, sst2, dst2, rt2, 1, 1, id="3x2x2-dim1-top1"),
    ]


@pytest.mark.parametrize("dense, expd_sst, expd_dst, expd_rt, dim, k", _fixed_cases())
def test_fft_lossy_compress_matches_fairscale(dense, expd_sst, expd_dst, expd_rt, dim, k):
    sparser = SignalSparsity(sst_top_k_element=k, sst_top_k_dim=dim, dst_top_k_element=k, dst_top_k_dim=dim)
    rt, sst, dst = sparser.lossy_compress(dense)
    _close(sst, expd_sst)
    _close(dst, expd_dst)
    _close(rt, expd_rt)
    # the same k given as a percentage selects the same components
    percent = k / (dense.numel() if dim is None else dense.shape[dim]) * 100
    by_percent = SignalSparsity(sst_top_k_percent=percent, sst_top_k_dim=dim, dst_top_k_percent=100)
    _close(by_percent.dense_to_sst(dense), sst)
    # reconstruction from the expected (frozen) SST and DST
    _close(sparser.sst_dst_to_dense(expd_sst, expd_dst), expd_rt)


def test_fft_sst_or_dst_disabled_matches_fairscale():
    dense = torch.tensor([0.5, 0.6, 0.7, 0.8])
    rt, sst, dst = SignalSparsity(dst_top_k_element=2, dst_top_k_dim=0).lossy_compress(dense)
    assert sst is None
    _close(rt, torch.tensor([0.0, 0.0, 0.7, 0.8]))
    _close(dst, torch.tensor([0.0, 0.0, 0.7, 0.8]))

    dense = torch.tensor([0.5, 0.6, 0.7, 0.8, 0.9])
    rt, sst, dst = SignalSparsity(sst_top_k_element=3, sst_top_k_dim=0).lossy_compress(dense)
    assert dst is None
    _close(rt, torch.tensor([0.6, 0.7618, 0.7, 0.6382, 0.8]), atol=1e-4)
    _close(
        sst,
        torch.tensor(
            [
                3.5,
                0,
                -0.25000002980232238770 + 0.08122986555099487305j,
                -0.25000002980232238770 - 0.08122986555099487305j,
                0,
            ]
        ),
    )


@pytest.mark.parametrize("dim", [None, 0, 1, 2, -1])
def test_fft_full_sst_is_the_fft(dim):
    x = torch.arange(80).reshape(4, 5, 4)
    sst = SignalSparsity(sst_top_k_percent=100, sst_top_k_dim=dim, dst_top_k_percent=100).dense_to_sst(x)
    expected = torch.fft.fft(x.flatten()).reshape(x.shape) if dim is None else torch.fft.fft(x, dim=dim)
    assert sst is not None and torch.equal(sst, expected)


def test_lossy_compress_at_zero_sparsity_returns_the_input():
    dense = torch.linspace(-10, 15, 36).reshape(6, 6)
    for algo in Algo:
        sparser = SignalSparsity(
            algo=algo, sst_top_k_percent=100, sst_top_k_dim=1, dst_top_k_percent=100, dst_top_k_dim=1
        )
        rt, sst, dst = sparser.lossy_compress(dense)
        assert rt is dense and sst is None and dst is dense


# ---------------------------------------------------------------------------------------------
# perfect reconstruction, FFT and DCT
# ---------------------------------------------------------------------------------------------

_INPUTS = {
    "2d": torch.linspace(-0.1, 0.6, 35).reshape(7, 5),
    "3d": torch.arange(60).float().reshape(3, 5, 4).sin(),
}


@pytest.mark.parametrize("algo", list(Algo))
@pytest.mark.parametrize("name", sorted(_INPUTS))
@pytest.mark.parametrize("dim", [None, 0, 1, -1])
def test_full_top_k_reconstructs(algo, name, dim):
    dense = _INPUTS[name]
    k = dense.numel() if dim is None else dense.shape[dim]
    sparser = SignalSparsity(algo=algo, sst_top_k_element=k, sst_top_k_dim=dim, dst_top_k_element=k, dst_top_k_dim=dim)
    sst = sparser.dense_to_sst(dense)
    assert sst is not None and sst.is_complex() == (algo is Algo.FFT)
    # the SST alone already inverts to the input
    _close(sparser.sst_dst_to_dense(sst), dense, atol=1e-5)
    dst = sparser.dense_sst_to_dst(dense, sst)
    _close(sparser.sst_dst_to_dense(sst, dst), dense)


# ---------------------------------------------------------------------------------------------
# DCT
# ---------------------------------------------------------------------------------------------


def _reference_dct_matrix(n: int) -> torch.Tensor:
    """M[k, j] = s_k cos(pi (2j + 1) k / (2n)), the orthonormal DCT-II, in float64."""
    k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    j = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    m = torch.cos(math.pi * (2 * j + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    m[0] *= math.sqrt(0.5)
    return m


def _reference_dct(x: torch.Tensor, dim: Optional[int]) -> torch.Tensor:
    if dim is None:
        return (_reference_dct_matrix(x.numel()) @ x.reshape(-1)).reshape(x.shape)
    moved = x.movedim(dim, -1)
    return (moved @ _reference_dct_matrix(moved.shape[-1]).T).movedim(-1, dim)


@pytest.mark.parametrize(
    "shape, dim",
    [
        ((1,), 0),
        ((2,), 0),
        ((7,), 0),
        ((16,), -1),
        ((5, 8), None),
        ((5, 8), 0),
        ((5, 8), 1),
        ((3, 4, 9), 1),
        ((3, 4, 9), -1),
        ((3, 4, 9), None),
    ],
)
def test_dct_matches_direct_dct_ii_and_inverts(shape, dim):
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, dtype=torch.float64, generator=gen)
    coeffs = _dct_transform(x, dim)
    assert coeffs.dtype == torch.float64 and coeffs.shape == x.shape
    _close(coeffs, _reference_dct(x, dim), rtol=0, atol=1e-12)
    _close(_idct_transform(coeffs, dim), x, rtol=0, atol=1e-12)
    # float32 computes in float32; integers in the default dtype
    x32 = x.float()
    _close(_idct_transform(_dct_transform(x32, dim), dim), x32, rtol=0, atol=1e-5)
    assert _dct_transform(torch.arange(6), 0).dtype == torch.get_default_dtype()


def test_dct_sst_is_real_top_k_by_magnitude():
    x = torch.randn(6, 10, generator=torch.Generator().manual_seed(3))
    sst = SignalSparsity(algo=Algo.DCT, sst_top_k_element=3, sst_top_k_dim=1).dense_to_sst(x)
    assert sst is not None and sst.dtype == torch.float32
    coeffs = _dct_transform(x, 1)
    assert torch.equal((sst != 0).sum(dim=1), torch.full((6,), 3))
    kept = torch.where(sst != 0, coeffs.abs(), torch.full_like(coeffs, math.inf)).amin(dim=1)
    dropped = torch.where(sst == 0, coeffs.abs(), torch.zeros_like(coeffs)).amax(dim=1)
    assert torch.all(kept >= dropped)
    assert torch.equal(sst[sst != 0], coeffs[sst != 0])


@pytest.mark.parametrize("dim", [None, 1])
def test_dct_error_shrinks_as_k_grows(dim):
    t = torch.linspace(0, 1, 32, dtype=torch.float64)
    dense = torch.stack([torch.sin(2 * math.pi * f * t) + 0.3 * t for f in (1.0, 2.5, 4.0, 7.0)])
    size = dense.numel() if dim is None else dense.shape[dim]
    errors = []
    for k in range(1, size + 1, max(1, size // 8)):
        rt, sst, dst = SignalSparsity(algo=Algo.DCT, sst_top_k_element=k, sst_top_k_dim=dim).lossy_compress(dense)
        assert dst is None and sst is not None
        errors.append((rt - dense).norm().item())
        # orthonormal: the squared error is the energy of the dropped coefficients
        dropped = _dct_transform(dense, dim) - sst
        assert errors[-1] == pytest.approx(dropped.norm().item(), abs=1e-10)
    assert all(b <= a + 1e-12 for a, b in zip(errors, errors[1:]))
    assert errors[-1] < 0.1 * errors[0]


def test_dct_with_dst_only_uses_a_real_zero_sst():
    dense = torch.tensor([[0.5, -0.6, 0.7], [0.8, 0.1, -0.9]])
    dst = SignalSparsity(algo=Algo.DCT, dst_top_k_element=1, dst_top_k_dim=1).dense_sst_to_dst(dense, None)
    _close(dst, torch.tensor([[0.0, 0.0, 0.7], [0.0, 0.0, -0.9]]))


# ---------------------------------------------------------------------------------------------
# argument errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sst_top_k_element=10, sst_top_k_percent=50), "sst_top_k_element and sst_top_k_percent can't both be set"),
        (
            dict(sst_top_k_element=10, dst_top_k_element=10, dst_top_k_percent=50),
            "dst_top_k_element and dst_top_k_percent",
        ),
        (dict(sst_top_k_element=0), r"sst_top_k_element must be greater than 0, got 0"),
        (dict(sst_top_k_percent=0), r"sst_top_k_percent must be in \(0, 100\], got 0"),
        (dict(sst_top_k_element=10, dst_top_k_element=0), "dst_top_k_element must be greater than 0"),
        (dict(sst_top_k_element=10, dst_top_k_percent=0), r"dst_top_k_percent must be in \(0, 100\]"),
        (dict(dst_top_k_percent=100.5), r"dst_top_k_percent must be in \(0, 100\], got 100.5"),
        (dict(algo="dct"), "algo must be Algo.FFT or Algo.DCT"),
        (dict(algo=1), "algo must be"),
    ],
)
def test_bad_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SignalSparsity(**kwargs)


def test_bad_call_arguments_raise():
    dense = torch.ones(4, 3)
    with pytest.raises(ValueError, match="sst_top_k_element must be at most 3"):
        SignalSparsity(sst_top_k_element=4).dense_to_sst(dense)
    with pytest.raises(ValueError, match="dst_top_k_element must be at most 4"):
        SignalSparsity(dst_top_k_element=5, dst_top_k_dim=0).lossy_compress(dense)
    sparser = SignalSparsity(sst_top_k_element=1, dst_top_k_element=1)
    with pytest.raises(ValueError, match="dense and sst must have the same shape"):
        sparser.dense_sst_to_dst(dense, torch.zeros(3, 4, dtype=torch.complex64))
    with pytest.raises(ValueError, match="sst and dst can't both be None"):
        sparser.sst_dst_to_dense(None, None)
    with pytest.raises(ValueError, match="sst and dst can't both be None"):
        SignalSparsity().lossy_compress(dense)
    with pytest.raises(TypeError, match="sst must be a complex tensor"):
        sparser.sst_dst_to_dense(dense)
    with pytest.raises(TypeError, match="real tensor"):
        SignalSparsity(algo=Algo.DCT, sst_top_k_element=1).sst_dst_to_dense(dense.to(torch.complex64))
    for percent in (0, -5, 100.1):
        with pytest.raises(ValueError, match=rf"percent must be in \(0, 100\], got {percent}"):
            random_sparse_mask(dense, percent, 0)


# ---------------------------------------------------------------------------------------------
# random_sparse_mask
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, percent, dim, k",
    [
        ((5,), 20, 0, 1),
        ((100, 100), 1, 0, 1),
        ((100, 100), 1, 1, 1),
        ((40, 30), 7.5, 0, 3),
        ((40, 30), 50, 1, 15),
        ((4, 6, 10), 100, 2, 10),
        ((4, 6, 10), 0.1, -2, 1),
    ],
)
def test_random_sparse_mask_keeps_k_per_slice(shape, percent, dim, k):
    dense = torch.rand(shape)
    mask = random_sparse_mask(dense, percent, dim)
    assert mask.shape == dense.shape and mask.dtype == dense.dtype
    assert torch.all((mask == 0) | (mask == 1))
    assert torch.equal(mask.sum(dim=dim), torch.full_like(mask.sum(dim=dim), k))


# ---------------------------------------------------------------------------------------------
# EnergyConcentrationProfile
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dim, percents, in_tensor, expected",
    [
        (0, [1, 5, 10, 100], torch.ones(100), [0.01, 0.05, 0.1, 1.0]),
        (0, [1, 3, 33, 66, 90], torch.tensor([0.1, 0.2, 0.1, 0.45]).repeat(100, 1), [0.01, 0.03, 0.33, 0.66, 0.9]),
    ],
)
def test_energy_profile_matches_fairscale(dim, percents, in_tensor, expected):
    ecp = EnergyConcentrationProfile(dim, percents)
    assert ecp.percents == [float(p) for p in percents] and ecp.dim == dim
    expected_tensors = [torch.tensor(v) for v in expected]
    out = ecp.measure(in_tensor)
    assert all(o.dim() == 0 for o in out)
    torch.testing.assert_close(out, expected_tensors, rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(
        ecp.measure_fft(torch.fft.ifft(in_tensor, dim=dim)), expected_tensors, rtol=RTOL, atol=ATOL
    )


def test_energy_profile_is_monotone_along_a_negative_dim():
    x = torch.randn(3, 4, 50, generator=torch.Generator().manual_seed(1))
    for out in (
        EnergyConcentrationProfile(-1, [1, 10, 50, 100]).measure(x),
        EnergyConcentrationProfile(2, [5, 20]).measure_fft(x),
    ):
        values = [o.item() for o in out]
        assert all(0 <= a <= b for a, b in zip(values, values[1:]))
    assert EnergyConcentrationProfile(-1, [100]).measure(x)[0].item() == pytest.approx(1.0)


def test_energy_profile_bad_arguments_raise():
    with pytest.raises(TypeError, match="dim must be an int"):
        EnergyConcentrationProfile(1.0, [10])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="dim must be an int"):
        EnergyConcentrationProfile(True, [10])
    with pytest.raises(TypeError, match="top_k_percents must hold numbers"):
        EnergyConcentrationProfile(0, ["10"])  # type: ignore[list-item]
    for bad in ([0], [-1], [100.5], [float("nan")]):
        with pytest.raises(ValueError, match=r"top_k_percents values must be in \(0, 100\]"):
            EnergyConcentrationProfile(0, bad)
    for bad in ([10, 10], [50, 20]):
        with pytest.raises(ValueError, match="top_k_percents must be strictly increasing"):
            EnergyConcentrationProfile(0, bad)
    ecp = EnergyConcentrationProfile(2, [50])
    with pytest.raises(TypeError, match="in_tensor must be a floating-point tensor"):
        ecp.measure(torch.ones(3, 4, 5, dtype=torch.int64))
    for fn in (ecp.measure, ecp.measure_fft):
        with pytest.raises(ValueError, match=r"dim must be in \[-2, 2\) for in_tensor of shape \(3, 4\), got 2"):
            fn(torch.ones(3, 4))
    with pytest.raises(ValueError, match="got -3"):
        EnergyConcentrationProfile(-3, [50]).measure(torch.ones(3, 4))
