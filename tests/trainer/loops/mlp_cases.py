"""A small fault-tolerant MLP loop with the faults users make, switched on by flags (run by test_examples.py).

--bad-state-group G --bad-state-at S   group G's own registered state gains a value recovery cannot carry (a set)
                                        once the job reaches step S
--seed-by-group                         every group initialises its weights from its own seed
--no-sync                               trust the seeds: no step-0 weight sync (shows what the sync prevents)
"""

from __future__ import annotations

import argparse
from typing import Any

import ftjob.ft as ft
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset


def dataset(n: int = 4096) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 16, generator=gen)
    return TensorDataset(x, (x.sum(dim=1) > 0).long())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--bad-state-group", default=None)
    p.add_argument("--bad-state-at", type=int, default=0)
    p.add_argument("--seed-by-group", action="store_true")
    p.add_argument("--no-sync", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(1)

    session = ft.init(device="cpu", sync_at_start=not args.no_sync)
    group = session.cfg.manager.group
    torch.manual_seed(int(group) + 1 if args.seed_by_group else 0)
    model = ft.DistributedDataParallel(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2)))
    optimizer = ft.Optimizer(torch.optim.SGD(model.parameters(), lr=0.05))

    notes: dict[str, Any] = {"seen": 0}

    def notes_state() -> dict[str, Any]:
        if group == args.bad_state_group and session.step >= args.bad_state_at:
            return {**notes, "tags": {"a", "b"}}  # a set: recovery cannot carry it
        return dict(notes)

    ft.register_state("notes", state_dict=notes_state, load_state_dict=notes.update)
    loader = ft.DataLoader(dataset(), batch_size=8, steps=args.steps)
    for x, y in loader:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        notes["seen"] += len(x)


if __name__ == "__main__":
    main()
