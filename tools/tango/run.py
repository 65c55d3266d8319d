"""`make tango`, part 2: 2-worker CPU `tango run`s of tools/tango/config.jsonnet through the fairscale
alias, compared with Tango's torch (DDP) engine.

    .venv/bin/python tools/tango/run.py [--out DIR]

Four `python -m fairscale_c.compat -m tango run` invocations (each in a scratch folder: Tango
reads the git state and imports *.py of its working directory):

1. ``full``: every engine (torch = DDP, Tango's ``fairscale`` through the alias, ``fairscale_c``)
   in fp32 and with bf16 autocast, 12 steps, validation and a checkpoint every 4;
2. ``crash``: the two FSDP engines in fp32 in a second workspace, with a failure injected before
   step 6 (after the step-4 checkpoint): must fail;
3. ``resume``: the same command again without the failure: Tango recovers from the step-4
   checkpoint of each;
4. ``bf16_mp``: Tango's engine with bf16 autocast and ``mixed_precision: true`` (issue 12, item 2):
   reported, pass or fail.

Checks (exit status 1 when one fails): fp32 losses, validation losses, the full weights at the end
and the weights Tango saves (``weights.pt``, from its ``save_complete_weights_from_checkpoint``)
within 1e-6 of DDP's; ``weights.pt`` in an unwrapped model gives DDP's outputs within 1e-6; the
consolidation does not depend on the order the shard files are listed in (Tango's own method with
its glob reversed); the resumed runs bit-identical to the uninterrupted ones; no shared-memory
segment left behind. bf16 differences are measured and printed, with a loose sanity bound.
"""

import argparse
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "config.jsonnet"
COMPONENTS = HERE / "components.py"
STEPS, EVERY, CRASH_AT = 12, 4, 6
FP32_ATOL = 1e-6
BF16_SANITY = 0.1  # |loss difference| bound for the bf16 runs: a broken run is off by far more

FULL = ["torch_fp32", "fairscale_fp32", "fairscale_c_fp32", "torch_bf16", "fairscale_bf16", "fairscale_c_bf16"]
RESUMED = ["fairscale_fp32", "fairscale_c_fp32"]

failures: List[str] = []


def check(ok: bool, what: str) -> None:
    print(f"  [{'ok' if ok else 'FAIL'}] {what}")
    if not ok:
        failures.append(what)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def orphaned_segments() -> set:
    """fairscale_c's /dev/shm segments whose creator (the pid in "fsc-<pid>-...") has exited."""
    try:
        names = [n for n in os.listdir("/dev/shm") if n.startswith("fsc-")]
    except FileNotFoundError:
        return set()
    return {n for n in names if n.split("-")[1].isdigit() and not os.path.exists(f"/proc/{n.split('-')[1]}")}


def tango_run(name: str, out: Path, workspace: Path, steps: List[str], crash: bool = False) -> Dict[str, Any]:
    """One `tango run` through the alias; its output goes to out/<name>.log."""
    env = dict(os.environ, FSC_TANGO_OUT=str(out / "records" / name), FSC_TANGO_PORT=str(free_port()))
    env.pop("FSC_TANGO_CRASH_AT", None)
    if crash:
        env["FSC_TANGO_CRASH_AT"] = str(CRASH_AT)
    cmd = [sys.executable, "-m", "fairscale_c.compat", "-m", "tango", "--log-level", "warning", "run", str(CONFIG)]
    cmd += ["-w", str(workspace), "-i", str(COMPONENTS), "-i", "fairscale_c.integrations.tango"]
    for s in steps:
        cmd += ["-s", s]
    cwd = out / "cwd"
    cwd.mkdir(exist_ok=True)
    log = out / f"{name}.log"
    t0 = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=cwd, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=1800).returncode
    wall = time.perf_counter() - t0
    print(f"tango run {name}: {', '.join(steps)}{' (failure injected)' if crash else ''}: exit {rc}, {wall:.1f} s")
    return {"rc": rc, "wall": wall, "log": log}


def load(out: Path, run: str, step: str) -> Optional[Dict[str, Any]]:
    path = out / "records" / run / f"{step}.json"
    if not path.is_file():
        return None
    rec = json.loads(path.read_text())
    rec["losses"] = {int(k): v for k, v in rec["losses"].items()}
    rec["val"] = {int(k): v for k, v in rec["val"].items()}
    rec["final"] = torch.load(out / "records" / run / f"{step}.final.pt")
    rec["weights"] = torch.load(Path(rec["work_dir"]) / "weights.pt")
    rec["best"] = os.readlink(Path(rec["work_dir"]) / "checkpoint_state_best")
    return rec


def max_diff(a: Dict[Any, Any], b: Dict[Any, Any]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max(float((torch.as_tensor(a[k]) - torch.as_tensor(b[k])).abs().max()) for k in a)


def identical(a: Dict[Any, Any], b: Dict[Any, Any]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a)


def outputs(weights: Dict[str, torch.Tensor]) -> torch.Tensor:
    """The outputs of an unwrapped model (no FSDP, no checkpoint_wrapper) holding ``weights``."""
    import components

    model = components.Regressor()
    model.load_state_dict(weights, strict=True)
    x = torch.randn(32, components.WIDTH, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        return model(x, torch.zeros(32, 1))["out"]


def consolidation_order_checks(rec: Dict[str, Any], step: str, scratch: Path) -> None:
    """Tango's save_complete_weights_from_checkpoint on the checkpoint Tango consolidated, with the
    shard files listed in both orders: the weights must not depend on it (issue 12, item 1)."""
    ckpt = (Path(rec["work_dir"]) / "checkpoint_state_best").resolve()
    if rec["engine"] == "FairScaleTrainingEngine":
        from tango.integrations.fairscale import FairScaleTrainingEngine as Engine

        listed = sorted(p.name for p in ckpt.glob("worker*_model.pt"))
        native = [p.name for p in ckpt.glob("worker*_model.pt")]
        print(f"  {step}: this filesystem's glob order: {native}")
        real_glob = Path.glob
        for order in ("sorted", "reversed"):
            names = listed if order == "sorted" else listed[::-1]

            def glob(self, pattern, _names=names, _ckpt=ckpt):
                if self == _ckpt and pattern == "worker*_model.pt":
                    return iter([_ckpt / n for n in _names])
                return real_glob(self, pattern)

            Path.glob = glob
            try:
                target = scratch / f"{step}-{order}.pt"
                Engine.save_complete_weights_from_checkpoint(
                    types.SimpleNamespace(logger=logging.getLogger("check")), ckpt, target
                )
            finally:
                Path.glob = real_glob
            same = identical(torch.load(target), rec["weights"])
            check(same, f"{step}: Tango's consolidation, shards listed {order}")
    else:
        from fairscale_c.integrations.tango import FairScaleCTrainingEngine as Engine
        from fairscale_c.nn.data_parallel import FullyShardedDataParallel as FSDP
        from fairscale_c.utils.checkpoint import load_all_shards

        target = scratch / f"{step}.pt"
        Engine.save_complete_weights_from_checkpoint(
            types.SimpleNamespace(logger=logging.getLogger("check")), ckpt, target
        )
        check(identical(torch.load(target), rec["weights"]), f"{step}: consolidation again from the checkpoint")
        shards = load_all_shards(str(ckpt))[::-1]
        full = FSDP.consolidate_shard_weights(
            [s["model"]["weights"] for s in shards], [s["model"]["metadata"] for s in shards]
        )
        check(identical(full, rec["weights"]), f"{step}: consolidate_shard_weights given the shards in reverse order")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="keep logs, workspaces and records here (default: a temporary folder)")
    args = parser.parse_args()
    out = Path(args.out).resolve() if args.out else Path(tempfile.mkdtemp(prefix="fsc-tango-"))
    if out.exists() and args.out:
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    shm_before = orphaned_segments()
    t0 = time.perf_counter()
    runs = {
        "full": tango_run("full", out, out / "ws-full", FULL),
        "crash": tango_run("crash", out, out / "ws-resume", RESUMED, crash=True),
        "resume": tango_run("resume", out, out / "ws-resume", RESUMED),
        "bf16_mp": tango_run("bf16_mp", out, out / "ws-bf16-mp", ["fairscale_bf16_mp"]),
    }
    total = time.perf_counter() - t0

    # The comparisons use Tango's own engine class: the alias from here on (not for the runs above,
    # which get it from `python -m fairscale_c.compat` as a user would).
    import fairscale_c.compat

    fairscale_c.compat.install()
    sys.path.insert(0, str(HERE))

    print("\nruns")
    check(runs["full"]["rc"] == 0, f"full run succeeds (log: {runs['full']['log']})")
    full = {s: load(out, "full", s) for s in FULL}
    for s, rec in full.items():
        check(rec is not None, f"{s}: trained, record written")
    if failures:
        return report(runs, total, out)

    print(f"\nfp32, 2 workers, {STEPS} steps (FSDP with inner FSDP blocks and activation checkpointing) vs DDP")
    ddp = full["torch_fp32"]
    for s in ("fairscale_fp32", "fairscale_c_fp32"):
        rec = full[s]
        dl, dv = max_diff(rec["losses"], ddp["losses"]), max_diff(rec["val"], ddp["val"])
        dw, dfinal = max_diff(rec["weights"], ddp["weights"]), max_diff(rec["final"], ddp["final"])
        dout = float((outputs(rec["weights"]) - outputs(ddp["weights"])).abs().max())
        print(
            f"  {s} ({rec['engine']}): max |d| loss {dl:.3g} ({len(rec['losses'])} steps), val loss {dv:.3g} "
            f"({len(rec['val'])} validations), final weights {dfinal:.3g}, weights.pt {dw:.3g} (from {rec['best']}, "
            f"DDP's from {ddp['best']}), unwrapped-model outputs {dout:.3g}"
        )
        check(sorted(rec["losses"]) == list(range(1, STEPS + 1)), f"{s}: a loss for every step")
        check(dl <= FP32_ATOL and dv <= FP32_ATOL, f"{s}: training and validation losses within {FP32_ATOL} of DDP")
        check(dfinal <= FP32_ATOL, f"{s}: final full weights within {FP32_ATOL} of DDP")
        check(rec["best"] == ddp["best"] and dw <= FP32_ATOL, f"{s}: Tango's weights.pt within {FP32_ATOL} of DDP")
        check(dout <= FP32_ATOL, f"{s}: weights.pt in an unwrapped model gives DDP's outputs within {FP32_ATOL}")
        consolidation_order_checks(rec, s, out)

    print(f"\ncrash before step {CRASH_AT} (after the step-{EVERY} checkpoint), then resume")
    crash_log = runs["crash"]["log"].read_text(errors="replace")
    check(
        runs["crash"]["rc"] != 0 and f"failure injected before step {CRASH_AT}" in crash_log,
        "the crashed run fails with the injected failure",
    )
    check(runs["resume"]["rc"] == 0, f"the resumed run succeeds (log: {runs['resume']['log']})")
    for s in RESUMED:
        rec = load(out, "resume", s)
        if rec is None:
            check(False, f"{s}: resumed run wrote its record")
            continue
        # Tango checkpoints before it calls post_val_loop: the step-4 validation loss is not in the
        # recorder's checkpointed state; the later ones are compared.
        later_val = {k: v for k, v in full[s]["val"].items() if k > EVERY}
        same = rec["losses"] == full[s]["losses"] and rec["val"] == later_val
        print(
            f"  {s}: losses of {rec['restored_steps']} steps restored from the checkpoint, "
            f"{STEPS - rec['restored_steps']} steps trained after the resume"
        )
        check(rec["restored_steps"] == EVERY, f"{s}: resumed from the step-{EVERY} checkpoint")
        check(same, f"{s}: resumed losses (all steps) and validation losses (after step {EVERY}) bit-identical")
        check(identical(rec["final"], full[s]["final"]), f"{s}: resumed final weights bit-identical")
        check(identical(rec["weights"], full[s]["weights"]), f"{s}: resumed weights.pt bit-identical")

    print("\nbf16 autocast (Tango's AMP on CPU), 2 workers: max |d| vs DDP with bf16 autocast (and vs fp32 DDP)")
    ref16, ref32 = full["torch_bf16"], full["torch_fp32"]
    for s in ("fairscale_bf16", "fairscale_c_bf16"):
        rec = full[s]
        dl, dl32 = max_diff(rec["losses"], ref16["losses"]), max_diff(rec["losses"], ref32["losses"])
        dv, dw = max_diff(rec["val"], ref16["val"]), max_diff(rec["final"], ref16["final"])
        print(
            f"  {s} ({rec['engine']}, FSDP compute dtype {rec['compute_dtype']}): loss {dl:.3g} ({dl32:.3g} vs fp32), "
            f"val loss {dv:.3g}, final weights {dw:.3g}"
        )
        check(dl <= BF16_SANITY and dv <= BF16_SANITY, f"{s}: losses within the sanity bound {BF16_SANITY}")
    dl32 = max_diff(ref16["losses"], ref32["losses"])
    print(f"  (DDP bf16 autocast vs DDP fp32: loss {dl32:.3g})")
    bf16_log = runs["bf16_mp"]["log"].read_text(errors="replace")
    error = next((ln.strip() for ln in bf16_log.splitlines() if "mixed dtype" in ln), None)
    outcome = "succeeds" if runs["bf16_mp"]["rc"] == 0 else f"fails: {error or 'see ' + str(runs['bf16_mp']['log'])}"
    print(f"  Tango's fairscale engine, bf16 autocast + mixed_precision: true (FSDP computes in fp16): {outcome}")

    leaked = orphaned_segments() - shm_before
    check(not leaked, f"no fairscale_c shared-memory segment left behind ({sorted(leaked)})")
    return report(runs, total, out)


def report(runs: Dict[str, Dict[str, Any]], total: float, out: Path) -> int:
    walls = ", ".join(f"{k} {v['wall']:.1f} s" for k, v in runs.items())
    print(f"\ntango runs: {total:.1f} s ({walls}); logs and workspaces in {out}")
    if failures:
        print(f"tools/tango/run.py: {len(failures)} check(s) FAILED")
        return 1
    print("tools/tango/run.py: all checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
