# fairscale_c — build, test and demo targets. Everything runs inside ./.venv.
PYTHON ?= python3
VENV   ?= .venv
VPY    := $(VENV)/bin/python
DEPS   := $(VENV)/.deps-installed

.PHONY: demo test install asan ctest bench lint clean

# torch is pinned: the CPU build of 2.13.0 (an unpinned torch pulls a multi-GB CUDA build).
$(DEPS):
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q torch==2.13.0 numpy pytest setuptools wheel
	touch $@

install: $(DEPS)
	$(VPY) -m pip install -q --no-build-isolation -e .

demo: install
	$(VPY) examples/demo.py

test: install
	$(VPY) -m pytest -q

ctest:
	$(MAKE) -C tests/c

# ASan + UBSan build of the extension in build/asan, then the C-facing tests against it.
# test_peer_that_never_joins and test_device_arguments_must_parse are left out: there torch throws
# a C++ exception (TCPStore, device parsing), which trips an internal CHECK in ASan's __cxa_throw
# interceptor inside libtorch (not in our code).
ASAN_LIB := $(shell $(CC) -print-file-name=libasan.so)
asan: $(DEPS)
	FAIRSCALE_C_SANITIZE=1 FAIRSCALE_C_CUDA=0 $(VPY) setup.py -q build --build-base build/asan
	cd build/asan && ln -sfn lib.* lib
	LD_PRELOAD=$(ASAN_LIB) ASAN_OPTIONS=detect_leaks=0:abort_on_error=0 \
	UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 PYTHONPATH=build/asan/lib FAIRSCALE_C_EXPECT_BUILD=build/asan \
	$(VENV)/bin/pytest -q -p no:cacheprovider tests/test_dlpack.py tests/test_build.py tests/test_kernels_cpu.py \
		tests/test_collectives.py tests/test_collectives_failures.py tests/test_collectives_stress.py tests/test_fsdp_api.py \
		-k "not test_peer_that_never_joins and not test_device_arguments_must_parse"
	$(MAKE) -C tests/c ctest SANITIZE=1

# ruff for Python; clang-format (Debian's clang-format package) for C/CUDA.
lint: $(DEPS)
	$(VPY) -m pip install -q ruff
	$(VENV)/bin/ruff check fairscale_c tests benchmarks examples setup.py tools
	$(VENV)/bin/ruff format --check fairscale_c tests benchmarks examples setup.py tools
	clang-format --dry-run -Werror csrc/*/*.c csrc/*/*.h csrc/cuda/*.cu csrc/cuda/*.cuh tests/c/*.c tests/c/*.h

bench: install
	$(VPY) benchmarks/collectives.py --quick

clean:
	rm -rf build fairscale_c/*.so *.egg-info
