"""The sharding helper (pure logic): each step's global batch tiles exactly over its contributors, ranks and passes,
whatever the membership does from step to step, and uneven shares are weighed to the exact global mean."""

from __future__ import annotations

import random

import pytest
import torch
from ftjob.ft.wrappers.sharding import SampleOrder, even_share, step_shard


def positions(cursor: int, batch: int, n: int, ranks: int, k: int) -> list[int]:
    """Every position all contributors' ranks train in one step, in order."""
    out = []
    for c in range(n):
        for r in range(ranks):
            shard = step_shard(cursor, batch, n, c, ranks, r, k)
            out += [p for m in shard.micro_batches for p in m.positions()]
    return out


@pytest.mark.parametrize(("batch", "ranks", "k"), [(24, 1, 1), (24, 2, 1), (24, 2, 3), (30, 1, 2), (96, 4, 2)])
def test_any_membership_sequence_trains_every_position_exactly_once(batch: int, ranks: int, k: int) -> None:
    rng = random.Random(batch * 7 + ranks + k)
    cursor, seen = 0, []
    for _ in range(40):
        n = rng.randint(1, min(5, batch // (ranks * k)))  # no contributor may go empty
        if rng.random() < 0.2:  # the step did not commit: trained again from the same cursor, nothing counted
            continue
        step = positions(cursor, batch, n, ranks, k)
        assert sorted(step) == list(range(cursor, cursor + batch)), (n, ranks, k)
        seen += step
        cursor += batch
    assert sorted(seen) == list(range(cursor)) and len(seen) == len(set(seen))


def test_inside_a_group_every_rank_and_pass_gets_as_many_samples() -> None:
    for c in range(3):
        sizes = {m.count for r in range(2) for m in step_shard(0, 2 * 2 * 10, 3, c, 2, r, 2).micro_batches}
        assert len(sizes) == 1  # 10 quanta over 3 groups: 4, 3, 3 per pass


def test_weights_make_uneven_group_means_the_global_mean() -> None:
    batch, n = 10, 3  # 4 + 3 + 3 samples
    values = torch.arange(batch, dtype=torch.float64) ** 2
    shards = [step_shard(0, batch, n, c) for c in range(n)]
    group_means = [values[s.group_start : s.group_start + s.group_count].mean() for s in shards]
    averaged = sum(s.weight * m for s, m in zip(shards, group_means, strict=True)) / n  # what the all-reduce does
    assert torch.isclose(averaged, values.mean())
    assert [step_shard(0, 12, 3, c).weight for c in range(3)] == [1.0, 1.0, 1.0]  # even shares: untouched


def test_batches_that_cannot_be_shared_fairly_are_refused() -> None:
    with pytest.raises(ValueError, match="multiple of ranks per group x accumulation steps"):
        step_shard(0, 10, 1, 0, ranks=4)
    with pytest.raises(ValueError, match="too small for 5 contributing groups"):
        step_shard(0, 4, 5, 0)
    assert even_share(10, 3, 0) == (0, 4) and even_share(10, 3, 2) == (7, 3)


def test_sample_order_is_a_seeded_permutation_per_epoch() -> None:
    a, b = SampleOrder(50, shuffle=True, seed=3), SampleOrder(50, shuffle=True, seed=3)
    first = [a.index(p) for p in range(50)]
    assert sorted(first) == list(range(50)) and first != list(range(50))
    second = [a.index(p) for p in range(50, 100)]
    assert sorted(second) == list(range(50)) and second != first  # a new order each epoch
    assert [b.index(p) for p in range(100)] == first + second  # identical in every group
    assert [SampleOrder(5, shuffle=False, seed=0).index(p) for p in range(7)] == [0, 1, 2, 3, 4, 0, 1]
