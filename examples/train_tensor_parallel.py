"""Train a small Megatron-style model with tensor (model) parallelism and data parallelism.

    torchrun --nproc_per_node 2 examples/train_tensor_parallel.py                   # 2-way tensor parallel
    torchrun --nproc_per_node 4 examples/train_tensor_parallel.py --model-parallel 2  # 2 x 2
    torchrun --nproc_per_node 2 examples/train_tensor_parallel.py --device cuda

The model: a vocabulary-parallel embedding, MLP blocks (a column-parallel linear layer whose
output stays split, GeLU, a row-parallel linear layer that sums the parts), and an output layer
whose logits stay split over the vocabulary, trained with the vocabulary-parallel cross-entropy,
so no rank ever holds the whole embedding, the whole hidden activation or the whole logits. The
ranks of a model-parallel group see the same batch; data-parallel replicas see different ones and
average their gradients over the data-parallel group.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fairscale_c.distributed as fdist
import fairscale_c.nn.model_parallel as mpu


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = mpu.ColumnParallelLinear(width, 4 * width, gather_output=False)
        self.down = mpu.RowParallelLinear(4 * width, width, input_is_parallel=True)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(self.norm(h))))


class Model(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int) -> None:
        super().__init__()
        torch.manual_seed(0)  # full weights equal on every rank; each keeps its part
        self.embed = mpu.VocabParallelEmbedding(vocab, width)
        self.blocks = nn.ModuleList([Block(width) for _ in range(layers)])
        self.out = mpu.ColumnParallelLinear(width, vocab, bias=False, gather_output=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.out(h)  # logits split over the vocabulary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-parallel", type=int, default=0, help="model-parallel size (default: all ranks)")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--vocab", type=int, default=128)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = p.parse_args()

    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if cuda else "gloo")
    world = dist.get_world_size()
    mpu.initialize_model_parallel(args.model_parallel or world)
    mpu.model_parallel_cuda_manual_seed(1234)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    device = torch.device("cuda" if cuda else "cpu")
    data_rank, data_group = mpu.get_data_parallel_rank(), mpu.get_data_parallel_group()

    model = Model(args.vocab, args.width, args.layers).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    shift = torch.randint(1, args.vocab, (1,), generator=torch.Generator().manual_seed(7)).item()
    data = torch.Generator().manual_seed(100 + data_rank)  # one stream per data-parallel replica
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=data).to(device)
        target = (3 * tokens + shift) % args.vocab  # a fixed map of the token ids
        loss = mpu.vocab_parallel_cross_entropy(model(tokens), target).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if mpu.get_data_parallel_world_size() > 1:
            grads = [q.grad for q in model.parameters()]
            flat = torch.cat([g.reshape(-1) for g in grads])
            fdist.group_for(data_group).all_reduce(flat, op="avg")
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        opt.step()
        if dist.get_rank() == 0 and (step % 10 == 0 or step == 1):
            print(f"step {step:4d}/{args.steps} loss {loss.item():.4f}")
    # data-parallel replicas took the same averaged steps: their parts of the weights agree
    mine = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
    top = mine.clone()
    fdist.group_for(data_group).all_reduce(top, op="max")
    agree = torch.tensor([float(torch.equal(top, mine))], device=device)
    dist.all_reduce(agree, op=dist.ReduceOp.MIN)
    if dist.get_rank() == 0:
        print(
            f"done in {time.perf_counter() - start:.1f}s; model parallel {mpu.get_model_parallel_world_size()} x "
            f"data parallel {mpu.get_data_parallel_world_size()}; replicas "
            f"{'identical' if agree.item() == 1.0 else 'DIFFERENT'}"
        )
    mpu.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
