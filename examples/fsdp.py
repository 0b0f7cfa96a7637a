"""A residual MLP sharded with FSDP2 inside each replica group (HSDP): the group's ranks shard the model, the groups
replicate it fault-tolerantly. Run with two ranks per group:

    ftjob-trainer launch --replicas 2 --pods-per-replica 2 --kill-at 20 -- python examples/fsdp.py

``ft.init()`` initialises torch.distributed for the group's own ranks; shard over them as usual, then wrap.
"""

from __future__ import annotations

import argparse

import ftjob.ft as ft
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import TensorDataset


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc(F.gelu(self.norm(x)))


class ResidualMLP(nn.Module):
    def __init__(self, features: int = 32, width: int = 64, depth: int = 3, classes: int = 10) -> None:
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.out = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def synthetic_classes(n: int = 16384, features: int = 32, classes: int = 10) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=gen)
    y = (x @ torch.randn(features, classes, generator=gen)).argmax(dim=1)
    return TensorDataset(x, y)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank at full strength")
    args = p.parse_args()
    torch.set_num_threads(1)

    ft.init(device="cpu")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))  # this group's ranks only
    net = ResidualMLP()
    for block in net.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(net, mesh=mesh)
    model = ft.DistributedDataParallel(net)
    optimizer = ft.Optimizer(torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False))
    loader = ft.DataLoader(synthetic_classes(), batch_size=args.batch_size, steps=args.steps)

    for x, y in loader:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()


if __name__ == "__main__":
    main()
