"""pytest set-up of the benchmark suite: `pytest benchmarks --benchmark-only` (see docs/benchmarks.md).

pyproject.toml's testpaths keep this folder out of a plain `pytest` / `make test`."""

from __future__ import annotations

import importlib.util
from typing import Iterator

import pytest

from _harness import RankPool

WORLD = 2


def pytest_configure(config: pytest.Config) -> None:
    if importlib.util.find_spec("pytest_benchmark") is None:
        raise pytest.UsageError(
            "benchmarks/ is a pytest-benchmark suite: install it with `make bench` (or `pip install pytest-benchmark`)"
        )


@pytest.fixture(scope="module")
def ranks() -> Iterator[RankPool]:
    """WORLD rank processes on gloo + a fairscale_c group, started once per test module and
    stopped after it, whether its cases passed or failed."""
    pool = RankPool(WORLD)
    try:
        yield pool
    finally:
        pool.close()
