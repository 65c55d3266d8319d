"""Random arguments into every function and method of fairscale_c._C that runs without a GPU.

    python tests/fuzz_bindings.py SEED CALLS

Each call gets a random mix of well-formed and malformed arguments: tensors of every dtype and of
odd layouts (0-dim, empty, strided, expanded, views that overlap, parameters that require grad,
meta and sparse tensors), numpy arrays (read-only, negative strides), _C.Buffers, bare DLPack
capsules (fresh, already consumed, wrongly named), objects whose DLPack protocol misbehaves, and
scalars of every kind. Most calls should raise; what matters is how. The run fails (exit 1) on a
SystemError (the C API misused: an error set without NULL returned, or NULL without an error) or
on anything that is not an Exception, and it dies on a crash. At the end, with every object
dropped, no C-owned host buffer, shared mapping or /dev/shm segment of this process may remain.
Prints one JSON line: per function, how many calls returned and how many raised each type.

FZ_FAKE_CUDA=1, with LD_LIBRARY_PATH naming the fake CUDA driver and NCCL of the C tests
(tests/c/build/fake), adds _C.NcclComm's methods and the CUDA launchers, fed "CUDA tensors" that
are host memory exported through DLPack as device memory: the fake NCCL only moves bytes between
host pointers, and the fake driver refuses every kernel launch.
"""

import ctypes
import gc
import json
import os
import random
import sys

import numpy as np
import torch

from dlpack_ctypes import (
    DLDataType,
    DLDevice,
    DLManagedTensorVersioned,
    DLPackVersion,
    DLTensor,
    PyCapsule_New,
    VersionedDeleter,
)
from fairscale_c import _C

SEED, CALLS = int(sys.argv[1]), int(sys.argv[2])
rng = random.Random(SEED)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8]
ODD_DTYPES = [torch.bool, torch.int8, torch.complex64]
SHAPES = [(4,), (0,), (), (2, 3), (1,), (8,), (3, 0), (4096,), (1000, 3), (2, 2, 2)]
theme = [torch.float32, (4,)]  # most tensors of one call share a dtype and shape, to get past the checks
views = [torch.zeros(8)]  # bases whose views may overlap across one call's arguments


class ExportRaises:
    def __dlpack__(self, **kwargs):
        raise ValueError("export refused")

    def __dlpack_device__(self):
        return (1, 0)


class ExportReturnsInt:
    def __dlpack__(self, **kwargs):
        return 5


class ExportWithoutKeywords:
    def __dlpack__(self):
        return torch.zeros(3).__dlpack__()


class DeviceLies:
    def __init__(self, device):
        self.device = device

    def __dlpack__(self, **kwargs):
        return torch.zeros(3).__dlpack__()

    def __dlpack_device__(self):
        return self.device


_capsule_memory = ctypes.create_string_buffer(256)


def foreign_capsule(name: bytes):
    return PyCapsule_New(ctypes.addressof(_capsule_memory), name, None)


class FakeCuda:
    """Host memory exported through DLPack as memory of CUDA device `device` (fake driver only)."""

    DL = {"float32": (2, 32), "float16": (2, 16), "bfloat16": (4, 16), "float64": (2, 64), "int64": (0, 64)}
    NP = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "float64": np.float64, "int64": np.int64}

    def __init__(self, numel, dtype, device=0, strides=None, readonly=False):
        self.array = np.zeros(max(numel, 1), dtype=self.NP[dtype])
        self.numel, self.dtype, self.device, self.readonly = numel, dtype, device, readonly
        self.shape = (ctypes.c_int64 * 1)(numel)
        self.strides = None if strides is None else (ctypes.c_int64 * 1)(strides)
        self.exports = []  # every managed tensor handed out stays alive with this object

    def __dlpack_device__(self):
        return (2, self.device)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        code, bits = self.DL[self.dtype]
        t = DLTensor(self.array.ctypes.data, DLDevice(2, self.device), 1, DLDataType(code, bits, 1))
        t.shape, t.strides = self.shape, self.strides
        deleter = VersionedDeleter(lambda _: None)
        managed = DLManagedTensorVersioned(DLPackVersion(1, 0), None, deleter, 1 if self.readonly else 0, t)
        self.exports.append((managed, deleter))
        return PyCapsule_New(ctypes.addressof(managed), b"dltensor_versioned", None)


def tensor():
    dtype, shape = theme if rng.random() < 0.85 else (rng.choice(DTYPES + ODD_DTYPES), rng.choice(SHAPES))
    t = torch.zeros(shape, dtype=dtype)
    kind = rng.randrange(64)
    if kind == 0 and t.dim() == 2:
        t = t.t()
    elif kind == 1 and t.dim() == 1 and t.numel() > 1:
        t = t[::2]
    elif kind == 2:
        t = torch.zeros(1, dtype=dtype).expand(4)
    elif kind == 3:
        t = torch.zeros(6, dtype=dtype)[1:5]
    elif kind == 4:
        t = torch.nn.Parameter(torch.zeros(4))
    elif kind == 5:
        t = torch.zeros(4, device="meta")
    elif kind == 6:
        t = torch.zeros(4).to_sparse()
    elif kind == 7:
        t = np.zeros(rng.choice([4, 0, 6]), dtype=rng.choice([np.float32, np.int64, np.float16]))
    elif kind == 8:
        t = np.zeros(4, np.float32)
        t.flags.writeable = False
    elif kind == 9:
        t = _C.Buffer((rng.choice([4, 0, 8]),), rng.choice(["float32", "int64", "bfloat16"]))
    elif kind == 10:
        t = torch.zeros(4).__dlpack__(max_version=rng.choice([None, (1, 0)]))
    elif kind == 11:
        t = foreign_capsule(rng.choice([b"dltensor_x", b"used_dltensor", b"used_dltensor_versioned"]))
    elif kind == 12:
        devices = [(2, 0), (999, 0), ("a", 1), (1,), None, (1, 2**40)]
        t = rng.choice([ExportRaises(), ExportReturnsInt(), ExportWithoutKeywords(), DeviceLies(rng.choice(devices))])
    elif kind == 13:
        base = views[-1]
        t = rng.choice([base[0:4], base[2:6], base])
    elif kind == 14:
        t = torch.flip(torch.zeros(4), (0,))
    elif kind == 15:
        t = np.zeros(8, np.float32)[::-2]
    return t


def scalar():
    return rng.choice(
        [None, True, False, 0, 1, -1, 2, 3, 2**31, 2**63, 2**64, -(2**63), 1.5, float("nan"), float("inf"), -0.0]
        + ["sum", "avg", "max", "bogus", "", b"x", [], [1, 2], (1,), (0, 4), object(), "float32", torch.float32]
    )


def arg():
    return tensor() if rng.random() < 0.85 else scalar()


def tensors(n=None, make=tensor):
    """Mostly a list of `n` (default: 0-3) tensors from `make`; else something that is not one."""
    if rng.random() < 0.8:
        return [make() for _ in range(rng.randrange(4) if n is None else n)]
    return rng.choice([[arg() for _ in range(rng.randrange(3))], None, arg(), (make(),)])


def maybe(value, p=0.97):
    return value if rng.random() < p else scalar()


def adam_kwargs(multi: bool, make=tensor) -> dict:
    n = rng.randrange(4)
    kw = {}
    for name in ("param", "grad", "exp_avg", "exp_avg_sq", "param_copy"):
        plural = name + "s" if name != "param_copy" else "param_copies"
        if multi:
            kw[plural] = tensors(n, make)
        else:
            kw[name] = None if name == "param_copy" and flag() else make()
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, bias_correction=True)
    hyper.update(eps_inside_sqrt=False, grad_scale=1.0, optim_scale=1.0)
    kw.update({k: maybe(v) for k, v in hyper.items()})
    if multi:
        bad = rng.choice([[1, 2], [0] * n, [-1] * n, [2**62] * n, tensors(), scalar()])
        kw["steps"] = [1] * n if rng.random() < 0.7 else bad
    else:
        kw["step"] = 1 if rng.random() < 0.7 else rng.choice([0, -1, 2**40, scalar()])
    kw["found_inf"] = rng.choice([None, torch.zeros(1), make()])
    if rng.random() < 0.03:
        kw[rng.choice(["bogus", "stream"])] = scalar()
    return kw


group_state = {"group": None}


def group():
    g = group_state["group"]
    if g is None or g.closed:
        g = group_state["group"] = _C.ShmGroup(f"fuzz{os.getpid()}", 0, 1)
        g.join()
    return g


def flag():
    return rng.random() < 0.5


def op():
    return rng.choice(["sum", "avg", "max", "min", "bogus", scalar()])


def splits():
    return rng.choice([None, [4], [1, 1], [-1], [2**62], scalar()])


def new_group():
    name = rng.choice(["x", "", "a" * 300, "/bad/name", scalar()])
    rank, size = rng.choice([0, 1, -1, 2**31, scalar()]), rng.choice([1, 2, 0, -1, 2**31, 10**6, scalar()])
    _C.ShmGroup(name, rank, size, rng.choice([None, "y", "/x", scalar()]), create=rng.random() < 0.8).close()


def work_wait():
    work = group().barrier(async_op=True)
    if work is not None:
        work.wait(rng.choice([None, 0, -1, 0.1, float("nan"), float("inf"), scalar()]))


def shared_slice():
    mapping = _C._shared_create(rng.choice([4096, 64, 1 << 20]))[2]
    offset, shape = rng.choice([0, 64, -64, 4096, 2**62]), rng.choice([(4,), (2**46,), (-1,), (0,), "x"])
    _C._shared_slice(mapping, offset, shape, rng.choice(["float32", "int8", None, 3]))


def buffer_export():
    keys = rng.sample(["stream", "max_version", "dl_device", "copy"], rng.randrange(4))
    values = [None, -1, 5, 2**70, (1, 0), (1, 1), [1, 0], (1,), (1, 2**40), (2, 0), True, 0, "x", object()]
    _C.Buffer((4,), "float32").__dlpack__(**{k: rng.choice(values) for k in keys})


FUNCTIONS = {
    "copy_": lambda: _C.copy_(arg(), arg()),
    "clone": lambda: _C.clone(arg()),
    "pack_blocks": lambda: _C.pack_blocks(arg(), tensors(), rng.choice([1, 2, 3, 0, -1, 2**31 - 1, scalar()])),
    "describe": lambda: _C.describe(arg(), contiguous=flag(), writable=flag(), cpu_only=flag()),
    "Buffer": lambda: _C.Buffer(
        rng.choice([(4,), [2, 3], (), (-1,), (2**62, 2**62), (2**46,), (2**31, 2**31), "abc", 5, None, (1.5,)]),
        rng.choice(["float32", "int64", torch.bfloat16, np.float32, "complex64", scalar()]),
    ),
    "Buffer.__dlpack__": buffer_export,
    "_shared_slice": shared_slice,
    "_shared_contains": lambda: _C._shared_contains(
        rng.choice([0, 1, -1, 2**63 - 1, 2**64 - 1]), rng.choice([0, 1, -1, 2**63 - 1])
    ),
    "_log": lambda: _C._log(
        rng.choice([0, 1, 5, -1, 100, scalar()]), rng.choice(["%s%n%p", "x" * 10000, "", scalar()])
    ),
    "all_to_all_check": lambda: _C.all_to_all_check(
        arg(), arg(), splits(), splits(), rng.choice([0, 1, -1, 2]), rng.choice([1, 2, 0, -1, 2**31])
    ),
    "ShmGroup": new_group,
    "ShmGroup.all_reduce": lambda: group().all_reduce(arg(), op(), async_op=flag()),
    "ShmGroup.all_gather": lambda: group().all_gather(arg(), arg(), async_op=flag()),
    "ShmGroup.reduce_scatter": lambda: group().reduce_scatter(arg(), arg(), op(), async_op=flag()),
    "ShmGroup.broadcast": lambda: group().broadcast(arg(), rng.choice([0, 1, -1, scalar()]), async_op=flag()),
    "ShmGroup.reduce": lambda: group().reduce(arg(), rng.choice([0, 1, -1, scalar()]), op(), async_op=flag()),
    "ShmGroup.send": lambda: group().send(arg(), rng.choice([0, 1, -1, scalar()]), async_op=flag()),
    "ShmGroup.recv": lambda: group().recv(arg(), rng.choice([0, 1, -1, 5, scalar()]), async_op=flag()),
    "ShmGroup.all_to_all_single": lambda: group().all_to_all_single(arg(), arg(), splits(), splits(), async_op=flag()),
    "ShmGroup.batch": lambda: group().batch(
        rng.choice(
            [
                [],
                [("send", tensor(), 0)],
                [("recv", tensor(), 0), ("send", tensor(), 0)],
                [(scalar(), arg(), scalar())],
                [scalar()],
                scalar(),
                [("send",)],
                [("send", tensor(), 0, 5, 6)],
            ]
        ),
        async_op=flag(),
    ),
    "ShmGroup.barrier": lambda: group().barrier(async_op=flag()),
    "ShmGroup.close": lambda: group().close(rng.choice([None, 0, -1, 0.01, float("nan"), scalar()])),
    "Work.wait": work_wait,
    "NcclComm": lambda: _C.NcclComm(
        rng.choice([b"\0" * 128, b"", scalar()]),
        rng.choice([0, -1, scalar()]),
        rng.choice([1, 0, scalar()]),
        rng.choice([0, -1, scalar()]),
        rng.choice([0.0, 0.1, scalar()]),
    ),
    "nccl_load": lambda: _C.nccl_load(rng.choice([(), ["/nonexistent/libnccl.so"], [scalar()], scalar()])),
    "cuda_cast": lambda: _C.cuda_cast(arg(), arg(), scalar()),
    "cuda_unscale_inf_check": lambda: _C.cuda_unscale_inf_check(arg(), scalar(), arg(), scalar()),
    "cuda_sq_norm": lambda: _C.cuda_sq_norm(arg(), arg(), arg(), scalar()),
    "cuda_fs_adam_multi": lambda: _C.cuda_fs_adam_multi(**adam_kwargs(True), stream=rng.choice([0, scalar()])),
    "cpu_unscale_inf_check": lambda: _C.cpu_unscale_inf_check(
        arg(), rng.choice([1.0, 0.5, scalar()]), rng.choice([torch.zeros(1), arg()])
    ),
    "cpu_sq_norm": lambda: _C.cpu_sq_norm(arg(), absmax=flag()),
    "cpu_adamw_step": lambda: _C.cpu_adamw_step(
        *[tensor() for _ in range(4)],
        *[rng.choice([0.1, 1, 0.9, 1e-8, 0.0, -1.0, float("nan")]) for _ in range(5)],
        1 if rng.random() < 0.7 else rng.choice([0, -1, 2**40]),
    ),
    "cpu_fs_adam_step": lambda: _C.cpu_fs_adam_step(**adam_kwargs(False)),
    "cpu_fs_adam_multi": lambda: _C.cpu_fs_adam_multi(
        **adam_kwargs(True), threads=rng.choice([1, 2, 0, -1, 2**31, scalar()])
    ),
    "cpu_bn_combine": lambda: _C.cpu_bn_combine(arg(), rng.choice([1, 2, 0, -1, scalar()]), maybe(1e-5, 0.8), arg()),
    "cpu_bn_coeffs": lambda: _C.cpu_bn_coeffs(arg(), rng.choice([1.0, 0.0, -1.0, scalar()]), arg(), arg(), arg()),
}


# ---- CUDA, against the fake driver and NCCL (FZ_FAKE_CUDA=1) -------------------------------------

cuda_theme = ["float32", 4]
cuda_keep = []  # what the fake NCCL may still read: every buffer sent, until the run ends


def cuda_tensor():
    if rng.random() < 0.1:
        return tensor()  # host memory where device memory is expected
    dtype, numel = cuda_theme if rng.random() < 0.85 else (rng.choice(list(FakeCuda.DL)), rng.choice([0, 1, 4, 64]))
    odd = rng.randrange(20)
    t = FakeCuda(
        numel,
        dtype,
        device=rng.choice([1, -1]) if odd == 0 else 0,
        strides=rng.choice([2, 0, -1]) if odd == 1 else None,
        readonly=odd == 2,
    )
    cuda_keep.append(t)
    return t


def stream():
    return 0 if rng.random() < 0.9 else rng.choice([-1, 2**64, "x", None, 1.5])


comm_state = {"comm": None, "calls": 0}


def comm():
    comm_state["calls"] += 1
    if comm_state["comm"] is None or comm_state["calls"] % 64 == 0:
        comm_state["comm"] = _C.NcclComm(_C.nccl_unique_id(), 0, 1, 0, rng.choice([0.0, 5.0]))
    return comm_state["comm"]


def comm_end():
    c = comm()
    c.abort() if flag() else c.destroy(rng.choice([0.0, 1.0, -1.0, scalar()]))
    comm_state["comm"] = None


def nccl_batch():
    t = cuda_tensor()
    ops = rng.choice(
        [
            [("send", t, 0), ("recv", cuda_tensor(), 0)],
            [("recv", cuda_tensor(), 0), ("send", t, 0)],
            [("send", t, 1)],
            [("all_reduce", t, "sum")],
            [("send", t)],
            [],
            [(scalar(), t, 0)],
            scalar(),
        ]
    )
    comm().batch(ops, stream())


CUDA_FUNCTIONS = {
    "NcclComm.all_gather": lambda: comm().all_gather(cuda_tensor(), cuda_tensor(), stream()),
    "NcclComm.reduce_scatter": lambda: comm().reduce_scatter(cuda_tensor(), cuda_tensor(), op(), stream()),
    "NcclComm.all_reduce": lambda: comm().all_reduce(cuda_tensor(), op(), stream()),
    "NcclComm.broadcast": lambda: comm().broadcast(cuda_tensor(), rng.choice([0, 1, -1, scalar()]), stream()),
    "NcclComm.reduce": lambda: comm().reduce(cuda_tensor(), op(), rng.choice([0, 1, -1]), stream()),
    "NcclComm.send": lambda: comm().send(cuda_tensor(), rng.choice([0, 1, -1]), stream()),
    "NcclComm.recv": lambda: comm().recv(cuda_tensor(), rng.choice([0, 1, -1]), stream()),
    "NcclComm.batch": nccl_batch,
    "NcclComm.all_to_all_single": lambda: comm().all_to_all_single(
        cuda_tensor(), cuda_tensor(), splits(), splits(), stream()
    ),
    "NcclComm.wait": lambda: comm().wait(stream(), rng.choice([0.0, 0.5, -1.0, float("nan"), scalar()])),
    "NcclComm.abort/destroy": comm_end,
    "cuda_cast (device)": lambda: _C.cuda_cast(cuda_tensor(), cuda_tensor(), stream()),
    "cuda_unscale_inf_check (device)": lambda: _C.cuda_unscale_inf_check(
        cuda_tensor(), maybe(0.5), FakeCuda(1, "float32"), stream()
    ),
    "cuda_sq_norm (device)": lambda: _C.cuda_sq_norm(cuda_tensor(), cuda_tensor(), cuda_tensor(), stream(), flag()),
    "cuda_adamw_step (device)": lambda: _C.cuda_adamw_step(
        *[cuda_tensor() for _ in range(4)], *[maybe(v) for v in (1e-3, 0.9, 0.999, 1e-8, 0.0)], maybe(1), stream()
    ),
    "cuda_fs_adam_step (device)": lambda: _C.cuda_fs_adam_step(**adam_kwargs(False, cuda_tensor), stream=stream()),
    "cuda_fs_adam_multi (device)": lambda: _C.cuda_fs_adam_multi(**adam_kwargs(True, cuda_tensor), stream=stream()),
    "pack_blocks (device)": lambda: _C.pack_blocks(
        cuda_tensor(), tensors(None, cuda_tensor), rng.choice([1, 2, 0]), stream=stream()
    ),
}
if os.environ.get("FZ_FAKE_CUDA"):
    FUNCTIONS.update(CUDA_FUNCTIONS)


def ours(segment: str) -> bool:
    """Whether a /dev/shm name that appeared during the run can be this process's: not another
    process's engine segment ("fsc-<pid>-..."), not a POSIX semaphore of another program."""
    if segment.startswith("sem."):
        return False
    parts = segment.split("-")
    return not (parts[0] == "fsc" and len(parts) > 2 and parts[1] != str(os.getpid()))


def main() -> int:
    segments_before = set(os.listdir("/dev/shm"))
    outcomes = {name: {} for name in FUNCTIONS}
    failures = []
    names = sorted(FUNCTIONS)
    for i in range(CALLS):
        name = rng.choice(names)
        theme[:] = [torch.float32 if rng.random() < 0.5 else rng.choice(DTYPES), rng.choice(SHAPES)]
        cuda_theme[:] = ["float32" if flag() else rng.choice(list(FakeCuda.DL)), rng.choice([0, 1, 4, 4096])]
        views.append(torch.zeros(8))
        del views[:-2]
        try:
            FUNCTIONS[name]()
            kind = "returned"
        except SystemError as e:
            kind = "SystemError"
            failures.append(f"call {i} ({name}): SystemError: {e}")
        except Exception as e:
            kind = type(e).__name__
        except BaseException as e:  # noqa: BLE001 - reported, not swallowed
            kind = type(e).__name__
            failures.append(f"call {i} ({name}): {kind} is not an Exception: {e}")
        outcomes[name][kind] = outcomes[name].get(kind, 0) + 1
    comm_state["comm"] = None
    cuda_keep.clear()
    g = group_state.pop("group")
    if g is not None:
        g.close()
    del g
    views.clear()
    gc.collect()
    left = {"host buffers": _C._live_host_buffers(), "shared mappings": _C._shared_live()}
    left = {k: v for k, v in left.items() if v}
    new_segments = sorted(n for n in set(os.listdir("/dev/shm")) - segments_before if ours(n))
    if left or new_segments:
        failures.append(f"left behind: {left} {new_segments}")
    print(json.dumps({"seed": SEED, "outcomes": outcomes, "failures": failures}))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
