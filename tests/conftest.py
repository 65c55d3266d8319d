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


def pytest_addoption(parser):
    parser.addoption(
        "--max-world",
        type=int,
        default=None,
        help="deselect the cases of tests parametrized by `world` that start more ranks than this",
    )


def pytest_collection_modifyitems(config, items):
    limit = config.getoption("--max-world")
    if limit is None:
        return
    kept, dropped = [], []
    for item in items:
        world = getattr(item, "callspec", None) and item.callspec.params.get("world")
        (dropped if isinstance(world, int) and world > limit else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture
def solo(monkeypatch):
    """A group of one rank on the shared-memory engine, in the test's own process (torchrun's
    variables for world size 1): for argument rules, which are checked before anything moves."""
    import fairscale_c.distributed as fdist
    from dist_utils import free_port

    for k, v in {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}.items():
        monkeypatch.setenv(k, v)
    group = fdist.init_group(name="solo")
    yield group
    fdist.destroy(group)
