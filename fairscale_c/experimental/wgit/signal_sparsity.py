"""Signal-processing sparsification of tensors (SST / DST); mirrors fairscale.experimental.wgit.signal_sparsity.

A dense tensor is split into two sparse parts:

* the signal sparse tensor (SST): the tensor transformed to the frequency domain (FFT or DCT)
  with only its top-k components kept, and
* the delta sparse tensor (DST): the top-k entries of what the inverse transform of the SST
  misses of the dense tensor.

``inverse_transform(SST) + DST`` is the lossy reconstruction. With ``Algo.FFT`` the SST is
complex and the top-k ranks components by the magnitude of their real part; with ``Algo.DCT``
(orthonormal DCT-II, inverted by the orthonormal DCT-III) the SST is real and the top-k ranks
components by absolute value.
"""

import math
from enum import Enum
from typing import Callable, Optional, Tuple

import torch
from torch import Tensor

__all__ = ["Algo", "SignalSparsity", "random_sparse_mask"]


# ---------------------------------------------------------------------------------------------
# top-k helpers
# ---------------------------------------------------------------------------------------------


def _get_k_for_topk(topk_percent: Optional[float], top_k_element: Optional[int], top_k_total_size: int) -> int:
    """Returns k for a top-k over ``top_k_total_size`` elements.

    ``top_k_element`` is k itself when given (it may not exceed the total size); otherwise k is
    ``topk_percent`` percent of the total size, rounded. k is at least 1, so a top-k never
    produces an all-zero tensor.
    """
    if top_k_element is None:
        if topk_percent is None:
            raise ValueError("one of topk_percent and top_k_element must be given, got neither")
        k = round(top_k_total_size * topk_percent / 100.0)
    else:
        if top_k_element > top_k_total_size:
            raise ValueError(
                f"top_k_element must be at most {top_k_total_size} (the number of elements along the "
                f"top-k dim), got {top_k_element}"
            )
        k = top_k_element
    return max(1, k)


def _scatter_topk_to_sparse_tensor(
    top_k_tensor: Tensor, to_be_sparsify_tensor: Tensor, k: int, dim: Optional[int]
) -> Tensor:
    """Keeps k entries of ``to_be_sparsify_tensor`` along ``dim`` and zeroes the rest.

    The kept positions are those of the k largest values of ``top_k_tensor`` along ``dim``
    (``None``: over the flattened tensor), so the ranking may use a tensor derived from the
    values kept (their absolute values, say). Both tensors must have the same shape; the result
    has that shape and the dtype of ``to_be_sparsify_tensor``.
    """
    if top_k_tensor.shape != to_be_sparsify_tensor.shape:
        raise ValueError(
            "top_k_tensor and to_be_sparsify_tensor must have the same shape, got "
            f"{tuple(top_k_tensor.shape)} and {tuple(to_be_sparsify_tensor.shape)}"
        )
    out = torch.zeros_like(to_be_sparsify_tensor)
    shape = out.shape
    if dim is None and len(shape) > 1:
        # A top-k over every element: rank along the single dim of the flattened tensors.
        out = out.reshape(-1)
        to_be_sparsify_tensor = to_be_sparsify_tensor.reshape(-1)
        top_k_tensor = top_k_tensor.reshape(-1)
        dim = -1
    _, idx = top_k_tensor.topk(k, dim=dim)
    return out.scatter(dim, idx, to_be_sparsify_tensor.gather(dim, idx)).reshape(shape)


def _top_k_total_size(tensor: Tensor, topk_dim: Optional[int]) -> int:
    """Number of elements a top-k along ``topk_dim`` chooses from (``None``: all elements)."""
    total = tensor.numel() if topk_dim is None else tensor.shape[topk_dim]
    if total <= 0:
        raise ValueError(
            f"the tensor must have elements along the top-k dim {topk_dim}, got shape {tuple(tensor.shape)}"
        )
    return total


def _is_sparsity_zero(
    dense: Tensor, topk_percent: Optional[float], topk_element: Optional[int], top_k_dim: Optional[int]
) -> bool:
    """True when the top-k setting keeps every element along ``top_k_dim`` (0% sparsity).

    A disabled setting (both ``topk_percent`` and ``topk_element`` None) keeps nothing, so it
    is not zero sparsity.
    """
    if topk_percent is None and topk_element is None:
        return False
    total = _top_k_total_size(dense, top_k_dim)
    return _get_k_for_topk(topk_percent, topk_element, total) == total


# ---------------------------------------------------------------------------------------------
# transforms
# ---------------------------------------------------------------------------------------------


def _fft_transform(dense: Tensor, dim: Optional[int]) -> Tensor:
    """``torch.fft.fft`` of ``dense`` along ``dim`` (``None``: the flattened tensor, reshaped
    back). The full (two-sided) spectrum is kept so that large components of both positive and
    negative frequencies can be selected."""
    if dim is None:
        return torch.fft.fft(dense.reshape(-1), dim=-1).reshape(dense.shape)
    return torch.fft.fft(dense, dim=dim)


def _ifft_transform(sst: Tensor, dim: Optional[int]) -> Tensor:
    """``torch.fft.ifft`` of the complex ``sst`` along ``dim`` (``None``: the flattened tensor,
    reshaped back). The result is complex; its real part is the reconstruction."""
    if not sst.is_complex():
        raise TypeError(f"sst must be a complex tensor for the inverse FFT, got dtype {sst.dtype}")
    if dim is None:
        return torch.fft.ifft(sst.reshape(-1), dim=-1).reshape(sst.shape)
    return torch.fft.ifft(sst, dim=dim)


def _dct_dtype(dtype: torch.dtype) -> torch.dtype:
    """The real dtype a DCT of a ``dtype`` tensor is computed and returned in: float32 and
    float64 as they are, float16 / bfloat16 as float32, integers and bool as torch's default
    float dtype."""
    if dtype.is_complex:
        raise TypeError(f"the DCT needs a real tensor, got dtype {dtype}")
    if dtype in (torch.float32, torch.float64):
        return dtype
    if dtype.is_floating_point:
        return torch.float32
    return torch.get_default_dtype()


def _dct_factors(n: int, dtype: torch.dtype, device: torch.device) -> Tuple[Tensor, Tensor, Tensor]:
    """cos(theta_k), sin(theta_k) with theta_k = pi k / (2n), and the orthonormal scale s_k
    (sqrt(1/n) for k = 0, sqrt(2/n) otherwise), for k = 0..n-1; computed in float64."""
    k = torch.arange(n, dtype=torch.float64, device=device)
    theta = k * (math.pi / (2 * n))
    scale = torch.full((n,), math.sqrt(2.0 / n), dtype=torch.float64, device=device)
    scale[0] = math.sqrt(1.0 / n)
    return theta.cos().to(dtype), theta.sin().to(dtype), scale.to(dtype)


def _makhoul_order(n: int, device: torch.device) -> Tensor:
    """Indices putting the even-indexed samples first (ascending) and the odd-indexed ones after
    them (descending): with that reordering, an n-point DCT-II is an n-point FFT plus twiddles."""
    even = torch.arange(0, n, 2, device=device)
    odd = torch.arange(1, n, 2, device=device).flip(0)
    return torch.cat([even, odd])


def _dct_last_dim(x: Tensor) -> Tensor:
    """Orthonormal DCT-II along the last dim of the real tensor ``x``.

    X_k = s_k * sum_n x_n cos(pi (2n + 1) k / (2N)). With v the Makhoul reordering of x and
    V = fft(v), sum_n x_n cos(pi (2n + 1) k / (2N)) = Re(exp(-i theta_k) V_k).
    """
    n = x.shape[-1]
    order = _makhoul_order(n, x.device)
    spec = torch.fft.fft(x.index_select(-1, order), dim=-1)
    cos, sin, scale = _dct_factors(n, x.dtype, x.device)
    return (spec.real * cos + spec.imag * sin) * scale


def _idct_last_dim(y: Tensor) -> Tensor:
    """Orthonormal DCT-III along the last dim of the real tensor ``y``: the exact inverse of
    :func:`_dct_last_dim`.

    With C_k = y_k / s_k (and C_N = 0), the spectrum of the reordered signal is
    V_k = exp(i theta_k) (C_k - i C_{N-k}); its inverse FFT is real, and undoing the reordering
    gives the signal.
    """
    n = y.shape[-1]
    cos, sin, scale = _dct_factors(n, y.dtype, y.device)
    c = y / scale
    c_mirror = torch.cat([torch.zeros_like(c[..., :1]), c[..., 1:].flip(-1)], dim=-1)
    spec = torch.complex(c * cos + c_mirror * sin, c * sin - c_mirror * cos)
    v = torch.fft.ifft(spec, dim=-1).real
    inverse_order = torch.argsort(_makhoul_order(n, y.device))
    return v.index_select(-1, inverse_order)


def _along_dim(fn: Callable[[Tensor], Tensor], x: Tensor, dim: Optional[int]) -> Tensor:
    """Applies a last-dim transform ``fn`` along ``dim`` of ``x`` (``None``: the flattened
    tensor), returning a tensor of ``x``'s shape."""
    if dim is None:
        flat = x.reshape(-1)
        if flat.numel() == 0:
            raise ValueError("the DCT needs at least one element, got an empty tensor")
        return fn(flat).reshape(x.shape)
    moved = x.movedim(dim, -1)
    if moved.shape[-1] == 0:
        raise ValueError(f"the DCT needs at least one element along dim {dim}, got shape {tuple(x.shape)}")
    return fn(moved).movedim(-1, dim).contiguous()


def _dct_transform(dense: Tensor, dim: Optional[int]) -> Tensor:
    """Orthonormal DCT-II of the real tensor ``dense`` along ``dim`` (``None``: the flattened
    tensor, reshaped back), computed with one FFT per transformed line. The result is real, in
    the dtype given by :func:`_dct_dtype`."""
    return _along_dim(_dct_last_dim, dense.to(_dct_dtype(dense.dtype)), dim)


def _idct_transform(sst: Tensor, dim: Optional[int]) -> Tensor:
    """Orthonormal DCT-III (the inverse of :func:`_dct_transform`) of the real tensor ``sst``
    along ``dim`` (``None``: the flattened tensor, reshaped back). The result is real."""
    return _along_dim(_idct_last_dim, sst.to(_dct_dtype(sst.dtype)), dim)


# ---------------------------------------------------------------------------------------------
# SignalSparsity
# ---------------------------------------------------------------------------------------------


class Algo(Enum):
    """The transform taking a tensor to the frequency domain."""

    FFT = 0
    DCT = 1


_TRANSFORMS = {
    Algo.FFT: (_fft_transform, _ifft_transform),
    Algo.DCT: (_dct_transform, _idct_transform),
}


class SignalSparsity:
    """A sparsification setting: the transform, and the top-k of the SST and of the DST.

    The methods take and return tensors only; state-dict handling is left to the caller. The
    SST is enabled when one of ``sst_top_k_element`` / ``sst_top_k_percent`` is given, the DST
    when one of ``dst_top_k_element`` / ``dst_top_k_percent`` is; a disabled one is ``None``,
    which stands for an all-zero tensor.

    Args:
        algo (Algo): the transform, ``Algo.FFT`` (default) or ``Algo.DCT``.
        sst_top_k_dim (int, optional): the dim the SST's top-k runs along; ``None`` ranks all
            elements of the flattened tensor. Also the dim the transform runs along. Default: -1.
        sst_top_k_element (int, optional): how many frequency components the SST keeps.
        sst_top_k_percent (float, optional): the percentage, in (0, 100], of them it keeps.
        dst_top_k_dim (int, optional): the dim the DST's top-k runs along; ``None`` as above.
            Default: -1.
        dst_top_k_element (int, optional): how many delta entries the DST keeps.
        dst_top_k_percent (float, optional): the percentage, in (0, 100], of them it keeps.

    Raises:
        ValueError: both the element count and the percentage are set for the SST or the DST, a
            percentage is outside (0, 100], an element count is not positive, or ``algo`` is
            not an :class:`Algo`.

    Example::

        sparser = SignalSparsity(sst_top_k_element=10, dst_top_k_element=1)
        sst = sparser.dense_to_sst(linear.weight.data)

        sparser_3d = SignalSparsity(sst_top_k_dim=None, dst_top_k_dim=-1, sst_top_k_percent=10, dst_top_k_element=100)
        conv.weight.data, _, _ = sparser_3d.lossy_compress(conv.weight.data)
    """

    def __init__(
        self,
        algo: Algo = Algo.FFT,
        sst_top_k_dim: Optional[int] = -1,
        sst_top_k_element: Optional[int] = None,
        sst_top_k_percent: Optional[float] = None,
        dst_top_k_dim: Optional[int] = -1,
        dst_top_k_element: Optional[int] = None,
        dst_top_k_percent: Optional[float] = None,
    ) -> None:
        self._sst_top_k_dim = sst_top_k_dim
        self._sst_top_k_element = sst_top_k_element
        self._sst_top_k_percent = sst_top_k_percent
        self._dst_top_k_dim = dst_top_k_dim
        self._dst_top_k_element = dst_top_k_element
        self._dst_top_k_percent = dst_top_k_percent

        self._validate_conf()
        if not isinstance(algo, Algo):
            raise ValueError(f"algo must be Algo.FFT or Algo.DCT, got {algo!r}")
        self._algo = algo
        self._transform, self._inverse_transform = _TRANSFORMS[algo]

    @property
    def _sst_enabled(self) -> bool:
        """True if the SST is computed (otherwise it is None)."""
        return self._sst_top_k_element is not None or self._sst_top_k_percent is not None

    @property
    def _dst_enabled(self) -> bool:
        """True if the DST is computed (otherwise it is None)."""
        return self._dst_top_k_element is not None or self._dst_top_k_percent is not None

    def _validate_conf(self) -> None:
        """Checks the top-k arguments: at most one of element / percent per tensor, percentages
        in (0, 100], element counts above 0. Raises ValueError naming the offending argument."""
        for name in ("sst", "dst"):
            element = getattr(self, f"_{name}_top_k_element")
            percent = getattr(self, f"_{name}_top_k_percent")
            if element is not None and percent is not None:
                raise ValueError(
                    f"{name}_top_k_element and {name}_top_k_percent can't both be set, got "
                    f"{name}_top_k_element={element} and {name}_top_k_percent={percent}"
                )
        for name in ("sst", "dst"):
            percent = getattr(self, f"_{name}_top_k_percent")
            if percent is not None and not (0.0 < percent <= 100.0):
                raise ValueError(f"{name}_top_k_percent must be in (0, 100], got {percent}")
        for name in ("sst", "dst"):
            element = getattr(self, f"_{name}_top_k_element")
            if element is not None and not (element > 0):
                raise ValueError(f"{name}_top_k_element must be greater than 0, got {element}")

    def _top_k(self, dense: Tensor, name: str) -> Tuple[int, int]:
        """(k, total size along the top-k dim) of the SST (``name`` "sst") or DST ("dst") top-k
        on ``dense``; an element count larger than the total raises ValueError naming it."""
        dim = getattr(self, f"_{name}_top_k_dim")
        element = getattr(self, f"_{name}_top_k_element")
        total = _top_k_total_size(dense, dim)
        if element is not None and element > total:
            raise ValueError(
                f"{name}_top_k_element must be at most {total}, the number of elements along "
                f"{name}_top_k_dim={dim} of a tensor of shape {tuple(dense.shape)}, got {element}"
            )
        return _get_k_for_topk(getattr(self, f"_{name}_top_k_percent"), element, total), total

    def dense_to_sst(self, dense: Tensor) -> Optional[Tensor]:
        """The SST of ``dense``: its transform along ``sst_top_k_dim`` with only the top-k
        components along that dim kept (ranked by the absolute value of their real part).

        Returns:
            A tensor of ``dense``'s shape, in the frequency domain (complex for FFT, real for
            DCT) and mostly zeros; None when the SST is disabled.
        """
        if not self._sst_enabled:
            return None
        k, _ = self._top_k(dense, "sst")
        freq = self._transform(dense, dim=self._sst_top_k_dim)
        return _scatter_topk_to_sparse_tensor(freq.real.abs(), freq, k, dim=self._sst_top_k_dim)

    def _zero_sst(self, dense: Tensor) -> Tensor:
        """The all-zero SST standing in for a None one: complex64 for FFT, real for DCT."""
        if self._algo is Algo.FFT:
            return torch.zeros_like(dense, dtype=torch.complex64)
        return torch.zeros_like(dense, dtype=_dct_dtype(dense.dtype))

    def dense_sst_to_dst(self, dense: Tensor, sst: Optional[Tensor]) -> Optional[Tensor]:
        """The DST: the top-k entries along ``dst_top_k_dim`` (by absolute value) of
        ``dense - inverse_transform(sst)``, the rest zero.

        Args:
            dense (Tensor): the dense tensor.
            sst (Tensor, optional): its SST; None stands for an all-zero SST.

        Returns:
            A tensor of ``dense``'s shape, mostly zeros; None when the DST is disabled.
        """
        if not self._dst_enabled:
            return None
        if sst is None:
            sst = self._zero_sst(dense)
        if dense.shape != sst.shape:
            raise ValueError(f"dense and sst must have the same shape, got {tuple(dense.shape)} and {tuple(sst.shape)}")
        k, _ = self._top_k(dense, "dst")
        delta = dense - self.sst_dst_to_dense(sst)
        return _scatter_topk_to_sparse_tensor(delta.abs(), delta, k, dim=self._dst_top_k_dim)

    def sst_dst_to_dense(self, sst: Optional[Tensor], dst: Optional[Tensor] = None) -> Tensor:
        """The reconstruction ``real(inverse_transform(sst)) + dst``.

        Args:
            sst (Tensor, optional): the SST; None stands for an all-zero one, and then ``dst``
                itself is returned.
            dst (Tensor, optional): the DST; None adds nothing.

        Returns:
            A real tensor of the SST's (or DST's) shape.
        """
        if sst is None and dst is None:
            raise ValueError("sst and dst can't both be None")
        if sst is None:
            assert dst is not None
            return dst
        dense_rt = torch.real(self._inverse_transform(sst, dim=self._sst_top_k_dim))
        if dst is not None:
            dense_rt += dst
        return dense_rt

    def lossy_compress(self, dense: Tensor) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
        """Computes the SST and the DST of ``dense`` and the reconstruction from them.

        When both top-k settings keep every element (0% sparsity), ``(dense, None, dense)`` is
        returned: ``dense`` itself as the reconstruction and as the DST, with no SST (so that
        ``inverse_transform(sst) + dst`` still gives ``dense``).

        Returns:
            ``(reconstruction, sst, dst)``; ``sst`` / ``dst`` are None when disabled.
        """
        if self._keeps_everything(dense, "sst") and self._keeps_everything(dense, "dst"):
            return dense, None, dense
        sst = self.dense_to_sst(dense)
        dst = self.dense_sst_to_dst(dense, sst)
        return self.sst_dst_to_dense(sst, dst), sst, dst

    def _keeps_everything(self, dense: Tensor, name: str) -> bool:
        """:func:`_is_sparsity_zero` for the SST ("sst") or DST ("dst") setting."""
        if not getattr(self, f"_{name}_enabled"):
            return False
        k, total = self._top_k(dense, name)
        return k == total


def random_sparse_mask(dense: Tensor, percent: float, dim: int) -> Tensor:
    """A random 0/1 mask of ``dense``'s shape and dtype with ``percent`` percent of ones
    (rounded, at least one) in every slice along ``dim``.

    Args:
        dense (Tensor): the tensor the mask is for (floating point).
        percent (float): percentage of ones, in (0, 100].
        dim (int): the dim along which the ones are counted.
    """
    if not (0 < percent <= 100):
        raise ValueError(f"percent must be in (0, 100], got {percent}")
    rand = torch.rand_like(dense)
    ones = torch.ones_like(dense)
    k = _get_k_for_topk(percent, None, dense.shape[dim])
    return _scatter_topk_to_sparse_tensor(rand, ones, k, dim)
