"""The reference byte-level GPT (ftjob.gpt) on the standard library's sources, trained with the high-level API.

    ftjob-trainer launch --replicas 3 --kill-at 50 -- python examples/gpt.py

(``ftjob-trainer train`` is the same model on the lower-level Manager API, with the reference trainer's extras.)
"""

from __future__ import annotations

import argparse

import ftjob.ft as ft
import torch
from ftjob.gpt.data import Corpus, SampleSource
from ftjob.gpt.model import GPT, preset
from torch.utils.data import Dataset


class ByteBlocks(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Map-style view of the corpus: sample i is block i (inputs) and the same block shifted by one byte (targets)."""

    def __init__(self, source: SampleSource) -> None:
        self.source = source

    def __len__(self) -> int:
        return self.source.num_samples

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.source.samples(i, 1)
        return x[0], y[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--model", default="tiny")
    p.add_argument("--batch-size", type=int, default=8, help="samples per group at full strength")
    p.add_argument("--corpus-bytes", type=int, default=1 << 20)
    args = p.parse_args()
    torch.set_num_threads(1)

    ft.init(device="cpu")
    model = ft.DistributedDataParallel(GPT(preset(args.model)))
    optimizer = ft.Optimizer(torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), foreach=False))
    warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 10))
    scheduler = ft.LRScheduler(warmup)
    dataset = ByteBlocks(SampleSource(Corpus.load(max_bytes=args.corpus_bytes), preset(args.model).block_size))
    loader = ft.DataLoader(dataset, batch_size=args.batch_size, steps=args.steps)

    for x, y in loader:
        optimizer.zero_grad()
        _logits, loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()


if __name__ == "__main__":
    main()
