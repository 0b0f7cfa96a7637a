"""`kubectl ftjob timeline`'s marks: one per failure, at the moment .status.history shows the group drop out, however
many Events (stamped to the second) that failure posted."""

from __future__ import annotations

import datetime as dt
from typing import Any

from ftjob.operator.kubectl import events as ev
from ftjob.operator.kubectl import timeline

T0 = 1_780_000_000.0  # the job's creation, unix seconds


def event(reason: str, message: str, t: float, type_: str = "Warning") -> dict[str, Any]:
    """A core/v1 Event as the apiserver serves it: its timestamps to the second."""
    stamp = dt.datetime.fromtimestamp(t, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"type": type_, "reason": reason, "message": message, "firstTimestamp": stamp, "lastTimestamp": stamp}


def job(history: list[dict[str, Any]]) -> dict[str, Any]:
    return {"metadata": {"name": "tiny", "namespace": "ns"}, "status": {"history": history}}


def sample(t: float, step: int, groups: dict[str, int]) -> dict[str, Any]:
    return {"t": T0 + t, "step": step, "quorum": len(groups), "groups": groups}


def one_group_killed() -> list[dict[str, Any]]:
    """Three groups; group 1 is killed just before 10 s, leaves the lighthouse at 11.9 s, is back healing at 20 s
    and at the job's step at 24 s."""
    rows = [sample(t, int(t), {"0": int(t), "1": int(t), "2": int(t)}) for t in (2.0, 4.0, 6.0, 8.0, 9.9)]
    rows += [sample(t, int(t), {"0": int(t), "2": int(t)}) for t in (11.9, 14.0, 16.0, 18.0)]
    rows.append(sample(20.0, 20, {"0": 20, "1": 0, "2": 20}))
    rows += [sample(t, int(t), {"0": int(t), "1": int(t), "2": int(t)}) for t in (22.0, 24.0)]
    rows[-2]["groups"]["1"] = 18  # still healing at 22 s
    return rows


def failures(marks: list[timeline.Mark]) -> list[tuple[float, str]]:
    return [(round(m.t - T0, 3), m.label) for m in marks if m.kind == ev.FAILURE]


def test_one_group_kill_is_one_mark_at_the_drop() -> None:
    events = ev.from_list(
        [
            event("GroupRestart", "PodDeleted: pod tiny-g1-0-r0 was deleted: replica group 1 restarts", T0 + 10),
            event("LighthouseEvicted", "the lighthouse dropped replica group 1: heartbeat timeout", T0 + 12, "Normal"),
        ]
    )
    marks = timeline.marks(job(one_group_killed()), events)
    assert failures(marks) == [(11.9, "GroupRestart")], marks
    assert [(round(m.t - T0, 3), m.label) for m in marks if m.kind == ev.RECOVERY] == [(24.0, "group 1 back (12s)")]


def test_a_restart_between_two_samples_shows_as_the_step_going_back() -> None:
    rows = [sample(t, int(t), {"0": int(t), "1": int(t)}) for t in (2.0, 4.0, 6.0)]
    rows += [sample(8.0, 8, {"0": 8, "1": 0}), sample(10.0, 10, {"0": 10, "1": 10})]
    events = ev.from_list([event("GroupRestart", "OOMKilled: replica group 1 restarts", T0 + 7)])
    assert failures(timeline.marks(job(rows), events)) == [(8.0, "GroupRestart")]


def test_a_drop_without_events_is_still_a_failure_and_a_scale_down_is_none() -> None:
    rows = [sample(t, int(t), {"0": int(t), "1": int(t), "2": int(t)}) for t in (2.0, 4.0)]
    rows += [sample(t, int(t), {"0": int(t), "1": int(t)}) for t in (6.0, 8.0)]
    rows += [sample(t, int(t), {"0": int(t)}) for t in (60.0, 62.0)]
    scaled = ev.from_list([event("ScaledDown", "removed replica group 2 (spec.replicas=2)", T0 + 5, "Normal")])
    assert failures(timeline.marks(job(rows), scaled)) == [(60.0, "group 1 dropped out")]


def test_failure_events_no_drop_explains_are_marked_once_per_group() -> None:
    rows = [sample(t, int(t), {"0": int(t)}) for t in (2.0, 4.0, 6.0)]
    events = ev.from_list(
        [
            event("GroupRestart", "PodDeleted: replica group 1 restarts as generation 1", T0 + 3),
            event("LighthouseEvicted", "the lighthouse dropped replica group 1: heartbeat", T0 + 5, "Normal"),
            event("Unschedulable", "0/2 nodes are available", T0 + 6),
        ]
    )
    assert failures(timeline.marks(job(rows), events)) == [(3.0, "GroupRestart"), (6.0, "Unschedulable")]
