"""build_info, the error model and logging."""

import os
import re
import subprocess
import sys

import pytest

import fairscale_c
from fairscale_c import _C


def test_build_info_reports_build_and_runtime():
    info = fairscale_c.build_info()
    assert info["version"] == fairscale_c.__version__
    assert info["dlpack_version"] == "1.1"
    assert info["c_standard"] == 11
    assert isinstance(info["cuda_kernels_built"], bool)
    assert info["compiler"]


def test_distributed_error_is_a_runtime_error():
    assert issubclass(fairscale_c.DistributedError, RuntimeError)
    assert fairscale_c.DistributedError is _C.DistributedError


def test_import_works_without_gpu_libraries():
    # A fresh interpreter with CUDA hidden must import and report cleanly.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", LD_LIBRARY_PATH="")
    code = "import fairscale_c, json; print(json.dumps(fairscale_c.build_info(), default=str))"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert '"dlpack_version": "1.1"' in r.stdout


@pytest.mark.parametrize(
    "level,shown", [("", []), ("WARN", ["WARN"]), ("INFO", ["WARN", "INFO"]), ("TRACE", ["WARN", "INFO", "TRACE"])]
)
def test_debug_logging_levels_and_prefix(level, shown):
    code = (
        "from fairscale_c import _C\n"
        "_C._set_log_rank(3)\n"
        "_C._log(1, 'w-msg'); _C._log(2, 'i-msg'); _C._log(3, 't-msg')\n"
    )
    env = dict(os.environ, FAIRSCALE_C_DEBUG=level)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("fairscale_c ")]
    assert [ln.split()[2] for ln in lines] == shown
    for ln in lines:
        assert re.match(r"fairscale_c 3:\d+ (WARN|INFO|TRACE) \[python\] [wit]-msg$", ln), ln


def test_log_rejects_bad_level():
    with pytest.raises(ValueError, match="argument 'level'"):
        _C._log(7, "x")
