"""Train a small mixture-of-experts model with expert and data parallelism.

    torchrun --nproc_per_node 2 examples/train_moe.py                 # CPU, 2 processes
    torchrun --nproc_per_node 2 examples/train_moe.py --device cuda   # one GPU per process

Every rank holds the shared layers (an embedding, a Top2Gate, the output head) and its own
experts; the gate routes each token to two of the world's experts, and MOELayer's all-to-alls
carry the tokens to the ranks that hold them and back. Each rank trains on its own batches. The
shared layers' gradients are averaged over the ranks (one all-reduce of a flat buffer); the
experts' (marked ``p.expert = True`` by MOELayer) stay where they are, since each expert lives on
one rank. The task: predict a fixed random function of each token id, plus the gate's
load-balancing loss.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn

import fairscale_c.distributed as fdist
from fairscale_c.nn import MOELayer, Top2Gate


class MoEModel(nn.Module):
    def __init__(self, vocab: int, width: int, experts_per_rank: int, world: int, rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)  # the shared layers start equal on every rank
        self.embed = nn.Embedding(vocab, width)
        self.gate = Top2Gate(width, world * experts_per_rank)
        self.head = nn.Linear(width, vocab)
        torch.manual_seed(1000 + rank)  # each rank's experts differ
        experts = nn.ModuleList(
            [
                nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
                for _ in range(experts_per_rank)
            ]
        )
        self.moe = MOELayer(self.gate, experts)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        return self.head(self.moe(h))  # every prediction goes through two experts


def average_shared_gradients(model: nn.Module, world: int) -> None:
    """One all-reduce (avg) over every gradient that is not an expert's."""
    grads = [p.grad for p in model.parameters() if p.grad is not None and not getattr(p, "expert", False)]
    flat = torch.cat([g.reshape(-1) for g in grads])
    fdist.all_reduce(flat, op="avg")
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--experts-per-rank", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = p.parse_args()

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda") if cuda else torch.device("cpu")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))

    model = MoEModel(args.vocab, args.width, args.experts_per_rank, world, rank).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    target_of = torch.randperm(args.vocab, generator=torch.Generator().manual_seed(7)).to(device)
    data = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=data).to(device)
        logits = model(tokens)
        task = nn.functional.cross_entropy(logits.reshape(-1, args.vocab), target_of[tokens].reshape(-1))
        loss = task + 0.01 * model.moe.l_aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        average_shared_gradients(model, world)
        opt.step()
        if rank == 0 and (step % 10 == 0 or step == 1):
            print(f"step {step:4d}/{args.steps} task loss {task.item():.4f} | l_aux {model.moe.l_aux.item():.4f}")
    # the shared layers took the same averaged steps everywhere: check that they agree
    shared = torch.cat([q.detach().reshape(-1) for q in model.parameters() if not getattr(q, "expert", False)])
    top = shared.clone()
    fdist.all_reduce(top, op="max")
    if rank == 0:
        same = "identical" if torch.equal(top, shared) else "DIFFERENT"
        print(f"done in {time.perf_counter() - start:.1f}s; shared parameters {same} on every rank")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
