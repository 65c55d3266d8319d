#!/usr/bin/env bash
# Run on a machine with the package index, before a GPU session: puts in .gpu/ the NCCL library
# that tools/gpu_session/setup.sh installs on the GPU machine (which cannot reach the index).
#
#   tools/gpu_session/prepare.sh      # NCCL 2.32.3 for sm_90 (H100, H200): .gpu/libnccl.so.2.xz
#
# NCCL_VERSION and ARCH choose others. Two ranks on one GPU need NCCL >= 2.30; the GPU machine's
# torch wheel brings an older one. PyPI's library is 344 MB; tools/slim_nccl.py keeps the device
# code of one architecture, and stripped and compressed it is about 34 MB, small enough to carry.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
VER=${NCCL_VERSION:-2.32.3}
ARCH=${ARCH:-90}
for tool in unzip strip xz; do
    command -v "$tool" >/dev/null || { echo "prepare.sh: needs $tool" >&2; exit 2; }
done
DL=$(mktemp -d)
trap 'rm -rf "$DL"' EXIT
mkdir -p .gpu
"$PY" -m pip download -q --no-deps "nvidia-nccl-cu13==$VER" -d "$DL"
unzip -q -d "$DL" "$DL"/nvidia_nccl_cu13-"$VER"-*.whl nvidia/nccl/lib/libnccl.so.2
"$PY" tools/slim_nccl.py "$DL/nvidia/nccl/lib/libnccl.so.2" "$DL/libnccl.so.2" --arch "$ARCH"
strip --strip-debug "$DL/libnccl.so.2"
xz -T0 -c "$DL/libnccl.so.2" >.gpu/libnccl.so.2.xz.tmp
mv .gpu/libnccl.so.2.xz.tmp .gpu/libnccl.so.2.xz
echo "$VER sm_$ARCH" >.gpu/nccl-version
ls -l .gpu/libnccl.so.2.xz
