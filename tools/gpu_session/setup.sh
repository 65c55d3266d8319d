# Source it on the GPU machine, from the repository root, with .gpu carried over:
#
#   . tools/gpu_session/setup.sh
#
# Puts .gpu/libnccl.so.2.xz (tools/gpu_session/prepare.sh) in place of the libnccl.so.2 of the
# nvidia-nccl-cu13 wheel that python3's torch depends on (the first time, the wheel's own copy is
# kept as libnccl.so.2.orig), so that our backend and torch load the same NCCL; sets
# NCCL_MULTI_RANK_GPU_ENABLE=1 (two ranks on one GPU) and prints the version NCCL reports.
# Returns non-zero, changing nothing, when a piece is missing.
_fsc_gpu_setup() {
    local py=${PYTHON:-python3} lib
    if [ ! -f .gpu/libnccl.so.2.xz ]; then
        echo "setup.sh: no .gpu/libnccl.so.2.xz (run tools/gpu_session/prepare.sh first and carry .gpu)" >&2
        return 2
    fi
    lib=$("$py" -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))') || {
        echo "setup.sh: $py has no nvidia-nccl wheel (import nvidia.nccl failed)" >&2
        return 2
    }
    [ -f "$lib/libnccl.so.2.orig" ] || cp "$lib/libnccl.so.2" "$lib/libnccl.so.2.orig" || return 2
    xz -dc .gpu/libnccl.so.2.xz >"$lib/libnccl.so.2.new" && mv "$lib/libnccl.so.2.new" "$lib/libnccl.so.2" || return 2
    export NCCL_MULTI_RANK_GPU_ENABLE=1
    "$py" - "$lib/libnccl.so.2" <<'PYEOF'
import ctypes, sys
v = ctypes.c_int()
ctypes.CDLL(sys.argv[1]).ncclGetVersion(ctypes.byref(v))
print(f"setup.sh: {sys.argv[1]} is NCCL {v.value // 10000}.{v.value // 100 % 100}.{v.value % 100}")
PYEOF
}
_fsc_gpu_setup
