"""wgit benchmark: fairscale_c.experimental.wgit against FairScale 0.4.13's wgit (pygit2 and pgzip),
on the same checkpoints, in the same run.

    PYTHONPATH=. python benchmarks/wgit.py            # a 256 MiB checkpoint, 3 versions, 3 rounds
    PYTHONPATH=. python benchmarks/wgit.py --quick    # 8 MiB, 2 rounds

Each round, each framework runs in a fresh process (their order alternating round by round) in an
empty directory, on checkpoints written before the round (torch.save of a dict of fp32 tensors,
``--tensors`` of them; from one version to the next, a quarter of the tensors change and the
rest stay equal, as between training checkpoints whose frozen layers do not move):

- add + commit: ``Repo.add(file)`` (per-tensor, gzip; the defaults) and ``Repo.commit`` of every
  version in turn, seconds per version;
- read: in a fresh process, every tensor of the last version back from the store (``SHA1_Store.get`` of the version's
  object and of each tensor it references), seconds;
- store MiB: bytes under ``.wgit/sha1_store`` at the end;
- add peak MiB, read peak MiB: the rise of the process's resident high-water mark over its
  resident size after the imports, in the process that adds and commits and in a fresh one that
  reads. Both include the checkpoint itself (loaded by add, returned by the read).

Both libraries store each tensor as the same object under the same SHA1 (checked: the last
version's tensor SHA1s are compared); a version's own object differs (it names each library's
tensor-reference class), so the store sizes differ by that and by compression. FairScale is skipped, and said so,
when it, pygit2 or pgzip cannot be imported. Results go to stdout (a table) and
benchmarks/results/wgit.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results" / "wgit.json"


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _repo_module(framework: str) -> Any:
    if framework == "fairscale":
        from fairscale.experimental.wgit import repo
    else:
        from fairscale_c.experimental.wgit import repo
    return repo


def worker(framework: str, workdir: str, versions: int, mode: str) -> Dict[str, Any]:
    """One framework's run in this process: "add" adds and commits every version; "read" reads
    the last version's tensors back from the store (in a fresh process, after "add")."""
    import torch

    repo_mod = _repo_module(framework)
    os.chdir(workdir)
    base_rss = _rss_kib("VmRSS")
    if mode == "add":
        repo = repo_mod.Repo(Path.cwd(), init=True)
        add_s = []
        for v in range(versions):
            os.replace(f"v{v}.pt", "ckpt.pt")
            t0 = time.perf_counter()
            repo.add("ckpt.pt")
            repo.commit(f"version {v}")
            add_s.append(time.perf_counter() - t0)
        store_bytes = sum(p.stat().st_size for p in Path(".wgit/sha1_store").rglob("*") if p.is_file())
        return {
            "add_commit_s": add_s,
            "store_mib": store_bytes / 2**20,
            "add_peak_mib": (_rss_kib("VmHWM") - base_rss) / 1024,
        }
    store = repo_mod.Repo(Path.cwd())._sha1_store
    meta = json.loads(Path(".wgit", Path.cwd().name, "ckpt.pt").read_text())
    t0 = time.perf_counter()
    top = store.get(meta["SHA1"])
    refs = {k: v.dense_sha1 for k, v in top.items() if isinstance(v, repo_mod._SHA1_Tensor)}
    tensors = {k: store.get(sha1) for k, sha1 in refs.items()}
    read_s = time.perf_counter() - t0
    read_peak = _rss_kib("VmHWM") - base_rss
    reference = torch.load("ckpt.pt", weights_only=True)
    assert all(torch.equal(tensors[k], reference[k]) for k in reference), "read back differs"
    return {"read_s": read_s, "read_peak_mib": read_peak / 1024, "objects": sorted(refs.values())}


def fairscale_available() -> Optional[str]:
    """None when FairScale's wgit imports, else why not."""
    code = "import fairscale.experimental.wgit.repo as r, sys; sys.exit(3 if 'fairscale_c' in r.__file__ else 0)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    if proc.returncode == 0:
        return None
    return "FairScale's wgit (with pygit2 and pgzip) not installed" if proc.returncode != 3 else "only the alias"


def make_versions(workdir: Path, versions: int, mib: int, tensors: int, seed: int) -> None:
    import torch

    g = torch.Generator().manual_seed(seed)
    numel = mib * 2**20 // 4 // tensors
    # Trained weights are not random bits: rounding to bf16 precision leaves the low mantissa
    # bits zero, which gzip finds as real checkpoints' entropy suggests.
    sd = {f"layer{i}.weight": torch.randn(numel, generator=g).bfloat16().float() for i in range(tensors)}
    for v in range(versions):
        if v:
            for i in range(v % 4, tensors, 4):
                sd[f"layer{i}.weight"] = torch.randn(numel, generator=g).bfloat16().float()
        torch.save(sd, workdir / f"v{v}.pt")


def _run_worker(framework: str, work: Path, versions: int, mode: str) -> Dict[str, Any]:
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import wgit as b; "
        "print(json.dumps(b.worker(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])))"
    )
    args = [sys.executable, "-c", code, str(Path(__file__).parent), framework, str(work), str(versions), mode]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{framework} ({mode}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(frameworks: List[str], rounds: int, versions: int, mib: int, tensors: int) -> Dict[str, Any]:
    per: Dict[str, List[Dict[str, Any]]] = {f: [] for f in frameworks}
    for r in range(rounds):
        order = frameworks if r % 2 == 0 else frameworks[::-1]
        objects = {}
        for f in order:
            with tempfile.TemporaryDirectory(prefix="wgit-bench-") as d:
                work = Path(d) / "run"
                work.mkdir()
                make_versions(work, versions, mib, tensors, seed=r)
                res: Dict[str, Any] = {}
                for mode in ("add", "read"):
                    res.update(_run_worker(f, work, versions, mode))
                objects[f] = res.pop("objects")
                per[f].append(res)
        if len(objects) > 1:
            names = list(objects.values())
            assert all(n == names[0] for n in names), "the frameworks stored different objects"
    out: Dict[str, Any] = {}
    for f, runs in per.items():
        out[f] = {
            "add_commit_s": statistics.median(statistics.mean(x["add_commit_s"]) for x in runs),
            "first_add_s": statistics.median(x["add_commit_s"][0] for x in runs),
            "read_s": statistics.median(x["read_s"] for x in runs),
            "store_mib": statistics.median(x["store_mib"] for x in runs),
            "add_peak_mib": statistics.median(x["add_peak_mib"] for x in runs),
            "read_peak_mib": statistics.median(x["read_peak_mib"] for x in runs),
            "rounds": runs,
        }
    return out


def table(res: Dict[str, Any], mib: int, versions: int, skipped: Optional[str]) -> str:
    rows = [
        f"checkpoint {mib} MiB, {versions} versions (a quarter of the tensors new in each after the first)",
        "",
        "| framework | add + commit s per version | first version s | read s | store MiB | add peak MiB "
        "| read peak MiB |",
        "|---|---|---|---|---|---|---|",
    ]
    for f, r in res.items():
        rows.append(
            f"| {f} | {r['add_commit_s']:.2f} | {r['first_add_s']:.2f} | {r['read_s']:.2f} | "
            f"{r['store_mib']:.1f} | {r['add_peak_mib']:.0f} | {r['read_peak_mib']:.0f} |"
        )
    if "fairscale" in res:
        ours, fs = res["fairscale_c"], res["fairscale"]
        rows += [
            "",
            "fairscale_c / FairScale: add + commit "
            f"{ours['add_commit_s'] / fs['add_commit_s']:.2f}, read {ours['read_s'] / fs['read_s']:.2f}, "
            f"store {ours['store_mib'] / fs['store_mib']:.3f}, "
            f"add peak {ours['add_peak_mib'] / fs['add_peak_mib']:.2f}, "
            f"read peak {ours['read_peak_mib'] / fs['read_peak_mib']:.2f}",
        ]
    if skipped:
        rows += ["", f"FairScale skipped: {skipped}"]
    return "\n".join(rows)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="8 MiB, 2 rounds")
    p.add_argument("--mib", type=int, default=256, help="checkpoint size")
    p.add_argument("--tensors", type=int, default=16, help="tensors per checkpoint")
    p.add_argument("--versions", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    if args.quick:
        args.mib, args.rounds = 8, 2
    for name in ("mib", "tensors", "versions", "rounds"):
        if getattr(args, name) <= 0:
            p.error(f"--{name} must be positive")
    skipped = fairscale_available()
    frameworks = ["fairscale_c"] + ([] if skipped else ["fairscale"])
    res = run(frameworks, args.rounds, args.versions, args.mib, args.tensors)
    print(table(res, args.mib, args.versions, skipped))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    config = {k: getattr(args, k) for k in ("mib", "tensors", "versions", "rounds")}
    Path(args.out).write_text(json.dumps({"config": config, "skipped": skipped, "results": res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
