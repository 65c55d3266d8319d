"""Shared pytest set-up."""

import os
import sys

import pytest

# The benchmark scripts, which the test_bench_* files import as modules.
BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.append(BENCHMARKS)


def pytest_sessionstart(session):
    from dist_utils import settle_torch_math

    settle_torch_math()
    # `make asan` sets this so the suite cannot silently test the regular build instead.
    expected = os.environ.get("FAIRSCALE_C_EXPECT_BUILD")
    if expected:
        from fairscale_c import _C

        if not os.path.abspath(_C.__file__).startswith(os.path.abspath(expected)):
            raise pytest.UsageError(f"expected fairscale_c._C from {expected}, imported {_C.__file__}")
