"""The main job: a short 2-process FSDP training run of a small GPT-style model.

Each rank holds 1/world of the parameters, gradients and AdamW state; parameters are
all-gathered and gradients reduce-scattered through fairscale_c's C collective engine (shared
memory on CPU). At the end the sharded checkpoint is saved all-or-nothing across ranks
(fairscale_c.utils.checkpoint: every rank's file, then one manifest), reloaded into a freshly
built model, checked to give identical outputs, and consolidated into full weights.

    python examples/demo.py [--world 2] [--steps 20] [--device auto|cpu|cuda] [--out DIR]

--device auto (the default) trains on CUDA with NCCL when torch sees at least --world GPUs,
else on CPU with the shared-memory engine.
"""

import argparse
import os
import resource
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).split(d, -1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in qkv)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab=256, d=128, layers=4, heads=4, seq=64):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, d), nn.Parameter(torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied input/output embedding
        nn.init.normal_(self.embed.weight, std=0.02)

    def forward(self, idx):
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


def build(device):
    from fairscale_c.nn import FullyShardedDataParallel as FSDP
    from fairscale_c.nn.wrap import enable_wrap, wrap

    torch.manual_seed(0)
    model = GPT().to(device)
    with enable_wrap(wrapper_cls=FSDP):
        for i, blk in enumerate(model.blocks):
            model.blocks[i] = wrap(blk)
        return FSDP(model)


def batches(rank, world, steps, batch=8, seq=64, vocab=256):
    """A learnable synthetic language: each token is the previous one plus a fixed stride."""
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(steps):
        start = torch.randint(0, vocab, (batch, 1), generator=g)
        idx = (start + 7 * torch.arange(seq + 1)) % vocab
        yield idx[:, :-1], idx[:, 1:]


def peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(rank, world, steps, device_kind, out_dir, init_file):
    os.environ.setdefault("FAIRSCALE_C_TIMEOUT", "120")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    backend = "nccl" if device_kind == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    device = torch.device("cuda", rank % torch.cuda.device_count()) if device_kind == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    from fairscale_c.nn import FullyShardedDataParallel as FSDP

    model = build(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    n_params = sum(sum(h.layout.numel for h in m._handles) for m in model.modules() if isinstance(m, FSDP))
    if rank == 0:
        print(
            f"GPT with {n_params / 1e6:.2f}M parameters, world {world}, device {device.type}; "
            f"each rank holds {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M"
        )
    t0 = time.perf_counter()
    for step, (x, y) in enumerate(batches(rank, world, steps)):
        logits = model(x.to(device))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.to(device).reshape(-1))
        loss.backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().reshape(1).clone()  # on the device: nccl reduces CUDA tensors only
        dist.all_reduce(mean)
        if rank == 0:
            done = (step + 1) * 30 // steps
            print(f"step {step + 1:3d}/{steps} [{'#' * done:<30}] loss {mean.item() / world:.4f}", flush=True)
    elapsed = time.perf_counter() - t0
    mem = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else peak_rss_mib()
    stats = [None] * world
    dist.all_gather_object(stats, (elapsed, mem))
    if rank == 0:
        kind = "allocated" if device.type == "cuda" else "RSS"
        for r, (secs, mib) in enumerate(stats):
            print(f"rank {r}: {steps} steps in {secs:.1f}s, peak {kind} {mib:.0f} MiB", flush=True)

    # Checkpoint: every rank's shard (weights, metadata, optimizer), committed together by one
    # manifest; then reload on every rank and check, and consolidate offline on rank 0.
    from fairscale_c.utils.checkpoint import load_all_shards, load_sharded, save_sharded

    probe = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(7)).to(device)
    with torch.no_grad():
        expected = model(probe).cpu()
    ckpt = os.path.join(out_dir, "checkpoint")
    state = {"weights": model.local_state_dict(), "metadata": model.local_metadata_dict(), "optim": opt.state_dict()}
    save_sharded(state, ckpt, step=steps)
    fresh = build(device)
    fresh.load_local_state_dict(load_sharded(ckpt, map_location=device)["weights"])
    with torch.no_grad():
        got = fresh(probe).cpu()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    if rank == 0:
        shards = load_all_shards(ckpt)
        full = FSDP.consolidate_shard_weights([s["weights"] for s in shards], [s["metadata"] for s in shards])
        plain = GPT()
        plain.load_state_dict(full)
        with torch.no_grad():
            torch.testing.assert_close(plain(probe.cpu()), expected, rtol=1e-5, atol=1e-5)
        torch.save(full, os.path.join(out_dir, "consolidated.pt.tmp"))
        os.replace(os.path.join(out_dir, "consolidated.pt.tmp"), os.path.join(out_dir, "consolidated.pt"))
        print(
            f"checkpoint of step {steps} committed to {ckpt} ({world} shards + manifest), reloaded on every "
            f"rank with identical outputs, and consolidated into {len(full)} full tensors (matches an unwrapped "
            "model)"
        )
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--out", default=None, help="checkpoint folder (default: a temporary one)")
    args = ap.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= args.world else "cpu"
    import fairscale_c

    info = fairscale_c.build_info()
    print(f"fairscale_c {info['version']} (CUDA kernels built: {info['cuda_kernels_built']})")
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = args.out or tmp
        os.makedirs(out_dir, exist_ok=True)
        mp.spawn(
            run,
            args=(args.world, args.steps, args.device, out_dir, os.path.join(tmp, "init")),
            nprocs=args.world,
            join=True,
        )


if __name__ == "__main__":
    main()
