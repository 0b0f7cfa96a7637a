"""A small MLP classifier made fault tolerant: the loop of a plain DDP script, only its setup lines changed.

    ftjob-trainer launch --replicas 3 --kill-at 50 -- python examples/mlp.py
    ftjob-trainer launch --replicas 3 --kill-at 50 -- python examples/mlp.py --amp --accumulate 2

``--amp`` trains under bfloat16 autocast with a GradScaler, ``--accumulate K`` accumulates K backward passes per
step (``no_sync`` as with DDP); the loop shows the order both need. The data is a synthetic map-style dataset.
"""

from __future__ import annotations

import argparse
import contextlib

import ftjob.ft as ft
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


def synthetic_classes(n: int = 16384, features: int = 32, classes: int = 10) -> TensorDataset:
    """Points labelled by a fixed random linear teacher: the same dataset in every process."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=gen)
    y = (x @ torch.randn(features, classes, generator=gen)).argmax(dim=1)
    return TensorDataset(x, y)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=32, help="samples per group and pass at full strength")
    p.add_argument("--amp", action="store_true", help="bfloat16 autocast and a GradScaler")
    p.add_argument("--accumulate", type=int, default=1, help="backward passes per optimizer step")
    args = p.parse_args()
    torch.set_num_threads(1)

    ft.init(device="cpu")
    model = ft.DistributedDataParallel(nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 10)))
    optimizer = ft.Optimizer(torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=False))
    scheduler = ft.LRScheduler(torch.optim.lr_scheduler.StepLR(optimizer, step_size=40, gamma=0.5))
    scaler = ft.GradScaler("cpu", enabled=args.amp)
    loader = ft.DataLoader(
        synthetic_classes(), batch_size=args.batch_size, steps=args.steps, accumulation_steps=args.accumulate
    )

    for i, (x, y) in enumerate(loader):
        sync = (i + 1) % args.accumulate == 0  # the last pass of a step averages the gradients across groups
        with contextlib.nullcontext() if sync else model.no_sync():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.amp):
                loss = F.cross_entropy(model(x), y) / args.accumulate
            scaler.scale(loss).backward()
        if sync:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            optimizer.zero_grad()


if __name__ == "__main__":
    main()
