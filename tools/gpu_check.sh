#!/usr/bin/env bash
# Build fairscale_c on a CUDA machine and run what needs a GPU, one log per step.
#
#   tools/gpu_check.sh LOGDIR [STEP...]
#
# Steps (default: env build tests demo sanitizer): those and bench coll coll_blocking nccl_calls oss
# cpu_coll cpu_pipe pipe_tests pipe_cuda.
# Each step runs under a time limit and goes on after a failure; the last lines print one status
# line per step (LOGDIR/summary.txt keeps them). The tests step runs TESTS_SHARDS pytest processes.
# PYTHON picks the interpreter (default python3); BENCH_ARGS are extra benchmarks/fsdp.py flags
# (with one GPU, --world 2 needs NCCL >= 2.30 and NCCL_MULTI_RANK_GPU_ENABLE=1 in the environment).
# MPS=1 runs every step under an MPS server started here and stopped at the end (needs root): ranks
# sharing a GPU then run their kernels at the same time instead of time-slicing the GPU, which is
# what makes one-GPU collective and world-2 timings mean something (docs/gpu.md, 2026-11-25). Run
# the tests step without it: world-2 FSDP tests build two NCCL communicators per rank, which
# deadlocked under MPS with the ranks sharing a GPU.
set -u
LOG=${1:?usage: tools/gpu_check.sh LOGDIR [STEP...]}
shift
STEPS=${*:-env build tests demo sanitizer}
PY=${PYTHON:-python3}
mkdir -p "$LOG"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
SUMMARY="$LOG/summary.txt"
: >"$SUMMARY"

run_step() {  # name limit_s command...
    local name=$1 limit=$2 start rc
    shift 2
    start=$(date +%s)
    echo "=== $name: $*"
    timeout -k 10 "$limit" "$@" >"$LOG/$name.log" 2>&1
    rc=$?
    echo "$name rc=$rc $(($(date +%s) - start))s" >>"$SUMMARY"
    tail -n "${TAIL:-12}" "$LOG/$name.log"
}

if [ "${MPS:-0}" = 1 ]; then
    export CUDA_MPS_PIPE_DIRECTORY="$LOG/mps-pipe" CUDA_MPS_LOG_DIRECTORY="$LOG/mps-log"
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d || { echo "MPS=1: nvidia-cuda-mps-control -d failed" >&2; exit 2; }
    trap 'echo quit | nvidia-cuda-mps-control' EXIT
    echo "(under MPS)" >>"$SUMMARY"
fi

for step in $STEPS; do
    case $step in
    env)
        run_step env 60 bash -c "date -u; nvidia-smi; $PY -c 'import sys, torch; print(sys.version); \
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, \"nccl\", torch.cuda.nccl.version(), \
torch.cuda.get_device_name(0))'; $PY -m pip list 2>/dev/null | grep -i -E 'nccl|^torch |pytest'; \
nvcc --version | tail -2; command -v compute-sanitizer"
        ;;
    build)
        run_step build "${BUILD_LIMIT:-400}" bash -c "$PY setup.py build_ext --inplace && $PY -c 'import fairscale_c, json; \
print(json.dumps(fairscale_c.build_info(), indent=1, default=str))'"
        ;;
    tests)
        # the files with GPU tests in TESTS_SHARDS pytest processes at once (default 3; the GPU tests
        # took 90 s so on an H200, against about 300 s in one process), one log per shard
        n=${TESTS_SHARDS:-3}
        mapfile -t files < <(grep -l "mark.gpu" tests/test_*.py)
        for ((i = 0; i < n; i++)); do
            shard=()
            for ((j = i; j < ${#files[@]}; j += n)); do shard+=("${files[j]}"); done
            [ ${#shard[@]} -gt 0 ] && run_step "tests_$i" "${TESTS_LIMIT:-420}" "$PY" -m pytest -v -rs -m gpu \
                --durations=10 -p no:cacheprovider "${shard[@]}" &
        done
        wait
        ;;
    demo)
        run_step demo 240 "$PY" examples/demo.py --device cuda --world "${DEMO_WORLD:-1}" --steps 20
        ;;
    sanitizer)
        # API errors are left out: NCCL and torch probe the driver with calls that fail by design.
        run_step memcheck 400 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 \
            "$PY" -m pytest -q -x -m gpu tests/test_cuda.py -k "not nccl"
        run_step memcheck_fsdp 400 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 3 \
            "$PY" -m pytest -q -x -m gpu "tests/test_fsdp_cuda.py::test_fsdp_on_cuda_matches_pytorch[1]" \
            "tests/test_fsdp_cuda.py::test_group_routes_cuda_tensors_to_nccl[1]"
        run_step racecheck 400 compute-sanitizer --tool racecheck --error-exitcode 3 \
            "$PY" -m pytest -q -x -m gpu tests/test_cuda.py -k "(norm or unscale) and not 419"
        ;;
    coll)
        # 2 ranks: two GPUs, or one with NCCL >= 2.30 and NCCL_MULTI_RANK_GPU_ENABLE=1 set
        run_step coll 400 "$PY" benchmarks/collectives.py --device cuda --worlds 2 --sizes 1M 16M 256M \
            --json "$LOG/collectives_cuda.json"
        ;;
    coll_blocking)
        # the same, alternating non-blocking and blocking (default) NCCL communicators
        for i in 1 2; do
            for b in 0 1; do
                FAIRSCALE_C_NCCL_BLOCKING=$b run_step "coll_b${b}_$i" 200 "$PY" benchmarks/collectives.py \
                    --device cuda --worlds 2 --sizes 8 4K 64K 1M 16M 256M --json "$LOG/collectives_cuda_b${b}_$i.json"
            done
        done
        ;;
    nccl_calls)
        # host cost of one small all_reduce, ours and torch's, with threads started and yields per
        # call, in both communicator modes (tools/nccl_calls/probe.py; 2 ranks, as for coll)
        cc -shared -fPIC -O2 -o "$LOG/callcount.so" tools/nccl_calls/callcount.c -ldl
        for b in 1 0; do
            FAIRSCALE_C_NCCL_BLOCKING=$b LD_PRELOAD="$LOG/callcount.so" run_step "nccl_calls_b$b" 120 \
                "$PY" tools/nccl_calls/probe.py --device cuda
        done
        ;;
    oss)
        # OSS + ShardedDataParallel against FairScale, ZeRO and DDP, deterministic kernels (loss check)
        run_step oss 500 "$PY" benchmarks/oss.py --device cuda --deterministic --out "$LOG/oss_cuda.json"
        ;;
    pipe_tests)
        # the pipeline-stage GPU tests alone (interleaved 1F1B and looped BFS with 4 MiB messages among
        # them): worth running under MPS too, where both ranks' kernels run at once
        run_step pipe_tests 300 "$PY" -m pytest -v -rs -m gpu tests/test_pipe_stages.py
        ;;
    pipe_cuda)
        # multi-process pipeline stages on NCCL against torch.distributed.pipelining, one run per schedule
        # family, so that a hang in one (a framework whose sends wait for receives queued behind its
        # own, docs/pipe_stages.md) costs only that run
        for s in "gpipe 1f1b" interleaved looped_bfs; do
            # shellcheck disable=SC2086
            run_step "pipe_cuda_${s%% *}" 240 "$PY" benchmarks/pipe_stages.py --device cuda --microbatches 4 8 \
                --rounds 3 --schedules $s --out "$LOG/pipe_stages_cuda_${s%% *}.json"
        done
        ;;
    cpu_coll)
        # the shared-memory engine's large-message targets on this machine's quieter, larger CPU
        run_step cpu_coll 560 "$PY" benchmarks/collectives.py --worlds 2 4 --sizes 16M 64M 256M --repeats 5 \
            --json "$LOG/collectives_cpu.json"
        ;;
    cpu_pipe)
        # single-process Pipe against FairScale's (on PYTHONPATH), with and without thread sharing
        run_step cpu_pipe 500 "$PY" benchmarks/pipe.py single --unshared --out "$LOG/pipe_cpu.json"
        ;;
    bench)
        # shellcheck disable=SC2086
        run_step bench 540 "$PY" benchmarks/fsdp.py --device cuda ${BENCH_ARGS:-} --out "$LOG/fsdp_cuda.json"
        ;;
    *)
        echo "unknown step: $step" >&2
        exit 2
        ;;
    esac
done
echo
cat "$SUMMARY"
