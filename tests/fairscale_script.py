"""A training script written only against FairScale 0.4.13's public API (it imports ``fairscale``,
never fairscale_c). tests/test_compat.py runs it unchanged under ``python -m fairscale_c.compat``,
one process per rank as torchrun would start it (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), or
alone at world size 1.

FSDP (auto_wrap with default_auto_wrap_policy, one instance per block, each block under
checkpoint_wrapper), ShardedGradScaler, SGD; every rank trains on its half of each batch and
the losses and final full weights are compared with plain PyTorch trained on the whole batch.
OSS, ShardedDataParallel and Pipe are used when the installed package provides them."""

import argparse
import copy
import functools
import os
import socket

import torch
import torch.distributed as dist
from torch import nn

import fairscale
from fairscale.nn import FullyShardedDataParallel as FSDP
from fairscale.nn import auto_wrap, checkpoint_wrapper, enable_wrap
from fairscale.nn.wrap import default_auto_wrap_policy
from fairscale.optim.grad_scaler import ShardedGradScaler


def make_model() -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16)) for _ in range(3)]
    return nn.Sequential(*blocks, nn.Linear(16, 1))


def batches(steps: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)) for _ in range(steps)]


def check_close(what: str, a: torch.Tensor, b: torch.Tensor) -> None:
    if not torch.allclose(a, b, rtol=1e-5, atol=1e-6):
        raise SystemExit(f"{what} differs from plain PyTorch: max difference {(a - b).abs().max().item()}")


def train_fsdp(steps: int, rank: int, world: int) -> None:
    ref = make_model()
    module = copy.deepcopy(ref)
    for i in range(3):
        module[i] = checkpoint_wrapper(module[i])
    policy = functools.partial(
        default_auto_wrap_policy, min_num_params=600
    )  # a block (1072), not its Linears (544, 528)
    with enable_wrap(wrapper_cls=FSDP, flatten_parameters=True):
        model = FSDP(auto_wrap(module, auto_wrap_policy=policy))
    inner = [m for m in model.modules() if isinstance(m, FSDP)]
    assert len(inner) == 4, f"auto_wrap made {len(inner) - 1} inner instances, expected 3"

    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    scaler = ShardedGradScaler()
    for step, (x, y) in enumerate(batches(steps)):
        mine = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        loss = nn.functional.mse_loss(model(x[mine]), y[mine])
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        model.clip_grad_norm_(1.0)
        scaler.step(opt)
        scaler.update()

        ref_loss = nn.functional.mse_loss(ref(x), y)
        ref_opt.zero_grad()
        ref_loss.backward()
        nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        ref_opt.step()
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)
            mean /= world
        check_close(f"loss of step {step}", mean, ref_loss.detach())

    full = model.state_dict()
    for name, value in ref.state_dict().items():
        check_close(f"final weight {name}", full[name], value)
    print(f"fsdp: {steps} steps match plain PyTorch", flush=True)


def train_oss(steps: int, rank: int, world: int) -> None:
    from fairscale.nn.data_parallel import ShardedDataParallel
    from fairscale.optim.oss import OSS

    ref = make_model()
    model = copy.deepcopy(ref)
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.05)
    model = ShardedDataParallel(model, opt)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05)
    for x, y in batches(steps):
        mine = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        opt.zero_grad()
        nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()
        ref_opt.zero_grad()
        nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    for (name, p), q in zip(ref.named_parameters(), model.module.parameters()):
        check_close(f"OSS final weight {name}", q.detach(), p.detach())
    print(f"oss: {steps} steps match plain PyTorch", flush=True)


def run_pipe() -> None:
    from fairscale.nn import Pipe

    ref = make_model()
    pipe = Pipe(copy.deepcopy(ref), balance=[2, 2], devices=["cpu", "cpu"], chunks=2)
    x = torch.randn(8, 16)
    check_close("Pipe output", pipe(x), ref(x))
    print("pipe: output matches plain PyTorch", flush=True)


def optional(name: str, fn, *args) -> None:
    try:
        fn(*args)
    except ImportError as exc:
        print(f"{name}: not provided by this fairscale ({exc})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    if "WORLD_SIZE" not in os.environ:  # started alone: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        print(f"rank {rank}/{world}: fairscale {fairscale.__version__}", flush=True)
        train_fsdp(args.steps, rank, world)
        optional("oss", train_oss, args.steps, rank, world)
        optional("pipe", run_pipe)
        print("fairscale script: ok", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
