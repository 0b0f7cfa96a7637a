"""The gradient guard's verdict: a pure function of every contributing group's gradient sum of squares (with the
sketch check, of every group's gathered sketches, below).

Before a step commits, each group's rank i learns the local gradient sum of squares of rank i of every group in the
quorum (one tiny all-reduce beside the gradient buckets: ftjob.ft.allreduce.grad_sync). A sharded group's ranks then sum
those rows in the commit vote they take anyway (ftjob.ft.step.manager_group.InGroup.all_true_summing), so every rank of
every group judges every group's WHOLE gradient from the same numbers, and a refused step commits nowhere. (One shard is
no yardstick: its norm is far more heavy-tailed than the whole gradient's. The same shard of two healthy groups can lie
orders of magnitude apart on one batch while their whole gradients stay within the norm rule's bound.)

The rule (defaults: FTJOB_GRADIENT_GUARD on, FTJOB_GUARD_NORM_RATIO 100):

  * a contributor whose sum of squares is not finite (a NaN or Inf anywhere in its gradient, or a norm beyond
    float32's range, ~1.8e19) is refused: "nonfinite";
  * a contributor whose norm exceeds ``norm_ratio`` x the median of the OTHER contributors' finite norms is refused:
    "norm_outlier" (leave-one-out median, so the outlier does not drag its own yardstick; high side only: a small
    gradient is never a fault; no judgement against a zero median, where any ratio is meaningless).

With one contributor only the non-finite check applies. Non-contributors (spares, healing groups, failed steps)
send a zero row and are not judged. The norm is the raw gradient's: a group's share weight is divided back out.

Under dynamic loss scaling (a GradScaler) a non-finite gradient is an expected overflow the scaler handles itself:
the average is non-finite in every group, so every group skips the update and lowers the scale alike. Refusing it
would retrain the same data at the same scale forever, so then non-finite groups are neither judged nor a yardstick
and only the norm rule applies.

The sketch check (FTJOB_GUARD_SKETCH=1; off by default: it costs a copy of the sent buckets and a few passes over
the gradient per step). The rule above judges what each group SAYS its norm is, in a summed table any group may
write anywhere into: it stops faults, not a group that lies (sends x1000 and reports its clean norm, or writes into
another group's row). With the check on, the numbers judged are ones the others can verify
(ftjob.ft.allreduce.grad_sync, ftjob.ft.integrity.sketch). The threat: a group hands the collectives whatever tensors it
likes, but the collectives deliver the same bytes to every member (an unmodified torch.distributed).

  1. the gradient all-reduce completes: every contribution c_g is fixed in the sum S every group now holds;
  2. only then each group adds a fresh random nonce into one all-reduce; their sum (random if one group's nonce is),
     the quorum id and the rank in the group seed a count-sketch projection P (``sketch.DIM`` = 256 outputs, one per
     shard of a sharded group) that nobody could know while choosing what to send;
  3. each group all-gathers its row: the sketch P c_g of what it sent, the sketch P S of the sum as it received it,
     the sum of squares it reports, ||S||^2 and whether it contributes. An all-gather: a group writes its own row.

Every group judges the same gathered rows, so every group reaches the same verdict:

  * refused with nobody named ("sketch_mismatch"): sum_g P c_g differs from some group's P S by more than the sum's
    own float rounding (``SUM_TOLERANCE`` x groups x the buckets' unit roundoff x sum_g ||P c_g||). P is linear, so
    honest sketches add up; someone described another gradient than it sent. Likewise when the sum is not finite
    but no group's row says so (not under loss scaling), and when ||S|| exceeds ``BLIND_RATIO`` x what P S shows of
    it (a contribution that happens to cancel in this step's buckets: a spike on two coordinates does with chance
    1/(2 DIM), anything spread wider vanishingly rarely). Sums cannot say who lied: the mismatch is P(claimed - sent)
    of the liar and carries no name. So a liar can make steps fail without being evicted (each refusal counts in
    ftjob_trainer_guard_offences{kind="sketch_mismatch"} and fails with reason guard), never make one commit.
  * otherwise each sketch is the sketch of what its group sent (with a single liar exactly; colluders can only
    shift sketch mass among themselves, and one of them then shows at least half of the sketch norm of their
    combined contribution), and the rule above runs on the sketch-derived sums of squares ||P c_g||^2 (an unbiased
    estimate of ||c_g||^2) of what each group sent, its share weight included (what the sum received): "nonfinite"
    and "norm_outlier" name groups from numbers their peers checked. A group some of whose shards sent nothing is
    judged too (a liar must not escape by saying so) but is nobody's yardstick;
  * "norm_mismatch", named: a group whose checked sketch shows more than ``MISREPORT_RATIO`` x the norm it reports
    (under-reporting: the lie that fools the rule above), or a group that says it sends nothing while its checked
    sketch is not zero. Over-reporting is not judged: an honest sketch may undershoot (entries cancelling in a
    bucket) but cannot overshoot 4x (that takes 16 entries of one sign in one bucket carrying the norm).

What it cannot do: name the liar of a sketch mismatch; judge a gradient's direction within the norm rule's bounds (a
contribution up to ``norm_ratio`` x the median is legal, whatever it points at); stop a group whose collective
library sends different bytes to different peers (the state digests catch the split that follows). Every group of
a job must use the same setting: the check changes the step's collectives.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from ftjob import contract
from ftjob.contract.lighthouse_api import GuardOffence
from ftjob.ft.integrity import sketch

DEFAULT_NORM_RATIO = 100.0  # above the spread healthy groups of a tiny model show on one batch: no false refusals
COLUMNS = 3  # one row per group of the quorum: (group id, contributing flag, gradient sum of squares)
DEFAULT_SKETCH = False
# The sketch check's row: (group id, contributing, reported sum of squares, the sum's sum of squares), then the
# sketch of what the group sent and the sketch of the sum it received.
SKETCH_COLUMNS = 4 + 2 * sketch.DIM
FLOAT32_ROUNDOFF = 2.0**-24
# How far the groups' sketches may add up from the sum's, in units of groups x roundoff x the sketches' norms: the sum
# of G float32 gradients is within (G - 1) roundoff x sum |c_g| of the exact sum, elementwise, and P keeps norms.
SUM_TOLERANCE = 4.0
BLIND_RATIO = 10.0  # ||S|| above this x its sketch's norm: the projection missed nearly all of the sum
MISREPORT_RATIO = 4.0  # a checked sketch norm above this x the reported norm: the report is a lie


@dataclass(frozen=True)
class GuardConfig:
    """Whether the guard runs, its threshold and whether it checks the groups' sketches. Every group of a job must
    use the same setting (the guard adds collectives to each step, as the bucket layout must match)."""

    enabled: bool = True
    norm_ratio: float = DEFAULT_NORM_RATIO
    sketch: bool = DEFAULT_SKETCH

    def __post_init__(self) -> None:
        if not (math.isfinite(self.norm_ratio) and self.norm_ratio > 1.0):
            raise ValueError(f"the gradient guard's norm ratio must be a finite number > 1, got {self.norm_ratio!r}")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> GuardConfig:
        """FTJOB_GRADIENT_GUARD ("0", "false", "off", "no": disabled), FTJOB_GUARD_NORM_RATIO and
        FTJOB_GUARD_SKETCH."""
        env = os.environ if environ is None else environ
        enabled = not contract.switched_off(contract.ENV_GUARD, env)
        raw = env.get(contract.ENV_GUARD_NORM_RATIO, "").strip()
        try:
            ratio = float(raw) if raw else DEFAULT_NORM_RATIO
        except ValueError:
            raise ValueError(f"env {contract.ENV_GUARD_NORM_RATIO}={raw!r} is not a number") from None
        return cls(enabled=enabled, norm_ratio=ratio, sketch=sketch_from_environ(env))


def sketch_from_environ(environ: Mapping[str, str] | None = None) -> bool:
    """FTJOB_GUARD_SKETCH: "1", "true", "on", "yes" turn the sketch check on; "0", "false", "off", "no" off; unset:
    the default. ValueError for anything else (a typo must not leave a job's groups disagreeing)."""
    env = os.environ if environ is None else environ
    raw = env.get(contract.ENV_GUARD_SKETCH, "").strip().lower()
    if raw in ("1", "true", "on", "yes"):
        return True
    if raw in ("0", "false", "off", "no"):
        return False
    if raw:
        raise ValueError(f"env {contract.ENV_GUARD_SKETCH}={raw!r}: expected 1/true/on/yes or 0/false/off/no")
    return DEFAULT_SKETCH


def whole_groups(summed: Sequence[Sequence[float]], shards: int) -> list[list[float]]:
    """The table summed over a group's ``shards`` ranks -> one row per group for its whole gradient. A group counts
    as contributing only if every one of its shards did (the ranks of a group whose step failed part-way may not
    all have sent a row; it does not commit, and a partial norm is no evidence either way)."""
    rows = []
    for group_sum, flags, sumsq in summed:
        whole = flags > shards - 0.5
        rows.append([group_sum / flags, 1.0, sumsq] if whole else [0.0, 0.0, 0.0])
    return rows


def contributions(table: Sequence[Sequence[float]]) -> dict[str, float]:
    """Group id -> gradient sum of squares, for the rows of the all-reduced table that contributed."""
    return {str(int(row[0])): float(row[2]) for row in table if row[1] > 0.5}


def judge(
    sumsqs: Mapping[str, float],
    norm_ratio: float = DEFAULT_NORM_RATIO,
    loss_scaling: bool = False,
    partial: Mapping[str, float] | None = None,
) -> list[GuardOffence]:
    """The offenders among the contributors (group id -> gradient sum of squares), in group order; [] passes.
    ``partial``: groups judged alike but no yardstick for the others (some of their shards sent nothing: their
    norm may be low, never honestly high)."""
    partial = partial or {}
    every = {**sumsqs, **partial}
    norms = {g: math.sqrt(s) if math.isfinite(s) and s >= 0 else None for g, s in every.items()}
    offences = []
    for group in sorted(norms, key=int):
        norm = norms[group]
        others = [n for g, n in norms.items() if g != group and n is not None and g not in partial]
        median = statistics.median(others) if others else None
        if norm is None and not loss_scaling:
            offences.append(GuardOffence(group=group, kind="nonfinite", norm=None, median=median))
        elif norm is not None and median is not None and median > 0 and norm > norm_ratio * median:
            offences.append(GuardOffence(group=group, kind="norm_outlier", norm=norm, median=median))
    return offences


def describe(offences: Sequence[GuardOffence], norm_ratio: float, reported: Mapping[str, float] | None = None) -> str:
    """For logs and ``manager.last_error``: who was refused and what was seen. ``reported``: the norms the groups
    said they sent (the sketch check), for its "norm_mismatch" offences."""
    parts = []
    for o in offences:
        if o.kind == "nonfinite" or o.norm is None:
            parts.append(f"group {o.group}: gradient not finite (NaN/Inf)")
        elif o.kind == "norm_mismatch":
            said = (reported or {}).get(o.group, 0.0)
            parts.append(
                f"group {o.group}: reports sending a gradient of norm {said:.4g}, but its sketch, checked against the "
                f"sum, shows {o.norm:.4g}"
            )
        else:
            parts.append(
                f"group {o.group}: gradient norm {o.norm:.4g} > {norm_ratio:g} x {o.median:.4g} (the median of the "
                "other contributors' norms)"
            )
    return "the gradient guard refused the step: " + "; ".join(parts)


# --- the sketch check ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SketchRow:
    """One group's gathered row, summed over its ranks (each rank's shard is sketched with its own projection, so
    the sum of a group's shard sketches is a sketch of its whole gradient)."""

    group: str
    contributing: bool  # every shard of it contributes
    silent: bool  # no shard of it contributes: it must send zeros
    reported: float  # the sum of squares of what it says it sent
    sum_sumsq: float  # ||S||^2 of the sum as it received it
    own: torch.Tensor  # its sketch of what it sent (float64, sketch.DIM)
    total: torch.Tensor  # its sketch of the sum


@dataclass(frozen=True)
class Verdict:
    """The guard's verdict on a step: the groups named (reported to the lighthouse) and, when refused, why."""

    offences: list[GuardOffence]
    refused: str | None = None  # for logs and ``manager.last_error``; None: the step passes
    unattributed: bool = False  # refused with nobody named (a sketch mismatch)


def sketch_rows(summed: Sequence[Sequence[float]], shards: int) -> list[SketchRow]:
    """The gathered table summed over a group's ``shards`` ranks -> one row per group. A group contributes only if
    every one of its shards did (as ``whole_groups``)."""
    rows = []
    for r in summed:
        t = torch.tensor(r, dtype=torch.float64)
        rows.append(
            SketchRow(
                group=str(round(float(t[0]) / shards)),
                contributing=bool(t[1] > shards - 0.5),
                silent=bool(t[1] < 0.5),
                reported=float(t[2]),
                sum_sumsq=float(t[3]),
                own=t[4 : 4 + sketch.DIM],
                total=t[4 + sketch.DIM :],
            )
        )
    return rows


def judge_sketches(
    rows: Sequence[SketchRow],
    norm_ratio: float = DEFAULT_NORM_RATIO,
    loss_scaling: bool = False,
    roundoff: float = FLOAT32_ROUNDOFF,
) -> Verdict:
    """The sketch check's verdict (the module's docstring) on every group's gathered row; ``roundoff``: the unit
    roundoff of the gradient buckets' dtype (every group's is the same: the same model)."""
    # A partial group (a shard of it failed and sent zeros) is judged too, though no yardstick: a liar must not
    # escape the rule by saying one of its shards sends nothing.
    est = {r.group: sketch.sumsq(r.own) for r in rows if r.contributing}
    partial = {r.group: sketch.sumsq(r.own) for r in rows if not (r.contributing or r.silent)}
    sum_finite = all(math.isfinite(r.sum_sumsq) and bool(torch.isfinite(r.total).all()) for r in rows)
    if not sum_finite:
        if loss_scaling:  # every group's scaler skips this update: only the norm rule on the finite sketches
            offences = judge(est, norm_ratio, loss_scaling=True, partial=partial)
            return Verdict(offences, describe(offences, norm_ratio) if offences else None)
        offences = [
            GuardOffence(group=r.group, kind="nonfinite")
            for r in rows
            if not r.silent and not (math.isfinite(r.reported) and math.isfinite(sketch.sumsq(r.own)))
        ]
        if offences:  # unchecked rows: only what a group says against itself names it
            return Verdict(offences, describe(offences, norm_ratio))
        why = "the sum of the gradients is not finite, yet no group's sketch or norm is: a group hid what it sent"
        return Verdict([], f"the gradient guard refused the step: {why}", unattributed=True)
    added = torch.stack([r.own for r in rows]).sum(0)
    scale = sum(float(torch.linalg.vector_norm(r.own)) for r in rows)
    tolerance = SUM_TOLERANCE * len(rows) * roundoff * scale
    mismatch = max(float(torch.linalg.vector_norm(added - r.total)) for r in rows)
    if not mismatch <= tolerance:  # NaN too: a non-finite sketch cannot add up to a finite sum
        why = (
            f"the groups' sketches of what they sent do not add up to the sketch of the sum (off by {mismatch:.4g}, "
            f"tolerance {tolerance:.4g}): a group sent another gradient than it describes, and sums cannot say which"
        )
        return Verdict([], f"the gradient guard refused the step: {why}", unattributed=True)
    for r in rows:
        seen = sketch.sumsq(r.total)
        if r.sum_sumsq > BLIND_RATIO**2 * seen:
            why = (
                f"the sum's norm {math.sqrt(r.sum_sumsq):.4g} is over {BLIND_RATIO:g}x what this step's projection "
                f"shows of it ({math.sqrt(seen):.4g}): a contribution that cancels in its buckets (a gamble on this "
                "step's projection, or a vanishingly rare accident)"
            )
            return Verdict([], f"the gradient guard refused the step: {why}", unattributed=True)
    # Every sketch is now the sketch of what its group sent: name groups from the checked numbers.
    named = {o.group: o for o in judge(est, norm_ratio, loss_scaling, partial)}
    for r in rows:
        checked = sketch.sumsq(r.own)
        lying = (
            checked > 0.0  # it says it sends nothing (zeros sketch to exactly zero)
            if r.silent
            else not (math.isfinite(r.reported) and r.reported * MISREPORT_RATIO**2 >= checked)
        )
        if lying:
            median = named[r.group].median if r.group in named else None
            named[r.group] = GuardOffence(group=r.group, kind="norm_mismatch", norm=math.sqrt(checked), median=median)
    offences = [named[g] for g in sorted(named, key=int)]
    if not offences:
        return Verdict([])
    reported = {r.group: 0.0 if r.silent else math.sqrt(max(r.reported, 0.0)) for r in rows}
    return Verdict(offences, describe(offences, norm_ratio, reported))
