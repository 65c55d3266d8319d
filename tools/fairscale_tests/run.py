"""FairScale 0.4.13's own tests, run against FairScale itself and against fairscale_c, compared.

    make fairscale-tests          # or: .venv/bin/python tools/fairscale_tests/run.py [-k EXPR] [FILE ...]

1. Checks the vendored test files (upstream/, byte for byte as at FairScale v0.4.13) against their
   git blob ids, and installs FairScale 0.4.13 from PyPI into build/fairscale-0.4.13 and
   `parameterized` (which some of the tests import) into build/fairscale-tests-deps, without
   dependencies (torch stays the venv's), if they are not there.
2. Runs the files twice with pytest, each in a scratch copy: once with FairScale on the path (the
   reference), once with fairscale_c serving ``import fairscale`` (boot/sitecustomize.py: the
   compat alias, with FairScale's own test helpers for what fairscale_c does not provide).
3. Compares the outcomes test by test. A test that passes on FairScale and not on fairscale_c is a
   difference; expected.txt lists the known ones with the reason (an intended behaviour, said in
   docs/). Prints a table per file and every difference.

Exits 1 when a difference is not in expected.txt, when a run did not finish, or (in a run of every
file without -k) when an entry of expected.txt no longer occurs (the list must stay true); 0
otherwise. Tests that fail on both sides (FairScale's
tests against today's torch and pytest) are counted, not judged.
"""

import argparse
import fnmatch
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
UPSTREAM = HERE / "upstream"
REFERENCE = ROOT / "build" / "fairscale-0.4.13"
DEPS = ROOT / "build" / "fairscale-tests-deps"  # TEST_DEPS, on both sides' path
VERSION = "0.4.13"
# What FairScale's vendored tests import besides torch and pytest, and what its wgit needs (pygit2,
# with cffi and pycparser, and pgzip); fairscale_c's wgit needs none of them.
TEST_DEPS = ["parameterized==0.9.0", "pygit2==1.21.0", "cffi==2.1.1", "pycparser==3.12", "pgzip==0.4.0"]
PASSED = {"passed", "xfailed"}  # xfail: the test's own expectation of a failure held


def check_blobs() -> list:
    """The vendored files, each checked against its git blob id (computed without git)."""
    files = []
    for line in (UPSTREAM / "BLOBS").read_text().splitlines():
        blob, name = line.split(None, 1)
        data = (UPSTREAM / name).read_bytes()
        if hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() != blob:
            sys.exit(f"fairscale-tests: {name} differs from FairScale v{VERSION}'s (blob {blob})")
        files.append(name)
    return files


def _pip_target(python: str, target: Path, what: list) -> None:
    print(f"fairscale-tests: installing {' '.join(what)} into {target} (no dependencies)", flush=True)
    shutil.rmtree(target, ignore_errors=True)
    cmd = [python, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), *what]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"fairscale-tests: could not install {' '.join(what)}:\n{proc.stdout}{proc.stderr}")


def ensure_reference(python: str) -> None:
    version = REFERENCE / "fairscale" / "version.py"
    if not (version.is_file() and f"({VERSION.replace('.', ', ')})" in version.read_text()):  # __version_tuple__
        _pip_target(python, REFERENCE, [f"fairscale=={VERSION}"])
        if not version.is_file():
            sys.exit(f"fairscale-tests: fairscale=={VERSION} did not install into {REFERENCE}")
    if not all((DEPS / name).is_dir() for name in ("parameterized", "pygit2", "cffi", "pgzip")):
        _pip_target(python, DEPS, TEST_DEPS)


def run_side(side: str, python: str, tests: list, extra: list, timeout: float):
    """Run the tests in a scratch copy; return their outcomes (None if the run did not end)."""
    scratch = Path(tempfile.mkdtemp(prefix=f"fairscale-tests-{side}-"))
    try:
        shutil.copytree(UPSTREAM / "tests", scratch / "tests")
        launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
        env = {k: v for k, v in os.environ.items() if k not in launcher}
        if side == "fairscale":
            env["PYTHONPATH"] = os.pathsep.join([str(REFERENCE), str(DEPS)])
        else:
            env["PYTHONPATH"] = os.pathsep.join([str(HERE / "boot"), str(ROOT), str(DEPS)])
            env["FAIRSCALE_C_REFERENCE"] = str(REFERENCE)
        env.setdefault("FAIRSCALE_C_TIMEOUT", "120")
        xml = scratch / "results.xml"
        cmd = [python, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--continue-on-collection-errors"]
        cmd += ["-o", "junit_family=xunit1", f"--junitxml={xml}", *extra, *tests]
        print(f"fairscale-tests: {side}: pytest {' '.join(cmd[6:])}", flush=True)
        try:
            proc = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"fairscale-tests: {side}: no result within {timeout:.0f} s", flush=True)
            return None
        (ROOT / "build").mkdir(exist_ok=True)
        log = ROOT / "build" / f"fairscale-tests-{side}.log"
        log.write_text(proc.stdout + proc.stderr)
        last = (proc.stdout.strip().splitlines() or [""])[-1]
        print(f"fairscale-tests: {side}: {last} (log: {log.relative_to(ROOT)})", flush=True)
        return outcomes(xml) if xml.is_file() else None
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def outcomes(xml: Path) -> dict:
    """test id (path::name) -> passed | failed | error | skipped | xfailed."""
    result = {}
    for case in ET.parse(xml).iter("testcase"):
        cls, name = case.get("classname") or "", case.get("name")
        if cls:
            module, klass = cls, ""
            parts = cls.split(".")
            for i in range(len(parts), 0, -1):  # the longest prefix that is a vendored file
                if (UPSTREAM / Path(*parts[:i])).with_suffix(".py").is_file():
                    module, klass = "/".join(parts[:i]) + ".py", "::".join(parts[i:])
                    break
            tid = f"{module}::{klass + '::' if klass else ''}{name}"
        else:  # a file that could not be collected
            tid = name.replace(".", "/") + ".py::(collection)"
        state = "passed"
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                kind = (node.get("type") or "") + " " + (node.get("message") or "")
                state = {"failure": "failed", "error": "error"}.get(tag, "xfailed" if "xfail" in kind else "skipped")
                break
        result[tid] = state
    return result


def load_expected() -> list:
    rows = []
    for line in (HERE / "expected.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            pattern, _, reason = line.partition("  ")
            rows.append((pattern.strip(), reason.strip()))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", help="vendored test files (default: all), e.g. tests/optim/test_oss.py")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    parser.add_argument("--timeout", type=float, default=1500, help="seconds per side (default 1500)")
    args = parser.parse_args()
    python = sys.executable
    files = check_blobs()
    vendored = sorted(f for f in files if f.startswith("tests/") and Path(f).name.startswith("test_"))
    unknown = [f for f in args.files if f not in vendored]
    if unknown:
        parser.error(f"not a vendored test file: {', '.join(unknown)} (they are named as in BLOBS, e.g. {vendored[0]})")
    tests = args.files or vendored
    extra = ["-k", args.keyword] if args.keyword else []
    ensure_reference(python)
    ref = run_side("fairscale", python, tests, extra, args.timeout)
    ours = run_side("fairscale_c", python, tests, extra, args.timeout)
    if ref is None or ours is None:
        return 1
    expected = load_expected()

    per_file: dict = {}
    differences, better, seen_patterns = [], [], set()
    for tid in sorted(set(ref) | set(ours)):
        a, b = ref.get(tid, "absent"), ours.get(tid, "absent")
        c = per_file.setdefault(tid.split("::")[0], Counter())
        c["tests"] += 1
        if a in PASSED and b in PASSED:
            c["pass both"] += 1
        elif a in PASSED:
            c["FairScale only"] += 1
            reason = next((r for p, r in expected if fnmatch.fnmatchcase(tid, p)), None)
            seen_patterns.update(p for p, _ in expected if fnmatch.fnmatchcase(tid, p))
            differences.append((tid, b, reason))
        elif b in PASSED:
            c["fairscale_c only"] += 1
            better.append((tid, a))
        elif a == b == "skipped":
            c["skipped both"] += 1
        else:
            c["fail both"] += 1

    columns = ["tests", "pass both", "FairScale only", "fairscale_c only", "fail both", "skipped both"]
    print("\n| file | " + " | ".join(columns) + " |\n|---|" + "---|" * len(columns))
    for name, c in sorted(per_file.items()):
        print(f"| {name} | " + " | ".join(str(c[k]) for k in columns) + " |")
    total = sum(per_file.values(), Counter())
    print("| all | " + " | ".join(str(total[k]) for k in columns) + " |")

    unexpected = [d for d in differences if d[2] is None]
    if differences:
        print("\nPassing on FairScale, not on fairscale_c:")
        for tid, b, reason in differences:
            print(f"  {tid}: {b}" + (f"  (expected: {reason})" if reason else "  UNEXPECTED"))
    if better:
        print("\nPassing on fairscale_c, not on FairScale:")
        for tid, a in better:
            print(f"  {tid}: FairScale {a}")
    stale = [p for p, _ in expected if p not in seen_patterns]
    if stale and not args.files and not args.keyword:
        print("\nIn expected.txt but not a difference in this run (remove or correct them):")
        for p in stale:
            print(f"  {p}")
    else:
        stale = []
    known = len(differences) - len(unexpected)
    print(f"\nfairscale-tests: {len(unexpected)} unexpected difference(s), {known} expected")
    if total["tests"] == 0:
        print("fairscale-tests: no test ran", flush=True)
        return 1
    return 1 if unexpected or stale else 0


if __name__ == "__main__":
    sys.exit(main())
