"""Random and malformed arguments into the C extension's functions (tests/fuzz_bindings.py): every
call returns or raises an ordinary exception (never a SystemError, never a crash), and nothing
C-owned outlives the run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

FUZZER = Path(__file__).with_name("fuzz_bindings.py")
CALLS = 4000
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


def run_fuzzer(seed: int) -> dict:
    env = dict(os.environ, FAIRSCALE_C_TIMEOUT="3")  # attaching to a group nobody creates gives up soon
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the same fairscale_c as this test
    r = subprocess.run(
        [sys.executable, str(FUZZER), str(seed), str(CALLS)], capture_output=True, text=True, timeout=600, env=env
    )
    assert r.returncode in (0, 1), f"seed {seed}: the fuzzer died (rc {r.returncode})\n{r.stderr[-3000:]}"
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["failures"] == [], f"seed {seed}: " + "\n".join(report["failures"])
    assert r.returncode == 0
    return report["outcomes"]


def test_malformed_arguments_raise_ordinary_exceptions_and_leave_nothing_behind():
    totals: dict = {}
    for seed in (1, 2, 3):
        for name, kinds in run_fuzzer(seed).items():
            for kind, n in kinds.items():
                totals.setdefault(name, {}).setdefault(kind, 0)
                totals[name][kind] += n
    never_called = [name for name, kinds in totals.items() if not kinds]
    assert never_called == []
    never_returned = [name for name in MUST_RETURN if not totals[name].get("returned")]
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
