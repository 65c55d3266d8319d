"""``python -m fairscale_c``: what this build holds and what it finds at run time.

This is the text to paste into a bug report: the package version and where it was imported from,
the compiler, whether the CUDA kernels were compiled in, and the CUDA driver, CUDA runtime and
NCCL this process finds (versions and files), plus Python, torch and the FAIRSCALE_C_* and NCCL_*
environment variables that are set. ``--json`` prints the same
facts as one JSON object. NCCL is loaded the way the NCCL backend loads it (the copy torch's
nvidia-nccl wheel ships, else ``libnccl.so.2`` from the loader's path), so the report says what a
training run on CUDA would use.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from typing import Any, Dict, Optional

import fairscale_c
from fairscale_c import _C


def _cuda_version(code: int) -> str:
    """CUDA's version codes: 12080 -> "12.8"."""
    return f"{code // 1000}.{code % 1000 // 10}"


def _nccl_version(code: int) -> str:
    """NCCL_VERSION_CODE: 22703 -> "2.27.3" (2.9 and later), 2708 -> "2.7.8" (before)."""
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


def _load_nccl() -> Optional[str]:
    """Load NCCL as the NCCL backend does; None when it loaded, else why not."""
    from fairscale_c.distributed._nccl import _nccl_candidates  # the backend's own search list

    try:
        _C.nccl_load(_nccl_candidates())
    except (RuntimeError, OSError) as e:
        return str(e)
    return None


def _torch_facts() -> Dict[str, Any]:
    try:
        import torch
    except ImportError as e:
        return {"torch_version": None, "torch_error": str(e)}
    return {
        "torch_version": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_path": os.path.dirname(torch.__file__),
    }


def _settings() -> Dict[str, str]:
    """The FAIRSCALE_C_* and NCCL_* variables set in the environment: they change timeouts, the
    NCCL communicators' mode (FAIRSCALE_C_NCCL_BLOCKING) and whether ranks may share a GPU."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(("FAIRSCALE_C_", "NCCL_"))}


def collect() -> Dict[str, Any]:
    """build_info() after loading NCCL, plus where the package, Python and torch are, and the
    settings taken from the environment."""
    nccl_error = _load_nccl()
    info = fairscale_c.build_info()
    info["nccl_error"] = nccl_error
    info["package_path"] = os.path.dirname(os.path.abspath(fairscale_c.__file__))
    info["extension_path"] = os.path.abspath(_C.__file__)
    info["python"] = f"{platform.python_version()} ({platform.python_implementation()}) at {sys.executable}"
    info["platform"] = platform.platform()
    info.update(_torch_facts())
    info["settings"] = _settings()
    return info


def _driver_line(info: Dict[str, Any]) -> str:
    if not info.get("driver_found"):
        return f"not found: {info.get('error') or 'libcuda.so.1 could not be loaded'}"
    line = f"{_cuda_version(info['driver_version'])} at {info.get('driver_path') or '?'}"
    line += f", {info.get('device_count', 0)} device(s)"
    if info.get("error"):
        line += f"; unusable: {info['error']}"
    return line


def format_report(info: Dict[str, Any]) -> str:
    """The human-readable report, one fact per line."""
    if info.get("cuda_kernels_built"):
        kernels = "built (fatbin embedded in the extension)"
    else:
        kernels = "not built (nvcc was not found, or FAIRSCALE_C_CUDA=0, at build time)"
    if info.get("runtime_found"):
        runtime = f"{_cuda_version(info['runtime_version'])} at {info.get('runtime_path') or '?'}"
    else:
        runtime = "not found (reported only: fairscale_c does not need it)"
    if info.get("nccl_version"):
        nccl = f"{_nccl_version(info['nccl_version'])} at {info.get('nccl_path') or '?'}"
    else:
        nccl = f"not found: {info.get('nccl_error') or 'not loaded'}"
    if info.get("torch_version"):
        torch_line = f"{info['torch_version']} (CUDA {info.get('torch_cuda') or 'none'}) at {info['torch_path']}"
    else:
        torch_line = f"not importable ({info.get('torch_error')})"
    rows = [
        ("version", info["version"]),
        ("package", info["package_path"]),
        ("extension", info["extension_path"]),
        ("compiler", f"{info['compiler']}, C{info['c_standard']}, DLPack {info['dlpack_version']}"),
        ("CUDA kernels", kernels),
        ("CUDA driver", _driver_line(info)),
        ("CUDA runtime", runtime),
        ("NCCL", nccl),
        ("python", info["python"]),
        ("platform", info["platform"]),
        ("torch", torch_line),
        ("settings", ", ".join(f"{k}={v}" for k, v in info["settings"].items()) or "no FAIRSCALE_C_* or NCCL_* set"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(["fairscale_c build info"] + [f"  {k:<{width}}  {v}" for k, v in rows])


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fairscale_c", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print the facts as one JSON object")
    args = ap.parse_args(argv)
    info = collect()
    print(json.dumps(info, indent=2, sort_keys=True) if args.json else format_report(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())
