"""Turns a finished local run (the groups' records + the launcher's own kill/restart log) into the JSON report."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ftjob.trainer.report import (
    group_timeline,
    median_step_seconds,
    read_run_dir,
    rejoin_seconds,
    sample_coverage,
    survivor_stall,
)


@dataclass
class LaunchEvents:
    """What the launcher did and saw, with wall times."""

    t0: float
    kills: list[tuple[float, str]] = field(default_factory=list)  # injected SIGKILLs
    crashes: list[tuple[float, str, list[int | None]]] = field(default_factory=list)  # exits nobody injected
    restarts: dict[str, int] = field(default_factory=dict)
    stranded: list[str] = field(default_factory=list)  # restarted after every other group had finished


def build_report(run_dir: Path, events: LaunchEvents, groups: list[str], t_end: float) -> dict[str, Any]:
    records = read_run_dir(run_dir)
    timelines = {g: group_timeline(g, records.get(g, [])) for g in groups}
    rejoins: list[float | None] = []
    stalls: list[float] = []
    kill_times = sorted(events.kills)
    for t_kill, victim in kill_times:
        rj = rejoin_seconds(timelines[victim], t_kill)
        rejoins.append(rj)
        survivors = [tl for g, tl in timelines.items() if g != victim]
        stalls.append(survivor_stall(survivors, t_kill, t_kill + rj if rj is not None else t_end))
    coverage = sample_coverage(records)
    digests = [timelines[g].param_digest for g in groups]
    corpus = {r.get("corpus_digest") for recs in records.values() for r in recs if r["event"] == "start"}
    losses = [tl.final_loss for tl in timelines.values() if tl.final_loss is not None]
    return {
        "steps_committed": max((tl.final_step for tl in timelines.values()), default=0),
        "groups": [
            {
                "group": g,
                "final_step": timelines[g].final_step,
                "param_digest": timelines[g].param_digest,
                "restarts": events.restarts.get(g, 0),
            }
            for g in groups
        ],
        "digests_equal": len(set(digests)) == 1 and None not in digests,
        "failures_injected": len(events.kills),
        "stranded_groups": events.stranded,
        "unexpected_exits": [{"t": t - events.t0, "group": g, "exit_codes": c} for t, g, c in events.crashes],
        "survivor_stall_seconds_max": max(stalls, default=0.0),
        "survivor_stall_seconds": stalls,
        "median_step_seconds": median_step_seconds(list(timelines.values())),
        "rejoin_seconds": rejoins,
        "samples": coverage.as_dict(),
        "corpus_digests_equal": len(corpus) <= 1,
        "final_loss": (sum(losses) / len(losses)) if losses else None,
        "wall_seconds": t_end - events.t0,
    }


def rejoin_marks(report: dict[str, Any], events: LaunchEvents) -> list[tuple[float, str]]:
    """(wall time, group) of each rejoin, for the timeline plot."""
    marks = []
    for (t_kill, victim), rj in zip(sorted(events.kills), report["rejoin_seconds"], strict=False):
        if rj is not None:
            marks.append((t_kill + rj, victim))
    return marks
