"""Which samples a rank trains at one step: the step's fixed global batch split over the groups contributing to it.

The training data is one endless stream of sample positions; each committed step consumes ``[cursor, cursor +
global_batch)`` and moves the cursor on, whoever contributed. The batch is cut into quanta of ``ranks x
accumulation_steps`` samples; contributor ``c`` of ``n`` takes an even share of the quanta (the first ones one more
when they do not divide), so inside a group every rank and every pass gets the same number of samples, and only
whole groups may differ by a quantum. A step that does not commit is trained again from the same cursor, so across
any membership change every position is trained exactly once. A group that does not contribute (a spare, a group
healing) is lent contributor 0's share to run its forward and backward on: its gradients become zeros, its samples
are not counted.

``weight`` makes uneven shares exact: a group's gradient (the mean over its own samples) is multiplied by
``share / (global_batch / n)`` before the groups' gradients are averaged, which then equals the mean over the global
batch. With even shares it is exactly 1 and nothing is multiplied.

Position ``p`` names sample ``order(epoch)[p % n]`` of an ``n``-sample map-style dataset, ``epoch = p // n``: a fresh
permutation per epoch (seeded, identical in every group), or the dataset's own order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def even_share(total: int, parts: int, index: int) -> tuple[int, int]:
    """``(offset, count)`` of part ``index`` when ``total`` items are split into ``parts`` near-equal runs."""
    if not 0 <= index < parts:
        raise ValueError(f"part {index} out of range for {parts} parts")
    base, extra = divmod(total, parts)
    return index * base + min(index, extra), base + (1 if index < extra else 0)


@dataclass(frozen=True)
class MicroBatch:
    """One forward/backward pass of one rank: stream positions ``[start, start + count)``."""

    start: int
    count: int

    def positions(self) -> range:
        """The pass's stream positions."""
        return range(self.start, self.start + self.count)


@dataclass(frozen=True)
class StepShard:
    """What one rank trains at one step, and the share of its group it belongs to."""

    group_start: int  # the group's share of the step: [group_start, group_start + group_count)
    group_count: int
    weight: float  # the group's gradient weight (see the module's doc); 1.0 for even shares
    micro_batches: tuple[MicroBatch, ...]  # this rank's passes, in order


def step_shard(
    cursor: int,
    global_batch: int,
    num_contributors: int,
    contributor: int,
    ranks: int = 1,
    rank: int = 0,
    accumulation_steps: int = 1,
) -> StepShard:
    """The samples rank ``rank`` of contributor ``contributor`` trains at the step starting at ``cursor``."""
    quantum = ranks * accumulation_steps
    if global_batch % quantum:
        raise ValueError(
            f"global batch {global_batch} must be a multiple of ranks per group x accumulation steps "
            f"({ranks} x {accumulation_steps}), so every pass of a group gets as many samples"
        )
    quanta = global_batch // quantum
    if quanta < num_contributors:
        raise ValueError(f"global batch {global_batch} is too small for {num_contributors} contributing groups")
    q_off, per_pass = even_share(quanta, num_contributors, contributor)
    group_start = cursor + q_off * quantum
    rank_start = group_start + rank * per_pass * accumulation_steps
    micro = tuple(MicroBatch(rank_start + k * per_pass, per_pass) for k in range(accumulation_steps))
    weight = 1.0 if quanta % num_contributors == 0 else per_pass * num_contributors / quanta
    return StepShard(group_start, per_pass * quantum, weight, micro)


class SampleOrder:
    """Stream position -> dataset index: a seeded permutation per epoch (``shuffle``) or the dataset's order."""

    def __init__(self, size: int, shuffle: bool, seed: int) -> None:
        if size < 1:
            raise ValueError("the dataset is empty")
        self.size, self.shuffle, self.seed = size, shuffle, seed
        self._epoch = -1
        self._perm: list[int] = []

    def index(self, position: int) -> int:
        """The dataset index of stream position ``position`` (the epoch's permutation when shuffling)."""
        epoch, i = divmod(position, self.size)
        if not self.shuffle:
            return i
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed + epoch)
            self._perm, self._epoch = torch.randperm(self.size, generator=gen).tolist(), epoch
        return self._perm[i]
