"""Launched by torchrun from test_fsdp.py: FSDP in a process group built from torchrun's env."""

import os
import sys

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fsdp_scenarios  # noqa: E402

if __name__ == "__main__":
    dist.init_process_group("gloo")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world == int(os.environ["WORLD_SIZE"]) and rank == int(os.environ["RANK"])
    fsdp_scenarios.scenario_mlp(rank, world)
    fsdp_scenarios.scenario_transformer_auto_wrap(rank, world)
    dist.destroy_process_group()
    print(f"rank {rank} ok", flush=True)
