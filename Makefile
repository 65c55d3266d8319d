# fairscale_c — build, test and demo targets. Everything runs inside ./.venv.
PYTHON ?= python3
VENV   ?= .venv
VPY    := $(VENV)/bin/python
DEPS   := $(VENV)/.deps-installed

.PHONY: demo test install dist asan ctest bench bench-compare bench-tables lint clean tango fairscale-tests

# torch is pinned to 2.13.0, the release the suite runs against. pip takes the CPU build where one
# is on its path (a local wheel, or PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu);
# from PyPI alone it takes the multi-GB CUDA build (README.md).
# Rerun when this file changes, so that a venv made before gets what the list adds.
$(DEPS): Makefile
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q torch==2.13.0 numpy pytest pytest-xdist setuptools wheel
	touch $@

install: $(DEPS)
	$(VPY) -m pip install -q --no-build-isolation -e .

# dist/: the sdist, then a wheel built from it (python -m build), each in an isolated build
# environment that has only what pyproject.toml declares (setuptools, from the package index).
# The egg-info of the editable install goes first: setuptools would carry its file list over.
dist: $(DEPS)
	$(VPY) -m pip install -q build
	rm -rf fairscale_c.egg-info
	$(VPY) -m build --outdir dist .

demo: install
	$(VPY) examples/demo.py

# The suite in two parts: most tests on TEST_WORKERS pytest processes at once (pytest-xdist), then
# the ones marked `serial` alone (they kill ranks, time how soon a timeout fires, or watch which CPU
# a waiter runs on: another test's ranks would move what they measure).
TEST_WORKERS ?= 2
test: install
	$(VPY) -m pytest -q -n $(TEST_WORKERS) -m "not serial"
	$(VPY) -m pytest -q -m serial

ctest:
	$(MAKE) -C tests/c

# ASan + UBSan build of the extension in build/asan, then the C-facing tests against it.
# libstdc++ is preloaded with ASan so that ASan's __cxa_throw interceptor finds the real one when
# torch throws C++ exceptions internally (TCPStore, device parsing, meta tensors); without it ASan
# stops on an internal CHECK inside libtorch. allocator_may_return_null: a request larger than ASan
# allows (the fuzzer's 256 TiB buffer) fails as malloc would instead of aborting.
# At most 3 ranks a test (--max-world 3): the 4-rank cases are the sanitized run's slowest on 2
# cores. Their C paths are the 3-rank ones except reduce's (the root reduce stops at 3 ranks), and
# tests/c's test_shm, built with the sanitizers below, runs every op, reduce included, at 4 ranks.
# ASAN_PYTEST_ARGS adds pytest options (e.g. --durations=20).
ASAN_LIB := $(shell $(CC) -print-file-name=libasan.so)
STDCXX_LIB := $(shell $(CC) -print-file-name=libstdc++.so.6)
asan: $(DEPS)
	FAIRSCALE_C_SANITIZE=1 FAIRSCALE_C_CUDA=0 $(VPY) setup.py -q build --build-base build/asan
	cd build/asan && ln -sfn lib.* lib
	LD_PRELOAD="$(ASAN_LIB) $(STDCXX_LIB)" ASAN_OPTIONS=detect_leaks=0:abort_on_error=0:allocator_may_return_null=1 \
	UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 PYTHONPATH=build/asan/lib FAIRSCALE_C_EXPECT_BUILD=build/asan \
	$(VENV)/bin/pytest -q -p no:cacheprovider --max-world 3 $(ASAN_PYTEST_ARGS) tests/test_dlpack.py tests/test_build.py tests/test_kernels_cpu.py \
		tests/test_collectives.py tests/test_collectives_failures.py tests/test_collectives_stress.py \
		tests/test_collectives_layer.py tests/test_shm_direct.py tests/test_shm_shared.py tests/test_fsdp_api.py \
		tests/test_all_to_all.py tests/test_adam.py \
		tests/test_sync_batchnorm.py::test_c_helpers_agree_with_the_formulas_and_refuse_bad_sizes \
		tests/test_fuzz_bindings.py
	$(MAKE) -j$(shell nproc) -C tests/c ctest SANITIZE=1

# ruff for Python; clang-format 14 for C/CUDA (the PyPI wheel, so that every machine formats alike).
lint: $(DEPS)
	$(VPY) -m pip install -q ruff clang-format==14.0.6
	$(VENV)/bin/ruff check fairscale_c tests benchmarks examples setup.py tools
	$(VENV)/bin/ruff format --check fairscale_c tests benchmarks examples setup.py tools
	$(VENV)/bin/clang-format --dry-run -Werror csrc/*/*.c csrc/*/*.h csrc/cuda/*.cu csrc/cuda/*.cuh tests/c/*.c tests/c/*.h tools/*.c tools/nccl_calls/*.c

# Optional, not part of `make test`: ai2-tango 1.3.2 into .venv (torch stays 2.13.0 CPU), Tango's
# own FairScale tests through the fairscale alias with their GPU gate lifted, and 2-worker CPU
# `tango run`s of both FSDP engines compared with DDP (tools/tango/run.sh; docs/tango.md).
tango: install
	tools/tango/run.sh $(VPY)

# Optional, not part of `make test`: FairScale 0.4.13's own tests of what fairscale_c provides
# (tools/fairscale_tests/upstream), run on FairScale and on fairscale_c through the alias, compared
# test by test (tools/fairscale_tests/run.py; docs/migration.md). Needs PyPI for fairscale==0.4.13.
fairscale-tests: install
	$(VPY) tools/fairscale_tests/run.py

# The pytest-benchmark suite (benchmarks/test_*.py; docs/benchmarks.md says how to read it).
# `make bench` runs it and saves the run as JSON under benchmarks/results/<machine>/.
# `make bench-compare` runs it again, compares each case with the last saved run (or with
# BENCH_AGAINST=NNNN, a saved run's number) and fails a case whose fastest round is more than
# BENCH_TOLERANCE slower; it saves nothing, so a rerun compares with the same run. The default,
# min:100% (twice as slow), suits the shared 2-core VM (docs/benchmarks.md gives the run-to-run
# spread it is based on); on a quiet machine use e.g. BENCH_TOLERANCE=min:25%.
BENCH_DEPS      := $(VENV)/.bench-deps-installed
BENCH_TOLERANCE ?= min:100%
BENCH_AGAINST   ?=
BENCH_PYTEST    := $(VPY) -m pytest benchmarks --benchmark-only --benchmark-storage=benchmarks/results \
	--benchmark-columns=min,median,iqr,max,rounds

$(BENCH_DEPS): $(DEPS)
	$(VPY) -m pip install -q "pytest-benchmark>=4"
	touch $@

bench: install $(BENCH_DEPS)
	$(BENCH_PYTEST) --benchmark-autosave

bench-compare: install $(BENCH_DEPS)
	@ls benchmarks/results/*/[0-9]*.json >/dev/null 2>&1 || { echo "bench-compare: no saved run under benchmarks/results: run 'make bench' first"; exit 1; }
	$(BENCH_PYTEST) $(if $(BENCH_AGAINST),--benchmark-compare=$(BENCH_AGAINST),--benchmark-compare) \
		--benchmark-compare-fail=$(BENCH_TOLERANCE)

# The side-by-side tables of docs/benchmarks.md come from the standalone scripts.
bench-tables: install
	$(VPY) benchmarks/collectives.py --quick

clean:
	rm -rf build dist fairscale_c/*.so *.egg-info
