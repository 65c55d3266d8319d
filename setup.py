"""Build fairscale_c._C: one C11 extension; CUDA kernels embedded as a fatbin when nvcc is found."""

import glob
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, find_packages, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def read_version():
    """The version in fairscale_c/_version.py (pyproject.toml reads the same line)."""
    with open(os.path.join(ROOT, "fairscale_c", "_version.py")) as f:
        match = re.search(r'^__version__ = "([^"]+)"$', f.read(), re.MULTILINE)
    if match is None:
        raise RuntimeError("fairscale_c/_version.py has no __version__ line")
    return match.group(1)


VERSION = read_version()


def cuda_wanted():
    """FAIRSCALE_C_CUDA=0|1 forces the choice; otherwise build kernels when nvcc is found."""
    forced = os.environ.get("FAIRSCALE_C_CUDA")
    if forced not in (None, "", "0", "1"):
        raise RuntimeError(f"FAIRSCALE_C_CUDA={forced!r}: expected 0 (no CUDA kernels), 1 (require nvcc) or unset")
    if forced == "0":
        return None, None
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import build_cuda  # noqa: E402  (tools/ is not a package on purpose)

    nvcc = build_cuda.find_nvcc()
    if forced == "1" and nvcc is None:
        raise RuntimeError("FAIRSCALE_C_CUDA=1 but nvcc was not found (set CUDA_HOME or put nvcc on PATH)")
    return nvcc, build_cuda


def compile_in_parallel(compile_one, jobs):
    """The compiler's `compile`, one source file per call on `jobs` threads (each call runs the
    compiler as a subprocess); the objects come back in the order of the sources, as from one
    call. setuptools compiles the sources of one extension one after another."""

    def compile(sources, *args, **kwargs):
        if jobs < 2 or len(sources) < 2:
            return compile_one(sources, *args, **kwargs)
        with ThreadPoolExecutor(jobs) as pool:
            parts = list(pool.map(lambda src: compile_one([src], *args, **kwargs), sources))
        return [obj for objs in parts for obj in objs]

    return compile


class BuildExt(build_ext):
    """Adds the embedded-fatbin source when nvcc is available, sanitizer flags on request, and
    compiles the C sources in parallel (`-j N` / `--parallel N`; by default one job per CPU)."""

    def build_extensions(self):
        jobs = int(self.parallel) if self.parallel else len(os.sched_getaffinity(0))
        self.parallel = None  # the jobs go to the sources of our one extension, not to extensions
        self.compiler.compile = compile_in_parallel(self.compiler.compile, jobs)
        nvcc, build_cuda = cuda_wanted()
        # setuptools decides what to rebuild from source timestamps alone, so a switch of
        # FAIRSCALE_C_CUDA or FAIRSCALE_C_SANITIZE forces a rebuild, in its own object folder.
        flavour = ("cuda" if nvcc else "cpu") + ("-sanitize" if os.environ.get("FAIRSCALE_C_SANITIZE") else "")
        stamp = os.path.join(self.build_temp, "flavour")
        if not os.path.exists(stamp) or open(stamp).read() != flavour:
            self.force = True
        os.makedirs(self.build_temp, exist_ok=True)
        with open(stamp, "w") as f:
            f.write(flavour)
        self.build_temp = os.path.join(self.build_temp, flavour)
        for ext in self.extensions:
            if nvcc is not None:
                out_c = os.path.join(self.build_temp, "fsc_cuda_fatbin.c")
                os.makedirs(self.build_temp, exist_ok=True)
                build_cuda.build_fatbin(nvcc, sorted(glob.glob("csrc/cuda/*.cu")), out_c, self.build_temp)
                ext.sources.append(out_c)
                ext.define_macros.append(("FSC_WITH_CUDA_KERNELS", "1"))
            if os.environ.get("FAIRSCALE_C_SANITIZE"):
                flags = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-O1", "-g"]
                ext.extra_compile_args += flags
                ext.extra_link_args += ["-fsanitize=address,undefined"]
        super().build_extensions()


def subsystem_macros():
    # Binding-layer subsystems register themselves from module.c when their file is present.
    macros = [("FSC_VERSION", '"%s"' % VERSION)]
    for name in ("comm", "gpu", "nccl"):
        if os.path.exists(os.path.join(ROOT, "csrc", "py", name + ".c")):
            macros.append(("FSC_HAVE_" + name.upper(), "1"))
    return macros


ext = Extension(
    "fairscale_c._C",
    sources=sorted(glob.glob("csrc/*/*.c")),  # base, comm, gpu (the core) and py (the binding layer)
    include_dirs=["csrc"],
    define_macros=subsystem_macros(),
    extra_compile_args=[
        "-std=c11",
        "-O3",
        "-fno-math-errno",  # no errno from sqrtf & co., so their loops vectorise (nothing reads it)
        "-Wall",
        "-Wextra",
        "-D_GNU_SOURCE",
        "-fvisibility=hidden",
        "-fno-strict-aliasing",
    ],
    libraries=["pthread", "dl", "rt"],
)

setup(
    packages=find_packages(include=["fairscale_c", "fairscale_c.*"]),
    package_data={"fairscale_c": ["py.typed", "_C.pyi"]},
    ext_modules=[ext],
    cmdclass={"build_ext": BuildExt},
)
