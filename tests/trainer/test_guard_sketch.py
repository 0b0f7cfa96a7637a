"""The gradient guard's sketch check, pure parts: the count-sketch projection (ftjob.ft.integrity.sketch) and the
verdict on the groups' gathered rows (ftjob.ft.integrity.guard.judge_sketches), with the contributions, their float32
sum and every group's row built here as ftjob.ft.allreduce.grad_sync builds them."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import pytest
import torch
from ftjob import contract
from ftjob.ft.integrity import sketch
from ftjob.ft.integrity.fault_injection import FaultInjection
from ftjob.ft.integrity.guard import (
    BLIND_RATIO,
    FLOAT32_ROUNDOFF,
    SKETCH_COLUMNS,
    GuardConfig,
    Verdict,
    judge_sketches,
    sketch_rows,
)

CPU = torch.device("cpu")


def projection(nonce: int = 7, quorum: int = 1, rank: int = 0) -> sketch.Projection:
    return sketch.Projection(sketch.derive_seed(nonce, quorum, rank))


# --- the projection ----------------------------------------------------------------------------------------------
def test_the_chunked_sketch_of_bucket_runs_equals_the_dense_matrix(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs cut at chunk and span boundaries, over several buckets, hash every coordinate as P's own columns do."""
    monkeypatch.setitem(sketch._CHUNK, "cpu", 7)
    monkeypatch.setattr(sketch, "_SPAN", 32)  # many keys in a small tensor
    torch.manual_seed(0)
    x = torch.randn(300, dtype=torch.float64)
    p = projection()
    dense = p.matrix(300)
    assert torch.equal(dense.abs().sum(0), torch.ones(300, dtype=torch.float64))  # one +-1 per column
    (chunked,) = p.sketch([[x[:13], x[13:200], x[200:]]], CPU)
    assert torch.allclose(chunked, dense @ x, rtol=0, atol=1e-12)
    assert {round(v) for v in dense[dense != 0].tolist()} == {-1, 1}


def reference_slot(p: sketch.Projection, i: int) -> int:
    """The hash in plain 32-bit arithmetic: what torch's int32 ops must compute on every device, or groups would
    regenerate different projections."""

    def s32(v: int) -> int:
        v &= 0xFFFFFFFF
        return v - (1 << 32) if v >= 1 << 31 else v

    k1, k2 = p._key(i // sketch._SPAN)
    x = s32((i % sketch._SPAN) * sketch._M1 + k1)
    x = s32(x ^ ((x >> 15) & 0x1FFFF))
    x = s32(s32(x * sketch._M2) ^ k2)
    x = s32(x ^ ((x >> 13) & 0x7FFFF))
    x = s32(x * sketch._M3)
    return (x >> (32 - p.dim.bit_length())) & (2 * p.dim - 1)


def test_the_hash_is_plain_32_bit_arithmetic() -> None:
    p = projection(12345)
    for start in (0, 1 << 20, 3 * sketch._SPAN - 64):  # the last run's coordinates are in a span of their own key
        index = p.hashes(start, 64, CPU).tolist()
        assert index == [reference_slot(p, start + k) for k in range(64)], start
    assert set(p.hashes(0, 1 << 16, CPU).unique().tolist()) == set(range(2 * sketch.DIM))  # every bucket, both signs


def test_the_sketch_is_linear_and_shares_one_hash_between_sources() -> None:
    torch.manual_seed(1)
    a, b = torch.randn(5000, dtype=torch.float64), torch.randn(5000, dtype=torch.float64)
    p = projection()
    sa, sb, mix, none = p.sketch([[a], [b], [2 * a - 3 * b], None], CPU)
    assert torch.allclose(mix, 2 * sa - 3 * sb, rtol=0, atol=1e-9)
    assert torch.equal(none, torch.zeros(sketch.DIM, dtype=torch.float64))
    assert torch.equal(p.sketch([[a]], CPU)[0], sa)  # deterministic: every group regenerates the same P
    with pytest.raises(ValueError, match="same bucket lengths"):
        p.sketch([[a], [b[:10]]], CPU)


def test_the_sum_of_squares_estimate_is_unbiased_and_concentrated() -> None:
    """A spread vector: ||Px||^2 / ||x||^2 over many seeds averages 1 and each stays near it (spread ~sqrt(2/DIM)).
    A vector whose mass sits in one column of a weight matrix (one large feature) is no worse: its coordinates
    land in random buckets, not one."""
    torch.manual_seed(2)
    spread = torch.randn(20000)
    column = torch.zeros(200, 100)
    column[:, 3] = torch.randn(200) + 5.0  # one feature with a large mean, as a few LLM features have
    for x in (spread, column.flatten()):
        truth = float(x.double().square().sum())
        ratios = [sketch.sumsq(projection(nonce).sketch([[x]], CPU)[0]) / truth for nonce in range(200)]
        assert abs(statistics.mean(ratios) - 1.0) < 0.03
        assert min(ratios) > 0.5 and max(ratios) < 1.6


def test_each_step_draws_an_independent_projection() -> None:
    """Which coordinates share a bucket changes with the seed: a fixed pair collides in ~1/DIM of the seeds (an
    adversary cannot pick a pair that always cancels), with either sign relation; the seed binds the nonce sum,
    the quorum and the rank in the group (each shard its own projection)."""
    n = 4096
    pairs = [(0, 1), (5, 5 + sketch.DIM), (9, 9 + 2 * sketch.DIM), (100, 3000)]
    seeds = 3000
    collisions = dict.fromkeys(pairs, 0)
    same_sign = dict.fromkeys(pairs, 0)
    for nonce in range(seeds):
        index = projection(nonce).hashes(0, n, CPU)
        for i, j in pairs:
            if index[i] % sketch.DIM == index[j] % sketch.DIM:
                collisions[(i, j)] += 1
                same_sign[(i, j)] += int(index[i] == index[j])
    for pair in pairs:
        assert 2 <= collisions[pair] <= 30, (pair, collisions[pair])  # expected seeds / DIM ~ 11.7
        assert 0 < same_sign[pair] < collisions[pair] or collisions[pair] < 4, (pair, same_sign[pair])
    base = projection(1, 1, 0).matrix(64)
    for other in (projection(2, 1, 0), projection(1, 2, 0), projection(1, 1, 1)):
        assert not torch.equal(other.matrix(64), base)
    x, y = torch.randn(n), torch.randn(n)
    s1 = projection(1).sketch([[x]], CPU)[0]
    s2 = projection(2).sketch([[x]], CPU)[0]
    assert abs(float(torch.nn.functional.cosine_similarity(s1, s2, dim=0))) < 0.3  # unrelated views of one x
    assert not torch.equal(projection(1).sketch([[y]], CPU)[0], s1)


# --- rows as the groups build them -------------------------------------------------------------------------------
@dataclass
class Group:
    sent: torch.Tensor  # what it put into the all-reduce (weighted)
    claimed: torch.Tensor | None = None  # what it sketches (a liar's fake); None: what it sent
    reported: float | None = None  # the sum of squares it reports; None: the truth
    contributing: bool = True


def float32_sum(tensors: list[torch.Tensor], order: list[int]) -> torch.Tensor:
    total = torch.zeros_like(tensors[0])
    for i in order:
        total = total + tensors[i]  # float32 at every addition, as a ring all-reduce adds
    return total


def rows_for(groups: list[Group], nonce: int = 3, order: list[int] | None = None) -> list[list[float]]:
    p = projection(nonce)
    total = float32_sum([g.sent for g in groups], order or list(range(len(groups))))
    (sum_sketch,) = p.sketch([[total]], CPU)
    rows = []
    for i, g in enumerate(groups):
        claimed = g.sent if g.claimed is None else g.claimed
        (own,) = p.sketch([[claimed]], CPU)
        truth = float(g.sent.double().square().sum())
        row = [float(i), 1.0 if g.contributing else 0.0, truth if g.reported is None else g.reported]
        rows.append([*row, float(total.double().square().sum()), *own.tolist(), *sum_sketch.tolist()])
    assert all(len(r) == SKETCH_COLUMNS for r in rows)
    return rows


def verdict(groups: list[Group], nonce: int = 3, **kw: object) -> Verdict:
    return judge_sketches(sketch_rows(rows_for(groups, nonce), 1), **kw)  # type: ignore[arg-type]


def gradients(n: int = 3, size: int = 20000, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=gen) * (0.5 + i) for i in range(n)]


def test_honest_float32_sums_pass_whatever_the_order_of_addition() -> None:
    """No false positive: the sum's float32 rounding, in any order, stays inside the tolerance (many steps)."""
    for step in range(40):
        grads = gradients(3, 5000, seed=step)
        grads[1] = grads[1] * 50  # magnitudes apart (within the norm rule's ratio): the large one's rounding counts
        for order in ([0, 1, 2], [2, 1, 0], [1, 0, 2]):
            v = judge_sketches(sketch_rows(rows_for([Group(g) for g in grads], step, order), 1))
            assert v == Verdict([]), (step, order, v)


def test_a_group_lying_in_its_sketch_is_refused_and_nobody_is_named() -> None:
    """It sends x1000 but sketches (and reports) its clean gradient: the sketches no longer add up to the sum's."""
    clean = gradients()
    liar = Group(clean[1] * 1000, claimed=clean[1], reported=float(clean[1].double().square().sum()))
    v = verdict([Group(clean[0]), liar, Group(clean[2])])
    assert v.offences == [] and v.unattributed
    assert v.refused is not None and "do not add up to the sketch of the sum" in v.refused
    small = Group(clean[1] * (1 + 1e-4), claimed=clean[1])  # a lie far smaller than a norm rule would ever see
    assert verdict([Group(clean[0]), small, Group(clean[2])]).unattributed


def test_a_group_misreporting_its_norm_is_named_from_its_checked_sketch() -> None:
    clean = gradients()
    liar = Group(clean[1] * 1000, reported=float(clean[1].double().square().sum()))  # its sketch tells the truth
    v = verdict([Group(clean[0]), liar, Group(clean[2])])
    assert [(o.group, o.kind) for o in v.offences] == [("1", "norm_mismatch")] and not v.unattributed
    assert v.offences[0].norm == pytest.approx(1000 * float(clean[1].norm()), rel=0.3)
    assert v.refused is not None and "group 1: reports sending a gradient of norm" in v.refused
    modest = Group(clean[1], reported=float(clean[1].double().square().sum()) / 100)  # says 10x less than it sent
    assert [o.kind for o in verdict([Group(clean[0]), modest, Group(clean[2])]).offences] == ["norm_mismatch"]


def test_the_norm_rule_runs_on_the_checked_sketch_norms() -> None:
    clean = gradients()
    honest_outlier = Group(clean[2] * 1000)  # a faulty GPU: it reports what it sends
    v = verdict([Group(clean[0]), Group(clean[1]), honest_outlier])
    assert [(o.group, o.kind) for o in v.offences] == [("2", "norm_outlier")]
    assert v.offences[0].norm == pytest.approx(float(honest_outlier.sent.norm()), rel=0.3)
    over = Group(clean[1], reported=1e12)  # over-reporting: nobody is fooled by it, nothing to judge
    assert verdict([Group(clean[0]), over, Group(clean[2])]) == Verdict([])


def test_a_group_that_says_it_sends_nothing_must_send_zeros() -> None:
    clean = gradients()
    spare = Group(clean[2], contributing=False)  # a spare's row, but a gradient in the sum
    v = verdict([Group(clean[0]), Group(clean[1]), spare])
    assert [(o.group, o.kind) for o in v.offences] == [("2", "norm_mismatch")]
    idle = Group(torch.zeros_like(clean[2]), contributing=False)
    assert verdict([Group(clean[0]), Group(clean[1]), idle]) == Verdict([])


def test_non_finite_gradients() -> None:
    clean = gradients()
    nan = clean[1].clone()
    nan[17] = float("nan")
    v = verdict([Group(clean[0]), Group(nan), Group(clean[2])])
    assert [(o.group, o.kind) for o in v.offences] == [("1", "nonfinite")]
    hidden = Group(nan, claimed=clean[1], reported=1.0)  # sends a NaN, shows nothing of it
    v = verdict([Group(clean[0]), hidden, Group(clean[2])])
    assert v.offences == [] and v.unattributed and "not finite" in (v.refused or "")
    # Under loss scaling every group's scaler skips a non-finite update: only the norm rule, on finite sketches.
    assert verdict([Group(clean[0]), hidden, Group(clean[2])], loss_scaling=True) == Verdict([])
    scaled = verdict([Group(clean[0]), Group(nan), Group(clean[2] * 1000)], loss_scaling=True)
    assert [o.kind for o in scaled.offences] == ["norm_outlier"]


def test_a_contribution_built_to_cancel_in_this_steps_buckets_is_refused() -> None:
    """A spike on two coordinates that this step's P maps to one bucket with one sign cancels in every sketch; the
    sum's own norm shows it. (A real liar cannot aim: P is drawn after it sent. Here the test knows P.)"""
    nonce, size = 11, 20000
    index = projection(nonce).hashes(0, size, CPU)
    i = 0
    j = next(k for k in range(1, size) if index[k] == index[i])  # same bucket, same sign
    clean = gradients(size=size)
    spike = torch.zeros(size)
    spike[i], spike[j] = 1e4, -1e4
    liar = Group(clean[1] + spike, reported=float(clean[1].double().square().sum()))
    v = verdict([Group(clean[0]), liar, Group(clean[2])], nonce)
    assert v.offences == [] and v.unattributed and f"over {BLIND_RATIO:g}x" in (v.refused or "")


def test_sharded_groups_are_judged_on_the_sum_of_their_shards_rows() -> None:
    """Each rank sketches its shard with its own seed; the group's vote sums its ranks' rows: the sum of shard
    sketches is a sketch of the whole gradient, and the check holds on whole rows."""
    shards = [gradients(2, 4000, seed=s) for s in (0, 1)]  # shards[rank][group]
    tables = []
    for rank, grads in enumerate(shards):
        if rank == 1:
            grads = [grads[0], grads[1] * 1000]  # group 1's second shard x1000, its report clean
        groups = [Group(g, reported=float(shards[rank][i].double().square().sum())) for i, g in enumerate(grads)]
        tables.append(rows_for(groups, nonce=rank))
    summed = [[a + b for a, b in zip(r0, r1, strict=True)] for r0, r1 in zip(*tables, strict=True)]
    v = judge_sketches(sketch_rows(summed, 2))
    assert [(o.group, o.kind) for o in v.offences] == [("1", "norm_mismatch")]
    partial = [list(r) for r in summed]
    partial[1][1] = 1.0  # group 1 says one of its shards sent nothing: still judged, so still named
    assert [(o.group, o.kind) for o in judge_sketches(sketch_rows(partial, 2)).offences] == [("1", "norm_mismatch")]
    partial[0][1] = 1.0  # an honest partial group is neither named nor a yardstick
    assert [o.group for o in judge_sketches(sketch_rows(partial, 2)).offences] == ["1"]


def test_bf16_buckets_get_a_tolerance_of_their_own_rounding() -> None:
    grads = [g.to(torch.bfloat16) for g in gradients(3, 5000)]
    rows = sketch_rows(rows_for([Group(g) for g in grads]), 1)
    assert judge_sketches(rows, roundoff=torch.finfo(torch.bfloat16).eps / 2) == Verdict([])
    assert judge_sketches(rows, roundoff=FLOAT32_ROUNDOFF).unattributed  # float32's tolerance is too tight for it


# --- configuration and faults ------------------------------------------------------------------------------------
def test_the_switch_from_the_env_contract() -> None:
    assert GuardConfig.from_environ({}).sketch is False
    for on in ("1", "on", "TRUE", "yes"):
        assert GuardConfig.from_environ({contract.ENV_GUARD_SKETCH: on}).sketch is True
    assert GuardConfig.from_environ({contract.ENV_GUARD_SKETCH: "off"}).sketch is False
    with pytest.raises(ValueError, match=contract.ENV_GUARD_SKETCH):
        GuardConfig.from_environ({contract.ENV_GUARD_SKETCH: "maybe"})


def test_lying_faults_hide_their_norm_and_lie_fakes_its_sketch() -> None:
    misreport = FaultInjection.parse("group=1,kind=misreport,factor=100,step=0").corruption(0, True)
    lie = FaultInjection.parse("group=1,kind=lie,factor=100,step=0").corruption(0, True)
    scale = FaultInjection.parse("group=1,kind=scale,factor=100,step=0").corruption(0, True)
    assert misreport is not None and lie is not None and scale is not None
    assert misreport.hides_norm and misreport.claim is None
    assert not scale.hides_norm and scale.claim is None
    flat = torch.ones(3)
    lie(flat)
    assert flat.tolist() == [100.0] * 3 and lie.hides_norm and lie.claim is not None
    assert lie.claim(flat).tolist() == [1.0] * 3
    with pytest.raises(ValueError, match="not 0 for lie"):
        FaultInjection.parse("group=1,kind=lie,factor=0,step=0")
    assert math.isclose(FaultInjection.parse("group=1,kind=lie,step=0").factor, 1000.0)
