"""pytest set-up for Tango's own FairScale tests (tools/tango/upstream), run by `make tango`.

- ``fairscale`` must be fairscale_c's alias: run pytest as ``python -m fairscale_c.compat -m pytest``
  (the session stops at once otherwise, so that the real FairScale is never what gets tested);
- the GPU gate is lifted: Tango marks its FSDP and AMP cases ``skipif(torch.cuda.device_count() < 2)``;
  those skip marks are removed, so the cases run on CPU (Tango trains on CPU workers when CUDA is
  absent). Any other skip mark stays.
"""

import os

import pytest

UPSTREAM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "upstream")
# Tango's TangoTestCase finds its fixtures through TANGO_SRC_DIR (read when tango.common.testing
# is imported, which the test modules do after this file).
os.environ.setdefault("TANGO_SRC_DIR", UPSTREAM)

GPU_GATE = "Requires CUDA devices"


def pytest_sessionstart(session):
    import fairscale_c.compat as compat

    if not compat.is_installed():
        raise pytest.UsageError(
            "tools/tango: run these tests with the fairscale alias: python -m fairscale_c.compat -m pytest ..."
        )


def pytest_collection_modifyitems(config, items):
    lifted = 0
    for item in items:
        keep = [m for m in item.own_markers if not (m.name == "skipif" and m.kwargs.get("reason") == GPU_GATE)]
        lifted += len(item.own_markers) - len(keep)
        item.own_markers[:] = keep
    config.stash[_LIFTED] = lifted


_LIFTED = pytest.StashKey[int]()


def pytest_report_header(config):
    return f"fairscale alias: fairscale_c; Tango's CUDA gate ('{GPU_GATE}') lifted"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    terminalreporter.write_line(f"tools/tango: GPU-gate skip marks lifted: {config.stash.get(_LIFTED, 0)}")
