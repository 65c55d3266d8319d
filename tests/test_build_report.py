"""`python -m fairscale_c`, the report a user pastes into a bug report, and the one version string."""

import importlib.metadata
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import fairscale_c

C_TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "c")


def report(*args, env=None):
    r = subprocess.run(
        [sys.executable, "-m", "fairscale_c", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, **(env or {})),
        cwd=os.path.dirname(C_TESTS),
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_one_version_string():
    assert fairscale_c.build_info()["version"] == fairscale_c.__version__
    assert importlib.metadata.version("fairscale_c") == fairscale_c.__version__
    assert ".".join(map(str, fairscale_c.__version_tuple__)) == fairscale_c.__version__


def test_report_is_readable_and_agrees_with_build_info():
    info = json.loads(report("--json"))
    for key, value in fairscale_c.build_info().items():
        if not key.startswith("nccl"):  # the report loads NCCL first, build_info() alone does not
            assert info[key] == value, key
    title, *rows = report().splitlines()
    assert title == "fairscale_c build info"
    lines = dict(re.split(r"\s{2,}", row.strip(), maxsplit=1) for row in rows)  # "  key   value"
    assert lines["version"] == fairscale_c.__version__
    assert lines["extension"] == os.path.abspath(fairscale_c._C.__file__)
    assert lines["CUDA kernels"].startswith("built" if info["cuda_kernels_built"] else "not built")
    if info["driver_found"]:
        assert f"at {info['driver_path']}, {info['device_count']} device(s)" in lines["CUDA driver"]
    else:
        assert lines["CUDA driver"] == f"not found: {info['error']}"
    if info["nccl_version"]:
        assert lines["NCCL"].endswith(f"at {info['nccl_path']}")
    else:
        assert lines["NCCL"] == f"not found: {info['nccl_error']}"
    assert lines["torch"].startswith(torch.__version__)


def test_report_lists_the_settings_from_the_environment():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FAIRSCALE_C_", "NCCL_"))}
    r = subprocess.run(
        [sys.executable, "-m", "fairscale_c"], capture_output=True, text=True, timeout=120, env=env, check=True
    )
    assert re.search(r"^  settings +no FAIRSCALE_C_\* or NCCL_\* set$", r.stdout, re.M), r.stdout
    text = report(env={"FAIRSCALE_C_NCCL_BLOCKING": "1", "NCCL_DEBUG": "WARN"})
    assert re.search(r"^  settings +.*FAIRSCALE_C_NCCL_BLOCKING=1.*NCCL_DEBUG=WARN", text, re.M), text
    info = json.loads(report("--json", env={"FAIRSCALE_C_TIMEOUT": "30"}))
    assert info["settings"]["FAIRSCALE_C_TIMEOUT"] == "30"


@pytest.mark.skipif(sys.platform != "linux", reason="the fake driver is a Linux shared object")
def test_report_names_the_driver_and_nccl_files_it_loaded():
    # The fake CUDA driver and NCCL of the C tests stand in for the real libraries.
    r = subprocess.run(["make", "-C", C_TESTS, "build/fake/libnccl.so.2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    fake = os.path.join(C_TESTS, "build", "fake")
    text = report(env={"LD_LIBRARY_PATH": fake})
    # One object serves both names in the fake, so the driver's file may show either name.
    assert re.search(rf"CUDA driver +\d+\.\d+ at {re.escape(fake)}/lib\S+\.so\S*, [1-9]\d* device\(s\)$", text, re.M), (
        text
    )
    assert re.search(rf"NCCL +\d+\.\d+\.\d+ at {re.escape(fake)}/libnccl\.so\.2$", text, re.M), text
