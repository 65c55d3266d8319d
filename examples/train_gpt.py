"""Train a small GPT with fairscale_c's FullyShardedDataParallel, launched by torchrun.

    torchrun --nproc_per_node 2 examples/train_gpt.py                  # CPU, 2 processes
    torchrun --nproc_per_node 8 examples/train_gpt.py --device cuda    # one GPU per process
    torchrun --nproc_per_node 2 examples/train_gpt.py --resume         # go on from the last checkpoint

Every transformer block becomes its own FSDP instance (auto_wrap with the transformer policy) and
the root holds the embeddings; each rank keeps 1/world of the parameters, gradients and AdamW
state. ``--bf16`` computes in bfloat16 with fp32 master shards, ``--activation-checkpointing``
recomputes each block's activations in backward. Rank 0 prints a progress bar with the loss
(averaged over ranks), tokens per second (all ranks) and peak memory (the largest rank's).

Every ``--save-every`` steps and at the end, each rank writes its shard of the model and the
optimizer to ``--ckpt-dir/step-NNNNNN/rank-R-of-W.pt`` (atomically); ``--resume`` continues from
the newest step that every rank saved and every rank can read (a damaged one is reported, moved
to ``step-NNNNNN.damaged`` and the next older one taken); a newer checkpoint of another world
size is an error, since shards load only at the world size that saved them. Ctrl-C stops every
rank, closes the process groups (nothing is left in /dev/shm) and exits with status 130; the last
checkpoint is kept.

On CPU, torchrun gives each process one thread unless OMP_NUM_THREADS is set: with N processes
on C cores, OMP_NUM_THREADS=C/N is usually faster.

The data is a synthetic language the model can learn (each token is the previous one plus a
fixed stride), drawn from a seed, the step and the rank, so a resumed run sees the batches the
uninterrupted run would have seen. Replace ``batch_for_step`` with your data.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import os
import re
import resource
import shutil
import signal
import sys
import time
from typing import Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fairscale_c.nn import FullyShardedDataParallel as FSDP
from fairscale_c.nn.checkpoint import checkpoint_wrapper
from fairscale_c.nn.wrap import auto_wrap, enable_wrap, transformer_auto_wrap_policy

# ---- the model ------------------------------------------------------------------------------


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention, then an MLP."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).split(d, -1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in qkv)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and position embeddings, `layers` blocks, a head tied to the token embedding."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, seq: int):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def build_model(args: argparse.Namespace, device: torch.device) -> Tuple[FSDP, int]:
    """The GPT, identical on every rank (seeded), sharded with one FSDP instance per block; and
    its number of parameters before sharding."""
    torch.manual_seed(args.seed)
    model = GPT(args.vocab, args.d_model, args.layers, args.heads, args.seq_len).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    if args.activation_checkpointing:
        # fairscale's checkpoint_wrapper keeps the module's class and names, so the policy below
        # still finds the blocks and checkpoints stay loadable either way.
        for i, blk in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(blk)
    fsdp_args = {"mixed_precision": True, "compute_dtype": torch.bfloat16} if args.bf16 else {}
    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    with enable_wrap(wrapper_cls=FSDP, auto_wrap_policy=policy, **fsdp_args):
        model = auto_wrap(model)
    return FSDP(model, **fsdp_args), n_params


# ---- data and schedule ------------------------------------------------------------------------


def batch_for_step(args: argparse.Namespace, step: int, rank: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets, (batch, seq) each; a function of (seed, step, rank) only."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 4099 + rank)
    start = torch.randint(0, args.vocab, (args.batch_size, 1), generator=g)
    idx = (start + 7 * torch.arange(args.seq_len + 1)) % args.vocab
    return idx[:, :-1], idx[:, 1:]


def learning_rate(args: argparse.Namespace, step: int) -> float:
    """Linear warm-up over the first 5% of the steps, then cosine decay to a tenth."""
    warmup = max(1, args.steps // 20)
    if step <= warmup:
        return args.lr * step / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


# ---- checkpoints ------------------------------------------------------------------------------

STEP_DIR = re.compile(r"^step-(\d{6,})$")


def shard_file(ckpt_dir: str, step: int, rank: int, world: int) -> str:
    return os.path.join(ckpt_dir, f"step-{step:06d}", f"rank-{rank}-of-{world}.pt")


def save_checkpoint(model: FSDP, optim: torch.optim.Optimizer, step: int, ckpt_dir: str, keep: int) -> None:
    """Write this rank's shard (model, FSDP metadata, optimizer state, step) atomically: a temporary
    file renamed into place, so a file that exists is complete. A step folder counts once every
    rank's file is in it (see complete_world). Rank 0 then removes this world size's complete
    checkpoints but the `keep` newest, and folders a killed run left half-written; complete
    checkpoints of another world size (another run's) stay.

    Collective (all ranks call it at the same step). Each rank commits on its own;
    fairscale_c.utils.checkpoint.save_sharded commits every rank together under one manifest."""
    rank, world = dist.get_rank(), dist.get_world_size()
    path = shard_file(ckpt_dir, step, rank, world)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    state = {
        "model": model.local_state_dict(),
        "metadata": model.local_metadata_dict(),
        "optim": optim.state_dict(),
        "step": step,
        "world_size": world,
    }
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        torch.save(state, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    dist.barrier()
    if rank == 0:  # keep the `keep` newest complete checkpoints; torn folders of killed runs go too
        saved_by = {s: complete_world(ckpt_dir, s, world) for s in step_folders(ckpt_dir)}
        kept = set(sorted(s for s, w in saved_by.items() if w == world)[-keep:]) | {step}
        for old, w in saved_by.items():  # complete checkpoints of another world size are another run's
            if w is None or (w == world and old not in kept):
                shutil.rmtree(os.path.join(ckpt_dir, f"step-{old:06d}"), ignore_errors=True)


SHARD_NAME = re.compile(r"^rank-(\d+)-of-(\d+)\.pt$")


def step_folders(ckpt_dir: str) -> list:
    names = os.listdir(ckpt_dir) if os.path.isdir(ckpt_dir) else []
    return [int(m.group(1)) for m in map(STEP_DIR.match, names) if m]


def complete_world(ckpt_dir: str, step: int, prefer: int) -> Optional[int]:
    """The world size W of the run whose every rank saved its shard of `step`
    (rank-0-of-W.pt ... rank-(W-1)-of-W.pt), `prefer` first, or None when no run's set is complete."""
    folder = os.path.join(ckpt_dir, f"step-{step:06d}")
    worlds = {int(m.group(2)) for m in map(SHARD_NAME.match, os.listdir(folder)) if m}
    for world in sorted(worlds, key=lambda w: (w != prefer, -w)):
        if all(os.path.isfile(shard_file(ckpt_dir, step, r, world)) for r in range(world)):
            return world
    return None


def complete_checkpoints(ckpt_dir: str, world: int) -> list:
    """The steps with a complete checkpoint of a `world`-rank run, newest first. A newer complete
    checkpoint of another world size is an error: its shards load only at the world size that
    wrote them, and resuming from an older one would silently go back in time."""
    steps = []
    for step in sorted(step_folders(ckpt_dir), reverse=True):
        saved_by = complete_world(ckpt_dir, step, world)
        if saved_by is not None and saved_by != world and not steps:
            raise RuntimeError(
                f"the newest checkpoint in {ckpt_dir} (step {step}) was saved by {saved_by} ranks and this run has "
                f"{world}; resume with {saved_by} ranks (local shards load only at the world size that saved them)"
            )
        if saved_by == world:
            steps.append(step)
    return steps


def load_checkpoint(model: FSDP, optim: torch.optim.Optimizer, ckpt_dir: str, device: torch.device) -> int:
    """Load this rank's shard of the newest complete checkpoint that every rank can read; returns
    its step (0: none found). A checkpoint some rank cannot read (a damaged file) is reported and
    the next older one is tried, by every rank together."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if os.path.exists(ckpt_dir) and not os.path.isdir(ckpt_dir):
        raise NotADirectoryError(f"--ckpt-dir {ckpt_dir} is not a directory")
    steps = complete_checkpoints(ckpt_dir, world)
    # Tensor collectives (torch's object collectives would need numpy): every rank's candidates.
    mine = [len(steps), steps[0] if steps else 0]
    extremes = torch.tensor(mine + [-v for v in mine], device=device)
    dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
    if extremes[:2].tolist() != [-v for v in extremes[2:].tolist()]:
        raise RuntimeError(f"ranks found different checkpoints in {ckpt_dir} (rank {rank}: steps {steps})")
    for step in steps:
        path = shard_file(ckpt_dir, step, rank, world)
        try:
            state, problem = torch.load(path, map_location=device, weights_only=True), ""
        except Exception as exc:  # every rank learns of it below, and moves on together
            state, problem = None, f"{type(exc).__name__}: {exc}"
        ok = torch.tensor([0 if problem else 1], device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if problem:
            print(f"rank {rank}: cannot load {path} ({problem})", file=sys.stderr, flush=True)
        if ok.item() == 1:
            model.load_local_state_dict(state["model"])
            optim.load_state_dict(state["optim"])
            return step
        if rank == 0:  # set aside, not deleted, so that pruning does not count it as a newer checkpoint
            folder = os.path.join(ckpt_dir, f"step-{step:06d}")
            os.replace(folder, folder + ".damaged")
            print(
                f"checkpoint step {step} in {ckpt_dir} is damaged (moved to {folder}.damaged); trying an older one",
                file=sys.stderr,
                flush=True,
            )
        dist.barrier()
    return 0


# ---- progress -----------------------------------------------------------------------------------


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


class Progress:
    """Rank 0's progress bar: redrawn in place every step on a terminal, one line every `every`
    steps otherwise. Reporting takes collectives, so every rank must agree on the steps: whether
    rank 0 writes to a terminal is broadcast (a collective call)."""

    def __init__(self, total: int, every: int, device: torch.device):
        on_terminal = torch.tensor([int(sys.stdout.isatty())], device=device)
        dist.broadcast(on_terminal, src=0)
        self.tty, self.enabled = bool(on_terminal.item()), dist.get_rank() == 0
        self.total, self.every = total, 1 if self.tty else every

    def due(self, step: int) -> bool:
        return step == self.total or step % self.every == 0

    def show(self, step: int, loss: float, tokens_per_s: float, peak_mib: float, mem_kind: str) -> None:
        if not self.enabled:
            return
        filled = 24 * step // self.total
        bar = "#" * filled + "." * (24 - filled)
        line = (
            f"step {step:>{len(str(self.total))}}/{self.total} [{bar}] loss {loss:.4f} | "
            f"{tokens_per_s:,.0f} tok/s | peak {mem_kind} {peak_mib:,.0f} MiB"
        )
        if self.tty:
            print("\r" + line + "\033[K", end="\n" if step == self.total else "", flush=True)  # K: clear the rest
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.tty and self.enabled:
            print(flush=True)


# ---- training -----------------------------------------------------------------------------------


def train(args: argparse.Namespace, device: torch.device) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    model, n_params = build_model(args, device)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    start = load_checkpoint(model, optim, args.ckpt_dir, device) if args.resume else 0
    if rank == 0:
        what = f"resumed from step {start}" if start else "starting from scratch"
        if args.resume and not start:
            what = f"no checkpoint in {args.ckpt_dir}, starting from scratch"
        print(
            f"GPT, {n_params / 1e6:.2f}M parameters, {world} ranks on {device.type}"
            f"{', bf16' if args.bf16 else ''}{', activation checkpointing' if args.activation_checkpointing else ''};"
            f" {what}; checkpoints go to {args.ckpt_dir}",
            flush=True,
        )
    progress = Progress(args.steps, args.log_every, device)
    mem_kind = "allocated" if device.type == "cuda" else "RSS"
    window_start, window_tokens, saved = time.perf_counter(), 0, start
    try:
        for step in range(start + 1, args.steps + 1):
            x, y = batch_for_step(args, step, rank)
            x, y = x.to(device), y.to(device)
            for group in optim.param_groups:
                group["lr"] = learning_rate(args, step)
            logits = model(x)
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1))
            loss.backward()
            model.clip_grad_norm_(args.clip)
            optim.step()
            optim.zero_grad(set_to_none=True)
            window_tokens += x.numel() * world
            if progress.due(step):
                loss_sum = loss.detach().float().reshape(1)
                peak = torch.tensor([peak_memory_mib(device)], device=device)
                dist.all_reduce(loss_sum)
                dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # the largest rank's
                mean_loss = loss_sum.item() / world
                elapsed = time.perf_counter() - window_start
                progress.show(step, mean_loss, window_tokens / max(elapsed, 1e-9), peak.item(), mem_kind)
                window_start, window_tokens = time.perf_counter(), 0
            if step % args.save_every == 0 or step == args.steps:
                save_checkpoint(model, optim, step, args.ckpt_dir, args.keep)
                saved = step
                window_start, window_tokens = time.perf_counter(), 0  # tokens/s counts training, not saving
    except KeyboardInterrupt:
        progress.close()
        if rank == 0:
            where = f"step {saved} in {args.ckpt_dir}" if saved else "none saved yet"
            print(f"interrupted; last checkpoint: {where} (continue with --resume)", flush=True)
        raise
    if rank == 0:
        print(f"done: {args.steps} steps; checkpoint at step {saved} in {args.ckpt_dir}", flush=True)


class _StopOnSignal:
    """SIGINT/SIGTERM: the first raises KeyboardInterrupt, later ones (torchrun forwards Ctrl-C to
    workers that the terminal already signalled) are ignored so the clean-up is not cut short."""

    def __init__(self) -> None:
        self.received = 0

    def __call__(self, signum: int, frame: object) -> None:
        self.received += 1
        if self.received == 1:
            raise KeyboardInterrupt


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--steps", type=int, default=200, help="train until this step (default 200)")
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per rank and step")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    ap.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping")
    ap.add_argument("--bf16", action="store_true", help="bfloat16 compute, fp32 master shards")
    ap.add_argument("--activation-checkpointing", action="store_true", help="recompute blocks in backward")
    ap.add_argument("--ckpt-dir", default="checkpoints/train_gpt", help="checkpoint folder")
    ap.add_argument("--save-every", type=int, default=50, help="checkpoint every N steps (and at the end)")
    ap.add_argument("--keep", type=int, default=2, help="checkpoints to keep")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --ckpt-dir")
    ap.add_argument("--log-every", type=int, default=10, help="report every N steps when not on a terminal")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300, help="seconds any collective may wait")
    args = ap.parse_args(argv)
    for name in ("steps", "batch_size", "seq_len", "save_every", "keep", "log_every"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.d_model % args.heads:
        ap.error("--d-model must be a multiple of --heads")
    return args


def main(argv: Optional[list] = None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        sys.exit("launch with torchrun, e.g.: torchrun --nproc_per_node 2 examples/train_gpt.py")
    # The collective engine reads its timeout when its groups are created, below.
    os.environ.setdefault("FAIRSCALE_C_TIMEOUT", str(args.timeout))
    signal.signal(signal.SIGINT, _StopOnSignal())
    signal.signal(signal.SIGTERM, signal.getsignal(signal.SIGINT))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("--device cuda: torch sees no CUDA device")
        n_gpus = torch.cuda.device_count()
        if local_rank >= n_gpus and os.environ.get("NCCL_MULTI_RANK_GPU_ENABLE") != "1":
            sys.exit(
                f"--device cuda: local rank {local_rank} but {n_gpus} GPU(s) here; start at most {n_gpus} "
                "processes per node, or set NCCL_MULTI_RANK_GPU_ENABLE=1 (NCCL >= 2.30) to share GPUs"
            )
        device = torch.device("cuda", local_rank % n_gpus)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
        try:
            train(args, device)
        finally:
            dist.destroy_process_group()
    except KeyboardInterrupt:
        return 130  # fairscale_c's groups are closed at exit, their /dev/shm segments already unlinked
    return 0


if __name__ == "__main__":
    sys.exit(main())
