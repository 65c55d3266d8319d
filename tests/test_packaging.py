"""The source distribution: what it holds, and that it builds, installs and runs on its own.

What `pip install fairscale_c` does on a platform without a matching wheel is build this sdist, so
a header, kernel or build script missing from it must fail here. The sdist is built through the
PEP 517 hook (as pip and `python -m build` do), turned into a wheel without build isolation (so
the test needs no network; `make dist` uses isolation), installed into a fresh virtual
environment that holds only torch and its requirements (this environment's copies, linked, not
installed again), and used from a directory outside the source tree: `python -m fairscale_c`, a
2-rank all_reduce and two FSDP steps of examples/train_gpt.py under torchrun.
"""

import glob
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap

import pytest
from dist_utils import free_port, orphaned_segments
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import fairscale_c

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# What a clone does not have: setuptools would otherwise carry files over from an existing
# fairscale_c.egg-info/SOURCES.txt into the sdist and hide a file that MANIFEST.in misses.
NOT_IN_A_CLONE = (".git", ".venv", "build", "build-san", "dist", "*.egg-info", "__pycache__", "*.so", "*.o")


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    src, out = tmp_path_factory.mktemp("src") / "fairscale_c", tmp_path_factory.mktemp("sdist")
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(*NOT_IN_A_CLONE, ".pytest_cache"))
    code = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    r = subprocess.run([sys.executable, "-c", code, str(out)], cwd=src, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return str(out / r.stdout.strip().splitlines()[-1])


def _members(path):
    with tarfile.open(path) as tar:
        top = f"fairscale_c-{fairscale_c.__version__}/"
        names = [m.name for m in tar.getmembers() if m.isfile()]
    assert all(n.startswith(top) for n in names), names
    return {n[len(top) :] for n in names}


def test_sdist_holds_what_the_build_needs_and_nothing_else(sdist):
    assert os.path.basename(sdist) == f"fairscale_c-{fairscale_c.__version__}.tar.gz"
    members = _members(sdist)

    def rel(pattern):
        return {os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern), recursive=True)}

    needed = rel("csrc/*/*.[ch]") | rel("csrc/cuda/*.cu") | rel("csrc/cuda/*.cuh") | rel("fairscale_c/**/*.py")
    needed |= {"csrc/base/dlpack.h", "tools/build_cuda.py", "fairscale_c/py.typed", "fairscale_c/_C.pyi"}
    needed |= {"setup.py", "pyproject.toml", "README.md", "LICENSE", "MANIFEST.in"}
    assert needed - members == set()
    # Besides those: the generated metadata (PKG-INFO, setup.cfg, *.egg-info/*) only.
    generated = {m for m in members if m in ("PKG-INFO", "setup.cfg") or m.startswith("fairscale_c.egg-info/")}
    assert members - needed - generated == set()


def test_sdist_metadata_is_complete(sdist):
    with tarfile.open(sdist) as tar:
        pkg_info = tar.extractfile(f"fairscale_c-{fairscale_c.__version__}/PKG-INFO").read().decode()
    headers, _, body = pkg_info.partition("\n\n")
    fields = [line.split(": ", 1) for line in headers.splitlines() if ": " in line]
    meta = {}
    for key, value in fields:
        meta.setdefault(key, []).append(value)
    assert meta["Version"] == [fairscale_c.__version__]
    assert meta["License-Expression"] == ["MIT"] and meta["License-File"] == ["LICENSE"]
    assert meta["Requires-Python"] == [">=3.11"]
    torch_req = Requirement(meta["Requires-Dist"][0])
    assert torch_req.name == "torch" and torch_req.marker is None
    # The tested release (and its local CPU/CUDA builds) is in the range; untested ones are not.
    assert {v for v in ("2.12.1", "2.13.0", "2.13.0+cpu", "2.13.1", "2.14.0") if torch_req.specifier.contains(v)} == {
        "2.13.0",
        "2.13.0+cpu",
        "2.13.1",
    }
    assert "Programming Language :: Python :: 3.11" in meta["Classifier"]
    assert meta["Description-Content-Type"] == ["text/markdown"]
    assert body.startswith("# fairscale_c")


def _nvcc_used():
    """Whether setup.py compiles the kernels in this environment (its own rule)."""
    spec = importlib.util.spec_from_file_location("build_cuda", os.path.join(ROOT, "tools", "build_cuda.py"))
    build_cuda = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build_cuda)
    forced = os.environ.get("FAIRSCALE_C_CUDA")
    return forced == "1" or (forced != "0" and build_cuda.find_nvcc() is not None)


def _torch_only_venv(path):
    """A virtual environment (without pip) holding only torch and what torch requires, as a
    user's would: this environment's copies, linked from a folder that a .pth file puts on the
    new interpreter's path. numpy, pytest and this checkout's editable install stay out of sight,
    so a run-time need for any of them fails here. pip never uninstalls a package outside the
    environment's own site-packages, so the links are safe."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    python = str(path / "bin" / "python")
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.strip()
    linked = path / "torch-and-requirements"
    linked.mkdir()
    todo, seen = ["torch"], set()
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # a requirement of another platform or build (e.g. the CUDA wheels)
        for req in map(Requirement, dist.requires or []):
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
        for top in {f.parts[0] for f in dist.files or []} - {"..", "__pycache__"}:
            src = dist.locate_file(top)
            if os.path.exists(src) and not (linked / top).exists():
                os.symlink(src, linked / top)
    assert "torch" in seen and not (linked / "numpy").exists()
    with open(os.path.join(purelib, "torch_and_requirements.pth"), "w") as f:
        f.write(f"{linked}\n")
    return python


# Run by torchrun in the new environment: an all_reduce of fairscale_c's collective engine, then
# two FSDP steps of examples/train_gpt.py (its training function, on the same process group).
RANKS_SCRIPT = textwrap.dedent(
    """
    import importlib.util, sys
    import torch, torch.distributed as dist
    import fairscale_c, fairscale_c.distributed as fdist

    assert fairscale_c.__file__.startswith(sys.prefix), fairscale_c.__file__
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    group = fdist.init_group()
    t = torch.full((1000,), float(rank + 1))
    group.all_reduce(t)
    assert torch.equal(t, torch.full((1000,), float(sum(range(1, world + 1))))), t[:4]
    group.destroy()
    spec = importlib.util.spec_from_file_location("train_gpt", sys.argv[1])
    train_gpt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_gpt)
    args = train_gpt.parse_args(["--steps", "2", "--log-every", "1", "--ckpt-dir", sys.argv[2]])
    train_gpt.train(args, torch.device("cpu"))
    dist.destroy_process_group()
    print(f"rank {rank} ok: all_reduce {t[0].item():g}", flush=True)
    """
)


@pytest.mark.slow
def test_sdist_installs_into_a_fresh_venv_and_runs_outside_the_tree(sdist, tmp_path):
    python = _torch_only_venv(tmp_path / "venv")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(FAIRSCALE_C_TIMEOUT="60", OMP_NUM_THREADS="1")
    # What `pip install <sdist>` does, in two steps so that the build can use this environment's
    # setuptools (no network) while the new one holds only torch: build a wheel from the sdist,
    # then install it. --no-index: the torch there must satisfy the declared range, as nothing
    # may be downloaded.
    pip = [sys.executable, "-m", "pip"]
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-cache-dir", "-w", str(tmp_path), sdist]
    r = subprocess.run(build, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    (wheel,) = glob.glob(str(tmp_path / "fairscale_c-*.whl"))
    install = [*pip, "--python", python, "install", "--no-index", "--no-cache-dir", wheel]
    r = subprocess.run(install, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]

    r = subprocess.run(
        [python, "-m", "fairscale_c", "--json"], cwd=tmp_path, capture_output=True, text=True, timeout=120, env=env
    )
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["version"] == fairscale_c.__version__
    assert info["package_path"].startswith(str(tmp_path / "venv"))
    # Built with nvcc where there is one, so the kernels and tools/build_cuda.py are exercised too.
    assert info["cuda_kernels_built"] == _nvcc_used()
    r = subprocess.run(
        [python, "-c", "import importlib.metadata as m; print(m.version('fairscale_c'))"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert r.stdout.strip() == fairscale_c.__version__, r.stderr

    script = tmp_path / "ranks.py"
    script.write_text(RANKS_SCRIPT)
    before = orphaned_segments()
    cmd = [python, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2"]
    cmd += ["--master_addr=127.0.0.1", f"--master_port={free_port()}", str(script)]
    cmd += [os.path.join(ROOT, "examples", "train_gpt.py"), str(tmp_path / "ckpt")]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "rank 0 ok" in r.stdout and "rank 1 ok" in r.stdout, r.stdout
    assert "step 2/2 [" in r.stdout and "done: 2 steps" in r.stdout, r.stdout
    assert sorted(os.listdir(tmp_path / "ckpt" / "step-000002")) == ["rank-0-of-2.pt", "rank-1-of-2.pt"]
    assert orphaned_segments() <= before
