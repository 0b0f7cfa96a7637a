"""Turns a finished local run (the groups' records + the launcher's own kill/restart log) into the report."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ftjob.contract.lighthouse_api import AuditRecord, IntegrityStatus, StatusResponse
from ftjob.ft.records import StartRecord, read_run_dir
from ftjob.launch.run_records import (
    Coverage,
    group_timeline,
    median_step_seconds,
    rejoin_seconds,
    sample_coverage,
    survivor_stall,
)
from pydantic import BaseModel


@dataclass
class LaunchEvents:
    """What the launcher did and saw, with wall times."""

    t0: float
    kills: list[tuple[float, str]] = field(default_factory=list)  # injected SIGKILLs
    crashes: list[tuple[float, str, list[int | None]]] = field(default_factory=list)  # exits nobody injected
    restarts: dict[str, int] = field(default_factory=dict)
    not_needed: list[str] = field(default_factory=list)  # killed groups whose restart came after the others finished
    evictions: list[tuple[float, str, str]] = field(default_factory=list)  # exits the lighthouse caused, and why
    lighthouse: StatusResponse | None = None  # its last status, read when every group was done
    failure: str | None = None  # why the launcher gave the run up, if it did


class GroupResult(BaseModel):
    group: str
    final_step: int
    param_digest: str | None
    restarts: int


class UnexpectedExit(BaseModel):
    t: float  # seconds since the launch
    group: str
    exit_codes: list[int | None]


class Eviction(BaseModel):
    t: float  # seconds since the launch (when its process exit was seen)
    group: str
    reason: str  # the lighthouse's, e.g. "gradient_guard: ..." or "divergent: digest at step 20 differs ..."


class LaunchReport(BaseModel):
    """``ftjob-trainer launch --report``: what a local run did, and whether it kept its promises."""

    steps_committed: int
    groups: list[GroupResult]
    digests_equal: bool  # every group that trained to the end ended with bitwise-equal parameters
    failures_injected: int
    # killed groups the run finished without: every other group had trained to the end before they could rejoin
    not_needed_groups: list[str]
    unexpected_exits: list[UnexpectedExit]
    evictions: list[Eviction] = []  # unexpected exits the lighthouse caused (integrity checks, the operator's API)
    integrity: IntegrityStatus | None = None  # the lighthouse's gradient-guard and digest counts at the end
    audit: list[AuditRecord] = []  # the lighthouse's newest job-level audit records at the end
    survivor_stall_seconds_max: float
    survivor_stall_seconds: list[float]
    median_step_seconds: float | None
    rejoin_seconds: list[float | None]  # per kill: until the victim contributed again (None: never)
    samples: Coverage
    corpus_digests_equal: bool
    final_loss: float | None
    wall_seconds: float
    failure: str | None = None  # why the launcher gave the run up (e.g. every group failing before its first step)

    @property
    def problems(self) -> list[str]:
        """What broke a promise, one phrase each: empty for a run with equal parameters in every group that trained
        to the end and every sample trained exactly once, in steps whose shares tile them."""
        s = self.samples
        found = [self.failure] if self.failure else []  # (then no group trained to the end: no digests to compare)
        unfinished = [g.group for g in self.groups if g.param_digest is None and g.group not in self.not_needed_groups]
        if unfinished and not self.failure:
            found.append(f"groups that did not finish: {unfinished}")
        elif not self.digests_equal and not self.failure:
            found.append("digests differ")
        found += [f"{n} samples {what}" for n, what in ((s.dropped, "dropped"), (s.duplicated, "duplicated")) if n]
        if s.inconsistent_steps:
            found.append(f"steps trained over different samples: {s.inconsistent_steps}")
        if s.shard_errors:
            found.append(f"steps whose shares do not tile them: {s.shard_errors}")
        return found

    @property
    def ok(self) -> bool:
        """No :attr:`problems`."""
        return not self.problems


def build_report(run_dir: Path, events: LaunchEvents, groups: list[str], t_end: float) -> LaunchReport:
    records = read_run_dir(run_dir)
    timelines = {g: group_timeline(g, records.get(g, [])) for g in groups}
    rejoins: list[float | None] = []
    stalls: list[float] = []
    for t_kill, victim in sorted(events.kills):
        rj = rejoin_seconds(timelines[victim], t_kill)
        rejoins.append(rj)
        survivors = [tl for g, tl in timelines.items() if g != victim]
        stalls.append(survivor_stall(survivors, t_kill, t_kill + rj if rj is not None else t_end))
    digests = [timelines[g].param_digest for g in groups if g not in events.not_needed]
    corpus = {r.corpus_digest for recs in records.values() for r in recs if isinstance(r, StartRecord)}
    losses = [tl.final_loss for tl in timelines.values() if tl.final_loss is not None]
    return LaunchReport(
        steps_committed=max((tl.final_step for tl in timelines.values()), default=0),
        groups=[
            GroupResult(
                group=g,
                final_step=timelines[g].final_step,
                param_digest=timelines[g].param_digest,
                restarts=events.restarts.get(g, 0),
            )
            for g in groups
        ],
        digests_equal=len(set(digests)) == 1 and None not in digests,  # (a run that lost every group has none)
        failures_injected=len(events.kills),
        not_needed_groups=events.not_needed,
        unexpected_exits=[UnexpectedExit(t=t - events.t0, group=g, exit_codes=c) for t, g, c in events.crashes],
        evictions=[Eviction(t=t - events.t0, group=g, reason=why) for t, g, why in events.evictions],
        integrity=events.lighthouse.integrity if events.lighthouse else None,
        audit=events.lighthouse.audit if events.lighthouse else [],
        survivor_stall_seconds_max=max(stalls, default=0.0),
        survivor_stall_seconds=stalls,
        median_step_seconds=median_step_seconds(list(timelines.values())),
        rejoin_seconds=rejoins,
        samples=sample_coverage(records),
        corpus_digests_equal=len(corpus) <= 1,
        final_loss=(sum(losses) / len(losses)) if losses else None,
        wall_seconds=t_end - events.t0,
        failure=events.failure,
    )


def rejoin_marks(report: LaunchReport, events: LaunchEvents) -> list[tuple[float, str]]:
    """(wall time, group) of each rejoin, for the timeline plot."""
    marks = []
    for (t_kill, victim), rj in zip(sorted(events.kills), report.rejoin_seconds, strict=False):
        if rj is not None:
            marks.append((t_kill + rj, victim))
    return marks
