"""Shared pytest set-up."""

import os

import pytest


def pytest_sessionstart(session):
    from dist_utils import settle_torch_math

    settle_torch_math()
    # `make asan` sets this so the suite cannot silently test the regular build instead.
    expected = os.environ.get("FAIRSCALE_C_EXPECT_BUILD")
    if expected:
        from fairscale_c import _C

        if not os.path.abspath(_C.__file__).startswith(os.path.abspath(expected)):
            raise pytest.UsageError(f"expected fairscale_c._C from {expected}, imported {_C.__file__}")
