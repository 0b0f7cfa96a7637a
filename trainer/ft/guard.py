"""The gradient guard's verdict: a pure function of every contributing group's gradient sum of squares.

Before a step commits, each group's rank i learns the local gradient sum of squares of rank i of every group in the
quorum (one tiny all-reduce beside the gradient buckets: ftjob.ft.grad_sync). A sharded group's ranks then sum those
rows in the commit vote they take anyway (ftjob.ft.manager_group.InGroup.all_true_summing), so every rank of every
group judges every group's WHOLE gradient from the same numbers, and a refused step commits nowhere. (One shard is
no yardstick: its norm is far more heavy-tailed than the whole gradient's. Two healthy groups of the tiny model, 2
shards each, were seen 144x apart on shard 1 of one batch; their whole gradients stay within ~10x.)

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
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ftjob import contract
from ftjob.contract.lighthouse_api import GuardOffence

DEFAULT_NORM_RATIO = 100.0  # healthy groups of a tiny model were seen ~95x apart on one batch
COLUMNS = 3  # one row per group of the quorum: (group id, contributing flag, gradient sum of squares)


@dataclass(frozen=True)
class GuardConfig:
    """Whether the guard runs and its threshold. Every group of a job must use the same setting (the guard adds a
    collective to each step, as the bucket layout must match)."""

    enabled: bool = True
    norm_ratio: float = DEFAULT_NORM_RATIO

    def __post_init__(self) -> None:
        if not (math.isfinite(self.norm_ratio) and self.norm_ratio > 1.0):
            raise ValueError(f"the gradient guard's norm ratio must be a finite number > 1, got {self.norm_ratio!r}")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] | None = None) -> GuardConfig:
        """FTJOB_GRADIENT_GUARD ("0", "false", "off", "no": disabled) and FTJOB_GUARD_NORM_RATIO."""
        env = os.environ if environ is None else environ
        enabled = not contract.switched_off(contract.ENV_GUARD, env)
        raw = env.get(contract.ENV_GUARD_NORM_RATIO, "").strip()
        try:
            ratio = float(raw) if raw else DEFAULT_NORM_RATIO
        except ValueError:
            raise ValueError(f"env {contract.ENV_GUARD_NORM_RATIO}={raw!r} is not a number") from None
        return cls(enabled=enabled, norm_ratio=ratio)


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
    sumsqs: Mapping[str, float], norm_ratio: float = DEFAULT_NORM_RATIO, loss_scaling: bool = False
) -> list[GuardOffence]:
    """The offenders among the contributors (group id -> gradient sum of squares), in group order; [] passes."""
    norms = {g: math.sqrt(s) if math.isfinite(s) and s >= 0 else None for g, s in sumsqs.items()}
    offences = []
    for group in sorted(norms, key=int):
        norm = norms[group]
        others = [n for g, n in norms.items() if g != group and n is not None]
        median = statistics.median(others) if others else None
        if norm is None and not loss_scaling:
            offences.append(GuardOffence(group=group, kind="nonfinite", norm=None, median=median))
        elif norm is not None and median is not None and median > 0 and norm > norm_ratio * median:
            offences.append(GuardOffence(group=group, kind="norm_outlier", norm=norm, median=median))
    return offences


def describe(offences: Sequence[GuardOffence], norm_ratio: float) -> str:
    """For logs and ``manager.last_error``: who was refused and what was seen."""
    parts = []
    for o in offences:
        if o.kind == "nonfinite":
            parts.append(f"group {o.group}: gradient not finite (NaN/Inf)")
        else:
            parts.append(
                f"group {o.group}: gradient norm {o.norm:.4g} > {norm_ratio:g} x {o.median:.4g} (the median of the "
                "other contributors' norms)"
            )
    return "the gradient guard refused the step: " + "; ".join(parts)
