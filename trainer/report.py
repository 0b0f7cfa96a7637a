"""Run records: what each group writes to the run directory, and the checks the launcher makes of them.

Each group's rank 0 appends JSON lines to ``<run_dir>/group-<g>.jsonl`` (one file per group across restarts):

* ``start``     -- a process came up: incarnation, step it starts from, corpus digest.
* ``commit``    -- a step was committed: the step number reached, the step's global sample range
  (``cursor``, ``step_samples``), this group's shard of it, loss, contributors, throughput.
* ``finished``  -- the last step is done: ``param_digest``.

Lines are flushed as written so a SIGKILLed group leaves every line it completed; a torn last line is skipped.
``sample_coverage`` turns the commit records into the ``dropped``/``duplicated`` counts of the report.
"""

from __future__ import annotations

import itertools
import json
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO


def group_log_path(run_dir: Path, group: str) -> Path:
    return run_dir / f"group-{group}.jsonl"


class GroupLog:
    """Append-only JSON-lines writer for one group (only the group's rank 0 writes)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f: TextIO = open(path, "a", encoding="utf-8")  # noqa: SIM115 -- held open for the process's life

    def write(self, event: str, **fields: Any) -> None:
        record = {"event": event, "t": time.time(), **fields}
        self._f.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def read_group_log(path: Path) -> list[dict[str, Any]]:
    """Every complete record in ``path`` (a missing file reads as none; a torn line from a kill is skipped)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def read_run_dir(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Group id -> its records, for every ``group-*.jsonl`` in ``run_dir``."""
    out = {}
    for path in sorted(run_dir.glob("group-*.jsonl")):
        out[path.stem.removeprefix("group-")] = read_group_log(path)
    return out


@dataclass
class Coverage:
    committed: int = 0  # distinct samples in committed steps
    dropped: int = 0  # samples skipped between committed steps
    duplicated: int = 0  # samples committed twice
    inconsistent_steps: list[int] = field(default_factory=list)  # groups disagree on a step's range
    shard_errors: list[int] = field(default_factory=list)  # a step's shards do not tile its range exactly

    def as_dict(self) -> dict[str, Any]:
        return {
            "committed": self.committed,
            "dropped": self.dropped,
            "duplicated": self.duplicated,
            "inconsistent_steps": self.inconsistent_steps,
            "shard_errors": self.shard_errors,
        }


def sample_coverage(records_by_group: dict[str, list[dict[str, Any]]]) -> Coverage:
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
            if r.get("event") != "commit":
                continue
            step, rng = int(r["step"]), (int(r["cursor"]), int(r["step_samples"]))
            if step_range.setdefault(step, rng) != rng and step not in cov.inconsistent_steps:
                cov.inconsistent_steps.append(step)
            num_shards[step] = int(r["num_contributors"])
            if r.get("contributing"):
                shard_rng = (int(r["shard_start"]), int(r["shard_count"]))
                if shards[step].setdefault(int(r["shard"]), shard_rng) != shard_rng and step not in cov.shard_errors:
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


def group_timeline(group: str, records: list[dict[str, Any]]) -> GroupTimeline:
    commits = [(r["t"], int(r["step"]), bool(r.get("contributing"))) for r in records if r["event"] == "commit"]
    starts = [(r["t"], str(r.get("incarnation", ""))) for r in records if r["event"] == "start"]
    finished = [r for r in records if r["event"] == "finished"]
    losses = [r["loss"] for r in records if r["event"] == "commit" and r.get("loss") is not None]
    segments: dict[str, list[tuple[float, int]]] = {}
    for r in records:
        if r["event"] == "commit":
            segments.setdefault(str(r.get("incarnation", "")), []).append((r["t"], int(r["step"])))
    final_step = max([s for _, s, _ in commits] + [int(r["step"]) for r in finished] + [0])
    return GroupTimeline(
        group=group,
        commits=commits,
        starts=starts,
        segments=list(segments.values()),
        final_step=final_step,
        param_digest=finished[-1]["param_digest"] if finished else None,
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
