"""Random and malformed arguments into the C extension's functions (tests/fuzz_bindings.py): every
call returns or raises an ordinary exception (never a SystemError, never a crash), and nothing
C-owned outlives the run. And the same for the collectives of fairscale_c.distributed at 2 and 3
ranks: a malformed call fails alike on every rank, before anything is sent, so nobody waits."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FUZZER = Path(__file__).with_name("fuzz_bindings.py")
CALLS = 5000
# Calls that must have succeeded at least once over the seeds: the fuzzer reaches past the checks.
MUST_RETURN = [
    "copy_",
    "clone",
    "describe",
    "Buffer",
    "Buffer.__dlpack__",
    "ShmGroup.all_reduce",
    "ShmGroup.all_gather",
    "ShmGroup.reduce_scatter",
    "ShmGroup.broadcast",
    "ShmGroup.reduce",
    "ShmGroup.barrier",
    "Work.wait",
    "cpu_sq_norm",
    "cpu_unscale_inf_check",
    "cpu_fs_adam_step",
    "pack_blocks",
]


MUST_RETURN_CUDA = [
    "NcclComm.all_gather",
    "NcclComm.reduce_scatter",
    "NcclComm.all_reduce",
    "NcclComm.broadcast",
    "NcclComm.reduce",
    "NcclComm.wait",
    "NcclComm.abort/destroy",
    "pack_blocks (device)",
]
C_TESTS = Path(__file__).with_name("c")


def run_fuzzer(seed: int, **extra_env: str) -> dict:
    env = dict(os.environ, FAIRSCALE_C_TIMEOUT="0.5", **extra_env)  # attaching to a group nobody creates gives up soon
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the same fairscale_c as this test
    r = subprocess.run(
        [sys.executable, str(FUZZER), str(seed), str(CALLS)], capture_output=True, text=True, timeout=600, env=env
    )
    assert r.returncode in (0, 1), f"seed {seed}: the fuzzer died (rc {r.returncode})\n{r.stderr[-3000:]}"
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["failures"] == [], f"seed {seed}: " + "\n".join(report["failures"])
    assert r.returncode == 0
    return report["outcomes"]


def fuzz_totals(seeds, **extra_env: str) -> dict:
    """Per function, how each outcome counts over the runs of `seeds`."""
    totals: dict = {}
    for seed in seeds:
        for name, kinds in run_fuzzer(seed, **extra_env).items():
            for kind, n in kinds.items():
                totals.setdefault(name, {}).setdefault(kind, 0)
                totals[name][kind] += n
    return totals


def test_malformed_arguments_raise_ordinary_exceptions_and_leave_nothing_behind():
    totals = fuzz_totals((1, 2, 3))
    never_called = [name for name, kinds in totals.items() if not kinds]
    assert never_called == []
    never_returned = [name for name in MUST_RETURN if not totals[name].get("returned")]
    assert never_returned == [], f"the fuzzer no longer reaches past the checks of {never_returned}"


@pytest.mark.skipif(sys.platform != "linux", reason="the fake driver is a Linux shared object")
def test_malformed_arguments_on_the_cuda_paths_against_a_fake_driver_and_nccl():
    # The C tests' fake CUDA driver and NCCL stand in for the real ones, so the NCCL backend's and
    # the CUDA launchers' argument handling runs on a machine without a GPU.
    cmd = ["make", "-C", str(C_TESTS), "build/fake/libnccl.so.2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    fake = os.pathsep.join(p for p in (str(C_TESTS / "build" / "fake"), os.environ.get("LD_LIBRARY_PATH")) if p)
    totals = fuzz_totals((4, 5), FZ_FAKE_CUDA="1", LD_LIBRARY_PATH=fake)
    never_returned = [name for name in MUST_RETURN_CUDA if not totals[name].get("returned")]
    assert never_returned == [], f"the fuzzer no longer reaches past the checks of {never_returned}"


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"dl_device": 5}, TypeError, "'dl_device' must be a tuple of two ints"),
        ({"dl_device": (1, 2**40)}, OverflowError, "'dl_device'"),
        ({"max_version": [1, 0]}, TypeError, "'max_version' must be a tuple of two ints"),
        ({"max_version": (1,)}, TypeError, "'max_version'"),
        ({"stream": 2**70}, BufferError, "'stream' must be None"),
        ({"stream": "x"}, BufferError, "'stream' must be None"),
    ],
)
def test_buffer_export_refuses_malformed_keywords(kwargs, exc, match):
    from fairscale_c import _C

    with pytest.raises(exc, match=match):
        _C.Buffer((4,), "float32").__dlpack__(**kwargs)


def test_buffer_export_passes_on_an_error_from_copy():
    from fairscale_c import _C

    class Undecidable:
        def __bool__(self):
            raise ZeroDivisionError("no truth value")

    with pytest.raises(ZeroDivisionError):
        _C.Buffer((4,), "float32").__dlpack__(copy=Undecidable())


def test_buffer_size_errors_say_what_failed():
    from fairscale_c import _C

    with pytest.raises(ValueError, match="more elements than a buffer can hold"):
        _C.Buffer((2**31, 2**31), "float32")
    # 256 TiB: more than a process can address, so no overcommit setting lets it through
    with pytest.raises(MemoryError, match="cannot allocate 281474976710656 bytes"):
        _C.Buffer((2**46,), "float32")


def test_nccl_load_refuses_a_string_and_non_string_paths():
    from fairscale_c import _C

    with pytest.raises(TypeError, match="got one string"):
        _C.nccl_load("libnccl.so.2")
    with pytest.raises(TypeError, match="item 0 must be a str"):
        _C.nccl_load([3])
    with pytest.raises(TypeError, match="without NUL"):
        _C.nccl_load(["lib\0nccl.so"])


def _group_fuzz_job(rank: int, world: int, seed: int, calls: int):
    """Every rank draws the same calls (ops, dtypes, shapes, layouts, malformed arguments) from one
    seed; only tensor values and peers relative to the rank differ. So every call must end the same
    way on every rank: all succeed, or all raise the same error before anything is sent. A rank
    that raised while its peers went on would leave them waiting, and the next call would fail with
    a DistributedError; the job stops there."""
    import random

    import torch

    import fairscale_c.distributed as fdist
    from fairscale_c import DistributedError, _C
    from dist_utils import join_gloo

    join_gloo(rank, world)
    g = fdist.init_group()
    rng = random.Random(seed)
    right, left = (rank + 1) % world, (rank - 1) % world
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8]
    odd = [torch.bool, torch.int8, torch.complex64]

    def tensor(numel, dtype, kind=None):
        kind = rng.randrange(24) if kind is None else kind
        value = torch.full((numel,), rank + 1).to(dtype)
        if kind == 0:
            return value.reshape(1, numel).t() if numel > 1 else value.reshape(())
        if kind == 1:
            return torch.zeros(2 * numel, dtype=dtype)[::2]
        if kind == 2:
            return torch.zeros(1, dtype=dtype).expand(numel)
        if kind == 3 and dtype.is_floating_point:
            return value.requires_grad_()
        if kind == 4:
            return value.numpy() if dtype not in (torch.bfloat16,) else value
        if kind == 5:
            arr = value.numpy() if dtype not in (torch.bfloat16,) else value.float().numpy()
            arr.flags.writeable = False
            return arr
        if kind == 6:
            return _C.Buffer((numel,), "float32" if dtype.is_floating_point else "int64")
        if kind == 7:
            return rng.choice([None, 3, "x", [1.0] * numel])
        if kind == 8 and dtype in (torch.float32, torch.bfloat16):
            t = fdist.shared_empty(numel, dtype=dtype, group=g)  # collective: every rank makes one
            t.fill_(rank + 1)
            return t
        return value

    def sizes():
        numel = rng.choice([0, 1, 2, 7, 64, 1000, 65537])
        dtype = rng.choice(dtypes) if rng.random() < 0.9 else rng.choice(odd)
        return numel, dtype

    def call():
        op = rng.choice(["all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "a2a", "ring", "barrier"])
        n, dt = sizes()
        async_op = rng.random() < 0.5
        if op == "all_reduce":
            t = tensor(n, dt)
            return op, g.all_reduce(t, rng.choice(["sum", "avg", "max", "min", "bogus", 3]), async_op=async_op)
        if op in ("all_gather", "reduce_scatter"):
            big, small = n * world + rng.choice([0, 0, 0, 1, -1]), n
            overlap = rng.randrange(10) if n >= 2 else 9
            if overlap < 2:  # this rank's block of the big tensor (the in-place form), or one element off
                base = torch.zeros(n * world + 1, dtype=dt)
                whole, block = base[: n * world], base[rank * n + overlap :][:n]
                out, inp = (whole, block) if op == "all_gather" else (block, whole)
            elif op == "all_gather":
                out, inp = tensor(big, dt), tensor(small, dt)
            else:
                out, inp = tensor(small, dt), tensor(big, dt)
            if op == "all_gather":
                return op, g.all_gather(out, inp, async_op=async_op)
            return op, g.reduce_scatter(out, inp, rng.choice(["sum", "avg", "prod"]), async_op=async_op)
        if op in ("broadcast", "reduce"):
            root = rng.choice([0, world - 1, -1, world, "0"])
            t = tensor(n, dt)
            if op == "broadcast":
                return op, g.broadcast(t, root, async_op=async_op)
            return op, g.reduce(t, root, rng.choice(["sum", "max"]), async_op=async_op)
        if op == "a2a":
            rows = rng.choice([0, 1, 3])
            splits = rng.choice([None, None, [rows] * world, [-1] + [rows] * (world - 1), [rows], "x"])
            out, inp = tensor(rows * world, dt), tensor(rows * world, dt)
            return op, g.all_to_all_single(out, inp, splits, splits, async_op=async_op)
        if op == "ring":
            kind = rng.randrange(24)  # a layout both ends of every message share
            send, recv = tensor(n, dt, kind), tensor(n, dt, kind)
            ops = [fdist.P2POp("send", send, right), fdist.P2POp("recv", recv, left)]
            if rng.random() < 0.5:
                ops.reverse()
            bad = rng.randrange(8)
            if bad == 0:
                ops = [("send", send, rank)]  # to itself
            elif bad == 1:
                ops = [("send", send, world)]  # no such rank
            elif bad == 2:
                ops = []
            elif bad == 3:
                ops = [("shout", send, right)]
            return op, g.batch(ops, async_op=async_op)
        return op, g.barrier(async_op=async_op)

    outcomes = []  # (how the call ended, the error's message)
    for _ in range(calls):
        op = "?"
        try:
            op, work = call()
            if work is not None:
                work.wait()
            outcomes.append((f"{op} returned", ""))
        except DistributedError as e:
            outcomes.append((f"{op}: DistributedError", str(e)))
            break
        except Exception as e:
            outcomes.append((type(e).__name__, str(e)))
    fdist.destroy(g)
    return outcomes


@pytest.mark.parametrize("world", [2, 3])
def test_malformed_collectives_fail_alike_on_every_rank(world):
    from dist_utils import orphaned_segments, run_ranks

    results = run_ranks(_group_fuzz_job, world, 7 + world, 400, env={"FAIRSCALE_C_TIMEOUT": "20"})
    for rank in range(1, world):
        for i, (a, b) in enumerate(zip(results[0], results[rank])):
            assert a[0] == b[0], f"call {i}: rank 0 {a}, rank {rank} {b}"
    assert len(results[0]) == 400, results[0][-1]
    assert sum(kind.endswith("returned") for kind, _ in results[0]) > 40, "the fuzzer no longer reaches the engine"
    assert not orphaned_segments()
