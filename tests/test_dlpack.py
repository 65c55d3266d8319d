"""The DLPack bridge: torch/numpy -> C -> torch/numpy, every dtype, views, capsules, bad input."""

import ctypes
import gc
import subprocess
import sys

import numpy as np
import pytest
import torch

from dlpack_ctypes import (
    DLDataType,
    DLDevice,
    DLManagedTensor,
    DLManagedTensorVersioned,
    DLPackVersion,
    DLTensor,
    LegacyDeleter,
    PyCapsule_New,
    VersionedDeleter,
)
from fairscale_c import _C

TORCH_DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]
NUMPY_DTYPES = [np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8, np.bool_]


def sample(dtype, shape=(5, 7)):
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=g) * 100).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_torch_round_trip_every_dtype(dtype):
    t = sample(dtype)
    out = torch.from_dlpack(_C.clone(t))
    assert out.dtype == dtype and out.shape == t.shape
    assert torch.equal(out, t)
    assert out.data_ptr() != t.data_ptr()


@pytest.mark.parametrize("dtype", NUMPY_DTYPES, ids=lambda d: np.dtype(d).name)
def test_numpy_round_trip_every_dtype(dtype):
    a = np.arange(-17, 18).astype(dtype).reshape(5, 7)
    out = np.from_dlpack(_C.clone(a))
    assert out.dtype == a.dtype and out.shape == a.shape
    np.testing.assert_array_equal(out, a)


def test_describe_reports_the_view_c_sees():
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    view = base[1:, 2::3]
    d = _C.describe(view)
    assert d["shape"] == (5, 3) and d["strides"] == (10, 3)
    assert d["data_ptr"] == view.data_ptr()  # byte_offset honoured
    assert d["contiguous"] is False and d["dtype"] == "float32" and d["device"] == "cpu"


@pytest.mark.parametrize(
    "make",
    [
        lambda b: b[1:, 2::3],
        lambda b: b.t(),
        lambda b: b[:, 3],
        lambda b: b[2:4].unsqueeze(1).expand(2, 4, 10),  # stride 0
        lambda b: b.reshape(3, 2, 10).permute(2, 0, 1)[1:, :, 1:],
    ],
    ids=["slice", "transpose", "column", "expand", "permute"],
)
def test_strided_and_offset_views_copy_correctly(make):
    base = torch.arange(60, dtype=torch.float64).reshape(6, 10)
    view = make(base)
    out = torch.from_dlpack(_C.clone(view))
    assert out.is_contiguous()
    assert torch.equal(out, view.contiguous())


def test_numpy_negative_strides():
    a = np.arange(24, dtype=np.int32).reshape(4, 6)[::-1, ::-2]
    np.testing.assert_array_equal(np.from_dlpack(_C.clone(a)), a)


@pytest.mark.parametrize("shape", [(0,), (0, 3), (4, 0, 2)])
def test_zero_size(shape):
    t = torch.empty(shape)
    out = torch.from_dlpack(_C.clone(t))
    assert out.shape == t.shape and out.numel() == 0
    assert _C.describe(t)["numel"] == 0


def test_scalar_zero_dim():
    t = torch.tensor(3.5)
    assert torch.from_dlpack(_C.clone(t)).item() == 3.5


def test_versioned_and_legacy_capsules_from_torch():
    t = torch.arange(6, dtype=torch.int32)
    legacy = t.__dlpack__()
    versioned = t.__dlpack__(max_version=(1, 0))
    assert "dltensor" in repr(legacy) and "dltensor_versioned" in repr(versioned)
    assert _C.describe(legacy)["data_ptr"] == t.data_ptr()
    assert _C.describe(versioned)["data_ptr"] == t.data_ptr()
    # Consumed capsules are renamed and refused the second time.
    assert "used_dltensor" in repr(legacy) and "used_dltensor_versioned" in repr(versioned)
    with pytest.raises(BufferError, match="already consumed"):
        _C.describe(legacy)
    with pytest.raises(BufferError, match="already consumed"):
        _C.describe(versioned)


# --- capsules built by hand, to test both layouts and the deleter contract -------------------


class HandMade:
    """Keeps a hand-built managed tensor (and the array it points into) alive; counts deleter calls."""

    def __init__(self, array, versioned, major=1, readonly=False, byte_offset=0, strides=None):
        self.array = array
        self.deleted = 0
        self.shape = (ctypes.c_int64 * array.ndim)(*array.shape)
        self.strides = None if strides is None else (ctypes.c_int64 * array.ndim)(*strides)
        t = DLTensor(
            data=array.ctypes.data,
            device=DLDevice(1, 0),
            ndim=array.ndim,
            dtype=DLDataType(2, 32, 1),
            shape=self.shape,
            strides=self.strides,
            byte_offset=byte_offset,
        )
        if versioned:
            self.deleter = VersionedDeleter(self._on_delete)
            self.managed = DLManagedTensorVersioned(
                version=DLPackVersion(major, 0),
                manager_ctx=None,
                deleter=self.deleter,
                flags=1 if readonly else 0,
                dl_tensor=t,
            )
            self.name = b"dltensor_versioned"
        else:
            self.deleter = LegacyDeleter(self._on_delete)
            self.managed = DLManagedTensor(dl_tensor=t, manager_ctx=None, deleter=self.deleter)
            self.name = b"dltensor"

    def _on_delete(self, _ptr):
        self.deleted += 1

    def capsule(self):
        return PyCapsule_New(ctypes.addressof(self.managed), self.name, None)


@pytest.mark.parametrize("versioned", [False, True], ids=["legacy", "versioned"])
def test_hand_built_capsule_consumed_and_deleted_once(versioned):
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    h = HandMade(a, versioned)
    cap = h.capsule()
    out = np.from_dlpack(_C.clone(cap))
    np.testing.assert_array_equal(out, a)
    gc.collect()
    assert h.deleted == 1
    with pytest.raises(BufferError, match="already consumed"):
        _C.clone(cap)
    assert h.deleted == 1


def test_hand_built_capsule_byte_offset_and_null_strides():
    a = np.arange(12, dtype=np.float32)
    # View rows 1..2 of a 3x4 matrix through byte_offset with NULL strides (compact row-major).
    h = HandMade(a[:8].reshape(2, 4), versioned=False, byte_offset=16)
    out = np.from_dlpack(_C.clone(h.capsule()))
    np.testing.assert_array_equal(out, a[4:12].reshape(2, 4))


def test_major_version_above_one_is_refused_and_left_to_producer():
    a = np.ones(4, dtype=np.float32)
    h = HandMade(a, versioned=True, major=2)
    cap = h.capsule()
    with pytest.raises(BufferError, match=r"argument 'src'.*version 2\.0.*major version <= 1"):
        _C.clone(cap)
    assert "used" not in repr(cap)  # not consumed: the producer still owns it
    assert h.deleted == 0


def test_read_only_flag_is_honoured():
    a = np.arange(4, dtype=np.float32)
    h = HandMade(a, versioned=True, readonly=True)
    assert _C.describe(h.capsule())["readonly"] is True
    with pytest.raises(ValueError, match="argument 'obj'.*read-only"):
        _C.describe(HandMade(a, versioned=True, readonly=True).capsule(), writable=True)
    frozen = np.arange(4, dtype=np.float32)
    frozen.flags.writeable = False
    with pytest.raises((ValueError, BufferError), match="argument 'dst'"):
        _C.copy_(frozen, np.zeros(4, dtype=np.float32))
    np.testing.assert_array_equal(frozen, np.arange(4, dtype=np.float32))


# --- bad input -------------------------------------------------------------------------------


def test_object_without_dlpack():
    with pytest.raises(TypeError, match=r"argument 'src'.*DLPack protocol.*got 'list'"):
        _C.clone([1, 2, 3])


def test_tensor_that_requires_grad():
    t = torch.ones(3, requires_grad=True)
    with pytest.raises(ValueError, match=r"argument 'src'.*requires grad.*detach"):
        _C.clone(t)


def test_non_contiguous_where_required():
    t = torch.ones(4, 4).t()
    with pytest.raises(ValueError, match=r"argument 'obj'.*contiguous"):
        _C.describe(t, contiguous=True)
    assert _C.describe(t.contiguous(), contiguous=True)["contiguous"] is True


def test_unsupported_dtype():
    with pytest.raises(TypeError, match=r"argument 'src'.*unsupported dtype.*expected one of"):
        _C.clone(torch.ones(3, dtype=torch.complex64))


def test_unsupported_device():
    h = HandMade(np.ones(2, dtype=np.float32), versioned=False)
    h.managed.dl_tensor.device = DLDevice(10, 0)  # ROCm
    with pytest.raises(ValueError, match=r"argument 'src'.*unsupported device.*CPU or CUDA"):
        _C.clone(h.capsule())


def test_capsule_with_wrong_name():
    a = np.ones(2, dtype=np.float32)
    cap = PyCapsule_New(a.ctypes.data, b"not_a_tensor", None)
    with pytest.raises(BufferError, match=r"argument 'src'.*'not_a_tensor'.*expected 'dltensor'"):
        _C.clone(cap)


def test_producer_export_failure_becomes_buffer_error():
    class Bad:
        def __dlpack__(self, **kw):
            raise BufferError("cannot export")

        def __dlpack_device__(self):
            return (1, 0)

    with pytest.raises(BufferError, match=r"argument 'src'.*cannot export"):
        _C.clone(Bad())


def test_copy_shape_and_dtype_errors():
    with pytest.raises(ValueError, match="different shapes"):
        _C.copy_(torch.zeros(3), torch.zeros(4))
    with pytest.raises(TypeError, match="cannot convert int32 to float32"):
        _C.copy_(torch.zeros(3), torch.zeros(3, dtype=torch.int32))


# --- the C copy/cast against torch ----------------------------------------------------------


SPECIALS = [0.0, -0.0, 1.0, -2.5, 65504.0, 65520.0, 1e-8, 6e-8, 3e-5, 1e38, 3.4e38, float("inf"), float("-inf")]


@pytest.mark.parametrize("dst_dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_cast_matches_torch_bitwise(dst_dtype):
    src = torch.cat([torch.randn(10007, generator=torch.Generator().manual_seed(1)) * 1000, torch.tensor(SPECIALS)])
    dst = torch.empty_like(src, dtype=dst_dtype)
    _C.copy_(dst, src)
    assert torch.equal(dst, src.to(dst_dtype))
    back = torch.empty_like(src)
    _C.copy_(back, dst)
    assert torch.equal(back, dst.to(torch.float32))


def test_cast_nan_stays_nan():
    src = torch.tensor([float("nan"), 1.0])
    for dt in (torch.float16, torch.bfloat16):
        dst = torch.empty(2, dtype=dt)
        _C.copy_(dst, src)
        assert torch.isnan(dst[0]) and dst[1] == 1


def test_copy_into_strided_destination():
    dst = torch.zeros(4, 6)
    src = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    _C.copy_(dst[:, ::2], src)
    assert torch.equal(dst[:, ::2], src) and dst[:, 1::2].abs().sum() == 0


# --- exports of C-owned memory --------------------------------------------------------------


def test_buffer_is_shared_zero_copy_with_torch_and_numpy():
    buf = _C.Buffer((2, 3), "float32")
    assert buf.shape == (2, 3) and buf.dtype == "float32" and buf.nbytes == 24
    t = torch.from_dlpack(buf)
    a = np.from_dlpack(buf)
    t += 5
    np.testing.assert_array_equal(a, np.full((2, 3), 5, dtype=np.float32))
    assert t.data_ptr() == a.ctypes.data


def test_buffer_accepts_torch_dtype_and_exports_both_capsule_kinds():
    buf = _C.Buffer([4], torch.bfloat16)
    assert buf.dtype == "bfloat16"
    assert "dltensor_versioned" in repr(buf.__dlpack__(max_version=(1, 1)))
    assert '"dltensor"' in repr(buf.__dlpack__())
    copied = torch.from_dlpack(buf.__dlpack__(max_version=(1, 0), copy=True))
    assert copied.data_ptr() != torch.from_dlpack(buf).data_ptr()
    with pytest.raises(BufferError, match="stream"):
        buf.__dlpack__(stream=5)
    with pytest.raises(TypeError, match="argument 'dtype'"):
        _C.Buffer([4], "complex64")
    with pytest.raises(ValueError, match="argument 'shape'"):
        _C.Buffer([-1], "float32")


def test_unconsumed_export_capsule_is_freed():
    gc.collect()
    before = _C._live_host_buffers()
    buf = _C.Buffer((8,), "float32")
    for _ in range(10):
        buf.__dlpack__(max_version=(1, 0))
        buf.__dlpack__()
    del buf
    gc.collect()
    assert _C._live_host_buffers() == before


def test_no_leaks_over_many_round_trips():
    t = torch.randn(64, 32)
    a = np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32)
    gc.collect()
    live0, ref_t, ref_a = _C._live_host_buffers(), sys.getrefcount(t), sys.getrefcount(a)
    for _ in range(3000):
        torch.from_dlpack(_C.clone(t[:, ::2]))
        np.from_dlpack(_C.clone(a))
        _C.describe(t)
        _C.copy_(t, t)
    gc.collect()
    assert _C._live_host_buffers() == live0
    assert sys.getrefcount(t) == ref_t and sys.getrefcount(a) == ref_a


def test_export_outlives_interpreter_shutdown():
    # A torch tensor viewing C-owned memory is alive at exit; its deleter must not touch Python.
    code = (
        "import torch; from fairscale_c import _C\n"
        "KEEP = [torch.from_dlpack(_C.Buffer((1024,), 'float32')) for _ in range(8)]\n"
        "KEEP.append(_C.Buffer((4,), 'int64').__dlpack__(max_version=(1, 0)))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("first", ["parameter", "refused_parameter", "subclass"])
def test_exchange_api_serves_every_tensor_type_whichever_comes_first(first):
    # torch tensors are imported through DLPack's C exchange API, without calling __dlpack__. The
    # first tensor the process imports may be a subclass (nn.Parameter, even one refused for
    # requiring grad, or a user's subclass): plain tensors and other subclasses must still take
    # that path, here made observable by a __dlpack__ that raises.
    code = (
        "import torch; from fairscale_c import _C\n"
        "class Mine(torch.Tensor): pass\n"
        f"first = {first!r}\n"
        "if first == 'parameter': _C.describe(torch.nn.Parameter(torch.zeros(2), requires_grad=False))\n"
        "if first == 'subclass': _C.describe(torch.zeros(2).as_subclass(Mine))\n"
        "if first == 'refused_parameter':\n"
        "    try: _C.describe(torch.nn.Parameter(torch.zeros(2)))\n"
        "    except ValueError: pass\n"
        "    else: raise SystemExit('a parameter that requires grad was imported')\n"
        "def no_python_export(self, *a, **k): raise AssertionError('__dlpack__ called')\n"
        "torch.Tensor.__dlpack__ = no_python_export\n"
        "for t in (torch.arange(3.0), torch.nn.Parameter(torch.ones(2), requires_grad=False),\n"
        "          torch.ones(2).as_subclass(Mine)):\n"
        "    assert _C.describe(t)['shape'] == tuple(t.shape)\n"
        "dst = torch.zeros(3); _C.copy_(dst, torch.arange(3.0)); assert dst.tolist() == [0.0, 1.0, 2.0]\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_pack_blocks_interleaves_rank_blocks():
    a, b = torch.arange(6.0), torch.arange(10.0, 14.0)
    out = torch.empty(10)
    _C.pack_blocks(out, [a, b], 2)
    assert out.tolist() == [0, 1, 2, 10, 11, 3, 4, 5, 12, 13]
    _C.pack_blocks(torch.empty(0), [torch.empty(0)] * 3, 2**31 - 1)  # nothing to move: returns at once
    with pytest.raises(ValueError, match="'dst' has 9 elements"):
        _C.pack_blocks(torch.empty(9), [a, b], 2)
    with pytest.raises(ValueError, match=r"srcs\[1\] has 3 elements, not a multiple of world=2"):
        _C.pack_blocks(torch.empty(9), [a, torch.arange(3.0)], 2)
    with pytest.raises(ValueError, match=r"srcs\[0\] is float64"):
        _C.pack_blocks(out, [a.double(), b], 2)
    with pytest.raises(ValueError, match="argument 'dst'.*contiguous"):
        _C.pack_blocks(torch.empty(20)[::2], [a, b], 2)
    # with a stream the tensors must be CUDA tensors (the GPU twin: tests/test_cuda.py)
    with pytest.raises(ValueError, match="argument 'dst' must be a writable contiguous CUDA tensor"):
        _C.pack_blocks(out, [a, b], 2, stream=0)
    with pytest.raises(TypeError, match="argument 'stream' must be None or a non-negative int"):
        _C.pack_blocks(out, [a, b], 2, stream=-1)


# --- malformed capsules: every case a Python exception naming the argument, never a crash ----


class Raw:
    """A hand-built capsule with every field under the test's control; `data` is an address (the
    memory is never touched when the import is refused, as it must be)."""

    def __init__(
        self,
        shape=(4,),
        strides=None,
        data=None,
        ndim=None,
        null_shape=False,
        byte_offset=0,
        dtype=(2, 32, 1),
        device=1,
        versioned=True,
        readonly=False,
    ):
        self.array = np.arange(16, dtype=np.float32)
        ndim = len(shape) if ndim is None else ndim
        self.shape = None if null_shape else (ctypes.c_int64 * max(1, len(shape)))(*shape)
        self.strides = None if strides is None else (ctypes.c_int64 * max(1, len(strides)))(*strides)
        t = DLTensor(
            data=self.array.ctypes.data if data is None else data,
            device=DLDevice(device, 0),
            ndim=ndim,
            dtype=DLDataType(*dtype),
            shape=self.shape,
            strides=self.strides,
            byte_offset=byte_offset,
        )
        self.deleter = (VersionedDeleter if versioned else LegacyDeleter)(lambda _p: None)
        if versioned:
            self.managed = DLManagedTensorVersioned(
                version=DLPackVersion(1, 0), deleter=self.deleter, flags=1 if readonly else 0, dl_tensor=t
            )
            self.name = b"dltensor_versioned"
        else:
            self.managed = DLManagedTensor(dl_tensor=t, deleter=self.deleter)
            self.name = b"dltensor"

    def capsule(self):
        self.cap = PyCapsule_New(ctypes.addressof(self.managed), self.name, None)
        return self


class Used(Raw):
    def capsule(self):
        super().capsule()
        _C.describe(self.cap)
        return self


def _group_of_one():
    g = _C.ShmGroup("dlpack-test", 0, 1)
    g.join()
    return g


def _all_reduce_into(cap):
    g = _group_of_one()
    try:
        g.all_reduce(cap)
    finally:
        g.close()


def _all_gather_into(cap):
    g = _group_of_one()
    try:
        g.all_gather(cap, torch.zeros(4))
    finally:
        g.close()


# fmt: off
MALFORMED = [
    # (id, capsule factory, call, exception, message)
    ("ndim>0 with NULL shape", lambda: Raw(shape=(2, 2), null_shape=True).capsule(), _C.clone, BufferError,
     "NULL shape"),
    ("legacy, NULL shape", lambda: Raw(null_shape=True, versioned=False).capsule(), _C.clone, BufferError,
     "NULL shape"),
    ("negative ndim", lambda: Raw(ndim=-1).capsule(), _C.clone, BufferError, "ndim -1"),
    ("ndim above 16", lambda: Raw(shape=(1,) * 17).capsule(), _C.clone, BufferError, "ndim 17"),
    ("negative extent", lambda: Raw(shape=(-3,)).capsule(), _C.clone, BufferError, "negative extent"),
    ("element count overflows int64", lambda: Raw(shape=(2**40, 2**40), strides=(0, 0)).capsule(), _C.clone,
     BufferError, "element count"),
    # 2^61 + 1 float64 elements through stride 0: numel fits int64, numel * 8 bytes does not
    ("stride 0, bytes overflow", lambda: Raw(shape=(2**61 + 1,), strides=(0,), dtype=(2, 64, 1)).capsule(), _C.clone,
     BufferError, "do not fit"),
    ("bytes above PTRDIFF_MAX", lambda: Raw(shape=(2**62,), dtype=(2, 32, 1)).capsule(), _C.describe, BufferError,
     "do not fit"),
    ("strides reach beyond the address space", lambda: Raw(shape=(2, 2), strides=(2**62, 1)).capsule(), _C.clone,
     BufferError, "extent"),
    ("stride INT64_MIN", lambda: Raw(shape=(2,), strides=(-(2**63),)).capsule(), _C.clone, BufferError, "extent"),
    ("end wraps around the address space", lambda: Raw(shape=(8,), data=2**64 - 16).capsule(), _C.clone,
     BufferError, "extent"),
    ("negative stride below address 0", lambda: Raw(shape=(8,), strides=(-1,), data=16).capsule(), _C.clone,
     BufferError, "extent"),
    ("byte_offset wraps the pointer", lambda: Raw(byte_offset=2**64 - 8).capsule(), _C.clone, BufferError,
     "byte_offset"),
    ("byte_offset above PTRDIFF_MAX", lambda: Raw(byte_offset=2**63).capsule(), _C.describe, BufferError,
     "byte_offset"),
    ("NULL data with elements", lambda: Raw(data=0).capsule(), _C.clone, BufferError, "NULL data"),
    ("lanes != 1", lambda: Raw(dtype=(2, 32, 4)).capsule(), _C.clone, TypeError, "4 lanes"),
    ("float of 8 bits", lambda: Raw(dtype=(2, 8, 1)).capsule(), _C.clone, TypeError, "unsupported dtype"),
    ("unknown dtype code", lambda: Raw(dtype=(99, 32, 1)).capsule(), _C.clone, TypeError, "unsupported dtype"),
    ("unknown device (ROCm)", lambda: Raw(device=10).capsule(), _C.clone, ValueError, "unsupported device"),
    ("unknown device type 999", lambda: Raw(device=999).capsule(), _C.clone, ValueError, "unsupported device"),
    ("CUDA tensor where CPU is required", lambda: Raw(device=2).capsule(), _C.clone, ValueError, "CPU tensor"),
    ("already consumed (versioned)", lambda: Used().capsule(), _C.clone, BufferError, "already consumed"),
    ("already consumed (legacy)", lambda: Used(versioned=False).capsule(), _C.clone, BufferError, "already consumed"),
    ("read-only as copy_ dst", lambda: Raw(readonly=True).capsule(), lambda c: _C.copy_(c, torch.zeros(4)),
     ValueError, "argument 'dst'.*read-only"),
    ("read-only as pack_blocks dst", lambda: Raw(readonly=True).capsule(),
     lambda c: _C.pack_blocks(c, [torch.zeros(4)], 1), ValueError, "argument 'dst'.*read-only"),
    ("read-only as all_reduce tensor", lambda: Raw(readonly=True).capsule(), _all_reduce_into, ValueError,
     "argument 'tensor'.*read-only"),
    ("read-only as all_gather output", lambda: Raw(readonly=True).capsule(), _all_gather_into, ValueError,
     "argument 'output'.*read-only"),
]
# fmt: on


@pytest.mark.parametrize("make, call, exc, match", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_capsule_is_a_python_exception(make, call, exc, match):
    raw = make()  # keeps the managed tensor alive while the capsule is in use
    with pytest.raises(exc, match=match) as info:
        call(raw.cap)
    assert "argument '" in str(info.value), str(info.value)


@pytest.mark.parametrize("versioned", [False, True], ids=["legacy", "versioned"])
def test_well_formed_edge_capsules_still_import(versioned):
    # NULL strides mean compact row-major; byte_offset moves the start; stride 0 repeats.
    r = Raw(shape=(2, 3), byte_offset=8, versioned=versioned)
    np.testing.assert_array_equal(np.from_dlpack(_C.clone(r.capsule().cap)), r.array[2:8].reshape(2, 3))
    r = Raw(shape=(3, 2), strides=(0, 1), versioned=versioned)
    np.testing.assert_array_equal(np.from_dlpack(_C.clone(r.capsule().cap)), np.tile(r.array[:2], (3, 1)))
    r = Raw(shape=(4,), strides=(-2,), data=np.arange(16, dtype=np.float32).ctypes.data, versioned=versioned)
    r.array = np.arange(16, dtype=np.float32)
    r.managed.dl_tensor.data = r.array.ctypes.data + 6 * 4
    np.testing.assert_array_equal(np.from_dlpack(_C.clone(r.capsule().cap)), r.array[6::-2][:4])
    r = Raw(shape=(0, 2**62), versioned=versioned)  # no elements: any shape that fits int64 is empty
    assert _C.describe(r.capsule().cap)["numel"] == 0


def test_pack_blocks_refuses_counts_that_overflow():
    # Four sources of 2^62 bytes sum to 2^64 elements, which wraps to 0 in int64: an empty dst
    # must not "match" them (the copy would write 2^64 bytes into it).
    srcs = [Raw(shape=(2**62,), dtype=(1, 8, 1)).capsule() for _ in range(4)]
    dst = Raw(shape=(0,), dtype=(1, 8, 1)).capsule()
    with pytest.raises(ValueError, match="overflows int64"):
        _C.pack_blocks(dst.cap, [s.cap for s in srcs], 1)


def test_an_output_with_repeated_elements_is_refused():
    # torch refuses to write into an expanded tensor ("more than one element of the written-to
    # tensor refers to a single memory location"); so does every C entry point that writes
    dst = torch.zeros(1).expand(4)
    with pytest.raises(ValueError, match="argument 'dst': more than one element refers to the same memory"):
        _C.copy_(dst, torch.arange(4.0))
    _C.copy_(torch.zeros(4), torch.zeros(1).expand(4))  # reading one is fine
