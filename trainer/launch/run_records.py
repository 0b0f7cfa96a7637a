"""Checks of a finished run from the groups' run records (ftjob.ft.records): sample accounting, timelines, stalls.

``sample_coverage`` turns the commit records into the ``dropped``/``duplicated`` counts of the launcher's report.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from ftjob.ft.records import CommitRecord, FinishedRecord, StartRecord
from pydantic import BaseModel, Field

Records = Sequence[StartRecord | CommitRecord | FinishedRecord]


class Coverage(BaseModel):
    """How the committed steps cover the sample stream."""

    committed: int = 0  # distinct samples in committed steps
    dropped: int = 0  # samples skipped between committed steps
    duplicated: int = 0  # samples committed twice
    inconsistent_steps: list[int] = Field(default_factory=list)  # groups disagree on a step's range
    shard_errors: list[int] = Field(default_factory=list)  # a step's shards do not tile its range exactly


def sample_coverage(records_by_group: dict[str, Records]) -> Coverage:
    """Check that the committed steps cover the sample stream ``[0, end)`` once each.

    Every group logs, for each step it commits, the whole step's range, so one group's lost last line (killed
    between commit and write) cannot fake a gap. A step re-trained after a whole-job restart from a checkpoint
    must reproduce the same range; a different range is reported as inconsistent.
    """
    step_range: dict[int, tuple[int, int]] = {}
    shards: dict[int, dict[int, tuple[int, int]]] = defaultdict(dict)
    num_shards: dict[int, int] = {}
    cov = Coverage()
    for records in records_by_group.values():
        for r in records:
            if not isinstance(r, CommitRecord):
                continue
            step, rng = r.step, (r.cursor, r.step_samples)
            if step_range.setdefault(step, rng) != rng and step not in cov.inconsistent_steps:
                cov.inconsistent_steps.append(step)
            num_shards[step] = r.num_contributors
            if r.contributing:
                shard_rng = (r.shard_start, r.shard_count)
                if shards[step].setdefault(r.shard, shard_rng) != shard_rng and step not in cov.shard_errors:
                    cov.shard_errors.append(step)
    expected = 0
    for step in sorted(step_range):
        start, count = step_range[step]
        end = start + count
        if start > expected:
            cov.dropped += start - expected
        elif start < expected:
            cov.duplicated += min(expected, end) - start
        expected = max(expected, end)
        got = shards.get(step, {})
        if len(got) == num_shards[step]:  # every contributor's line survived: they must tile the step exactly
            tiles = sorted(got.values())
            pos = start
            for s_start, s_count in tiles:
                if s_start != pos:
                    break
                pos += s_count
            if pos != end and step not in cov.shard_errors:
                cov.shard_errors.append(step)
    cov.committed = sum(c for _, c in step_range.values()) - cov.duplicated
    cov.inconsistent_steps.sort()
    cov.shard_errors.sort()
    return cov


@dataclass(frozen=True)
class GroupTimeline:
    """One group's committed-step history, as the report and the timeline plot need it."""

    group: str
    commits: list[tuple[float, int, bool]]  # (wall time, step reached, contributing)
    starts: list[tuple[float, str]]  # (wall time, incarnation)
    segments: list[list[tuple[float, int]]]  # (wall time, step) of each process incarnation's commits
    final_step: int
    param_digest: str | None
    final_loss: float | None


def group_timeline(group: str, records: Records) -> GroupTimeline:
    commit_records = [r for r in records if isinstance(r, CommitRecord)]
    commits = [(r.t, r.step, r.contributing) for r in commit_records]
    starts = [(r.t, r.incarnation) for r in records if isinstance(r, StartRecord)]
    finished = [r for r in records if isinstance(r, FinishedRecord)]
    losses = [r.loss for r in commit_records if r.loss is not None]
    segments: dict[str, list[tuple[float, int]]] = {}
    for r in commit_records:
        segments.setdefault(r.incarnation, []).append((r.t, r.step))
    final_step = max([s for _, s, _ in commits] + [r.step for r in finished] + [0])
    return GroupTimeline(
        group=group,
        commits=commits,
        starts=starts,
        segments=list(segments.values()),
        final_step=final_step,
        param_digest=finished[-1].param_digest if finished else None,
        final_loss=losses[-1] if losses else None,
    )


def rejoin_seconds(victim: GroupTimeline, kill_time: float) -> float | None:
    """Seconds from a kill to the victim's first contributing commit by a later incarnation (None: never rejoined)."""
    later = [t for t, _, contributing in victim.commits if t > kill_time and contributing]
    return (min(later) - kill_time) if later else None


def survivor_stall(survivors: list[GroupTimeline], start: float, end: float) -> float:
    """Longest gap between consecutive commits of any survivor that overlaps ``[start, end]``.

    That gap covers the survivors' failure detection, the quorum change, and serving the victim's heal.
    """
    worst = 0.0
    for g in survivors:
        for seg in g.segments:  # within one incarnation: a group's own death and restart is not a stall
            times = sorted(t for t, _ in seg)
            for a, b in itertools.pairwise(times):
                if b >= start and a <= end:
                    worst = max(worst, b - a)
    return worst


def median_step_seconds(timelines: list[GroupTimeline]) -> float | None:
    gaps = []
    for g in timelines:
        times = sorted(t for t, _, _ in g.commits)
        gaps.extend(b - a for a, b in itertools.pairwise(times))
    if not gaps:
        return None
    gaps.sort()
    return gaps[len(gaps) // 2]
