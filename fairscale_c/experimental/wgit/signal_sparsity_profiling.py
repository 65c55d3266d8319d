"""Energy-concentration profiling of tensors; mirrors fairscale.experimental.wgit.signal_sparsity_profiling.

The "energy" of a tensor here is the sum of the absolute values of its entries. For a list of
top-k percentages, :class:`EnergyConcentrationProfile` measures which fraction of that energy
the largest k percent of the entries along one dim hold, in the tensor's own domain
(:meth:`~EnergyConcentrationProfile.measure`) or in the FFT domain
(:meth:`~EnergyConcentrationProfile.measure_fft`). A tensor whose energy sits in few entries is
a good candidate for top-k sparsification.
"""

from typing import List

import torch
from torch import Tensor

__all__ = ["EnergyConcentrationProfile"]


class EnergyConcentrationProfile:
    """Measures how concentrated a tensor's energy is along one dim.

    Args:
        dim (int): the dim the top-k runs along.
        top_k_percents (List[float]): strictly increasing percentages in (0, 100]. For each p,
            the measures return the fraction of the energy held by the top p percent of the
            entries along ``dim`` (p is the share of entries kept, not the sparsity).

    Raises:
        TypeError: ``dim`` is not an int, or a percentage is not a number.
        ValueError: a percentage is outside (0, 100] or not larger than the one before it.
    """

    def __init__(self, dim: int, top_k_percents: List[float]) -> None:
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"dim must be an int, got {type(dim).__name__}")
        self.dim = dim
        self.percents: List[float] = []
        previous = 0.0
        for p in top_k_percents:
            if isinstance(p, bool) or not isinstance(p, (int, float)):
                raise TypeError(f"top_k_percents must hold numbers, got {type(p).__name__} {p!r}")
            if not (0 < p <= 100):
                raise ValueError(f"top_k_percents values must be in (0, 100], got {p}")
            if not (p > previous):
                raise ValueError(f"top_k_percents must be strictly increasing, got {p} after {previous}")
            self.percents.append(float(p))
            previous = p

    def _check_dim(self, in_tensor: Tensor) -> None:
        """Raises ValueError unless ``self.dim`` is a dim of ``in_tensor``."""
        ndim = in_tensor.dim()
        if not (-ndim <= self.dim < ndim):
            raise ValueError(
                f"dim must be in [{-ndim}, {ndim}) for in_tensor of shape {tuple(in_tensor.shape)}, got {self.dim}"
            )

    def measure(self, in_tensor: Tensor) -> List[Tensor]:
        """The energy fractions, one per percentage.

        The work is queued as tensor ops only (no host synchronisation), so on a GPU it runs
        asynchronously.

        Args:
            in_tensor (Tensor): a floating-point tensor.

        Returns:
            (List[Tensor]): one 0-dim tensor per percentage p: the sum of the absolute values
            of the top ``max(1, round(p / 100 * size))`` entries along ``dim`` (``size`` being
            the length of that dim), over the sum of all absolute values.
        """
        if not in_tensor.is_floating_point():
            raise TypeError(f"in_tensor must be a floating-point tensor, got dtype {in_tensor.dtype}")
        self._check_dim(in_tensor)
        size = in_tensor.shape[self.dim]
        magnitude = in_tensor.abs()
        total = magnitude.sum()
        fractions = []
        for p in self.percents:
            k = max(1, round(p / 100 * size))
            top, _ = magnitude.topk(k, dim=self.dim)
            fractions.append(top.sum() / total)
        return fractions

    def measure_fft(self, in_tensor: Tensor) -> List[Tensor]:
        """:meth:`measure` of the real part of ``torch.fft.fft(in_tensor, dim=dim)``."""
        self._check_dim(in_tensor)
        return self.measure(torch.fft.fft(in_tensor, dim=self.dim).real)
