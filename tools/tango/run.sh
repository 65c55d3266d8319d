#!/usr/bin/env bash
# `make tango` (optional; not part of `make test`). docs/tango.md describes what it shows.
#   1. installs ai2-tango 1.3.2 into the venv with torch held at the venv's 2.13.0 CPU build (a pip
#      constraint; Tango's base dependencies do not pin torch), and checks torch afterwards;
#   2. runs Tango's own FairScale-integration tests (tools/tango/upstream, v1.3.2, checked against
#      their git blob ids) with their CUDA gate lifted, through the fairscale alias;
#   3. runs tools/tango/run.py: 2-worker CPU `tango run`s with Tango's "fairscale" engine (through
#      the alias) and the "fairscale_c" engine, compared with Tango's torch (DDP) engine.
# Exits non-zero when Tango cannot be installed (saying why) or when any test or check fails.
set -u -o pipefail

VPY=${1:-.venv/bin/python}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
HERE=$ROOT/tools/tango
TANGO_VERSION=1.3.2
TORCH_VERSION=2.13.0

die() { echo "make tango: $*" >&2; exit 1; }

[ -x "$VPY" ] || die "no Python at $VPY (run 'make install' first)"
VPY=$(cd "$(dirname "$VPY")" && pwd)/$(basename "$VPY")  # the tests run in a scratch folder
torch_build() { "$VPY" -c 'import torch; print(torch.__version__, "cuda" if torch.version.cuda else "cpu")'; }
before=$(torch_build) || die "torch is not importable from $VPY"
case "$before" in
    "$TORCH_VERSION"*" cpu") ;;
    *) die "expected torch $TORCH_VERSION (CPU build) in the venv, found: $before" ;;
esac

start=$(date +%s)
have=$("$VPY" -c 'import importlib.metadata as m; print(m.version("ai2-tango"))' 2>/dev/null || true)
if [ "$have" != "$TANGO_VERSION" ]; then
    echo "make tango: installing ai2-tango $TANGO_VERSION (torch held at $TORCH_VERSION)"
    constraints=$(mktemp)
    echo "torch==$TORCH_VERSION" > "$constraints"
    log=$(mktemp)
    if ! "$VPY" -m pip install -q --no-cache-dir --retries 1 --timeout 60 -c "$constraints" \
            "ai2-tango==$TANGO_VERSION" > "$log" 2>&1; then
        tail -n 15 "$log" >&2
        rm -f "$constraints" "$log"
        die "could not install ai2-tango $TANGO_VERSION into $(dirname "$(dirname "$VPY")") (pip's last lines above)"
    fi
    rm -f "$constraints" "$log"
fi
after=$(torch_build) || die "torch is no longer importable after installing ai2-tango"
[ "$after" = "$before" ] || die "installing ai2-tango changed torch: $before -> $after"
"$VPY" -c 'import tango.integrations.torch' || die "ai2-tango $TANGO_VERSION is installed but does not import"
echo "make tango: ai2-tango $("$VPY" -c 'import importlib.metadata as m; print(m.version("ai2-tango"))'), torch $after"

# Tango's files, byte for byte as at v1.3.2 (git blob ids, computed without git).
"$VPY" - "$HERE/upstream" <<'EOF' || die "tools/tango/upstream differs from Tango v1.3.2 (see above)"
import hashlib, pathlib, sys
root = pathlib.Path(sys.argv[1])
bad = []
for line in (root / "BLOBS").read_text().splitlines():
    blob, name = line.split(None, 1)
    data = (root / name).read_bytes()
    if hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() != blob:
        bad.append(name)
if bad:
    sys.exit(f"modified: {bad}")
EOF

# Outside the repository: Tango records the git state of its working directory and fails on a
# repository without an "origin" remote; it also imports *.py there when a name is unknown.
scratch=$(mktemp -d "${TMPDIR:-/tmp}/fsc-make-tango.XXXXXX")
status=0
echo
echo "== 1. Tango $TANGO_VERSION's FairScale tests, GPU gate lifted, through python -m fairscale_c.compat"
t0=$(date +%s)
(cd "$scratch" && "$VPY" -m fairscale_c.compat -m pytest -q -p no:cacheprovider --rootdir "$ROOT" \
    -c "$ROOT/pyproject.toml" "$HERE/upstream/tests/integrations/fairscale/train_test.py" 2>&1) \
    | tee "$scratch/upstream.log" | grep -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed|error|lifted|^tools/tango" \
    | grep -vE "Error saving pip packages|^\s*$" || true
grep -qE "^[0-9]+ passed in" "$scratch/upstream.log" && ! grep -qE "failed|error" <(tail -n 1 "$scratch/upstream.log") \
    || { status=1; echo "make tango: Tango's tests failed (log: $scratch/upstream.log)"; }
echo "(Tango's tests: $(( $(date +%s) - t0 )) s)"

echo
echo "== 2. 2-worker CPU tango runs: fairscale (alias) and fairscale_c engines vs DDP"
"$VPY" "$HERE/run.py" --out "$scratch/runs" || status=1

echo
if [ $status -eq 0 ]; then
    echo "make tango: all passed in $(( $(date +%s) - start )) s (logs: $scratch)"
else
    echo "make tango: FAILED after $(( $(date +%s) - start )) s (logs: $scratch)"
fi
exit $status
