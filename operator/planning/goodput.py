"""Goodput: the share of a job's wall time and group-seconds that produced committed steps (pure, no I/O).

The accumulator lives in .status.goodput (its `state` keeps what the next interval needs), so a restarted or newly
elected operator goes on from the last accounted time and never counts an interval twice. The definition is in
docs/operations/observability.md ("Goodput"); `advance` is the whole computation.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

# a group's state in one sample (also the `state` label of ftjob_job_groups)
CONTRIBUTING, SPARE, HEALING, STARTING, FAILED = "contributing", "spare", "healing", "starting", "failed"
FINISHED = "finished"  # trained to the end and left: the job's tail, not an idle spare
GROUP_STATES = (CONTRIBUTING, SPARE, HEALING, STARTING, FAILED, FINISHED)
STARTUP, FAILURE_STALL, REJOIN, BELOW_MINIMUM, SPARE_IDLE, LOST_WORK, OTHER = (
    "startup", "failureStall", "rejoin", "belowMinimum", "spareIdle", "lostWork", "other",
)  # fmt: skip
WALL_CAUSES = (STARTUP, FAILURE_STALL, REJOIN, BELOW_MINIMUM, LOST_WORK, OTHER)
GROUP_CAUSES = (STARTUP, FAILURE_STALL, REJOIN, BELOW_MINIMUM, SPARE_IDLE, LOST_WORK, OTHER)
GAP_CAP_S = 10.0  # of a longer gap between polls (operator down) the unproductive rest is "other": nobody saw it
STEP_WINDOW = 50  # intervals whose seconds-per-step give the reference step time (median)
DEFER_MAX_S = 300.0  # a healthy interval without a commit waits for the step in flight at most this long
_GROUP_BADPUT = {SPARE: SPARE_IDLE, HEALING: REJOIN, STARTING: REJOIN, FAILED: FAILURE_STALL, FINISHED: OTHER}


@dataclass(frozen=True)
class Sample:
    """What one lighthouse poll (or its absence) shows. `step` is None when the lighthouse gave no fresh answer."""

    t: float
    step: int | None
    quorum: list[str] = field(default_factory=list)  # groups of the current quorum
    groups: dict[int, str] = field(default_factory=dict)  # every wanted group -> one of GROUP_STATES
    below_minimum: bool = False  # the lighthouse waits for min_replicas, or fewer than minReplicas groups live
    restarts: int = 0  # group + lighthouse restarts so far (restartsByReason summed): a rise is a failure
    lighthouse_generation: int = 0  # a new one is a failure (its quorum re-forms)
    suspended: bool = False
    first_quorum: tuple[float, int] | None = None  # (when, step) the lighthouse formed its first listed quorum
    # training again steps that had committed before the whole job was lost (a restore below the committed step)
    replaying: bool = False


def advance(previous: dict[str, Any] | None, sample: Sample | None, created: float, end: float | None = None
            ) -> dict[str, Any]:  # fmt: skip
    """The goodput status after `sample` (None: nothing new; `end`: the job finished then, the figures freeze)."""
    g = _blank(created) if not previous or "state" not in previous else _copy(previous)
    st = g["state"]
    if st.get("ended"):
        return _summarise(g)
    if sample is not None and sample.t > st["lastPoll"]:
        t1 = min(sample.t, end) if end is not None else sample.t
        _interval(g, sample, max(t1, st["until"]))
    if end is not None:
        if end > st["until"]:  # after the last poll, up to the end: nothing committed was seen
            dt = end - st["until"]
            _account(g, dt, 0.0, dt, OTHER, {}, len(st.get("groupsLast") or ()))
            st["until"] = end
        st["ended"] = True
    return _summarise(g)


def _interval(g: dict[str, Any], s: Sample, t1: float) -> None:
    st = g["state"]
    gap_excess = max(0.0, s.t - st["lastPoll"] - GAP_CAP_S)
    st["lastPoll"] = s.t
    quorum_before = set(st["quorum"])
    wanted = {str(i) for i in s.groups}
    failure = (
        s.restarts > st["restarts"]
        or s.lighthouse_generation != st["lighthouseGeneration"]
        or bool((quorum_before - set(s.quorum)) & wanted)  # a group left the quorum (one scaled away did not fail)
        or (s.step is None and not s.suspended)  # the lighthouse is unreachable
        or any(v == FAILED for v in s.groups.values())
    )
    # each group's state at the last poll (a status written before `groupStates` kept only the contributors)
    if "groupStates" in st:
        states_before = dict(st["groupStates"])
    else:
        states_before = dict.fromkeys(st.get("contributors") or [], CONTRIBUTING)
    contributors_before = {i for i, v in states_before.items() if v == CONTRIBUTING}
    membership_changed = set(s.quorum) != quorum_before or _contributors(s) != contributors_before
    st["restarts"], st["lighthouseGeneration"] = s.restarts, s.lighthouse_generation
    st["quorum"], st["groupsLast"] = sorted(s.quorum), sorted(s.groups)
    # pairs, not a map: .status is merge-patched, which would keep the keys of groups scaled away
    st["groupStates"] = [[str(i), v] for i, v in sorted(s.groups.items())]
    ds, first = 0, False
    if s.step is not None and st["step"] is None and s.quorum and s.first_quorum is not None:
        t_q, step_q = s.first_quorum
        if st["until"] < t_q < t1 and step_q <= s.step:
            # training began at the first quorum, before this poll saw it: start-up ends there, and the steps since
            # are this interval's progress (a baseline at this poll's step would count them as start-up)
            _account(g, t_q - st["until"], 0.0, 0.0, STARTUP, s.groups, len(s.groups))
            st["until"], st["step"] = t_q, step_q
            contributors_before = _contributors(s)  # they have trained together since that quorum
    if s.step is not None:
        if st["step"] is None:
            if s.quorum:  # the first quorum's step is the baseline (a job may resume from a checkpoint)
                st["step"] = s.step
        elif s.step > st["step"]:  # the highest committed step: steps trained again after a rollback are no progress
            ds, st["step"] = s.step - st["step"], s.step
            if st["committedAt"] is None:  # its interval began in start-up: no measure of the step pace
                st["committedAt"], first = s.t, True
    committed = st["committedAt"] is not None
    if not committed:
        cause = STARTUP
    elif s.suspended:  # the user paused the job: no cause of ours
        cause = OTHER
    elif s.below_minimum:
        cause = BELOW_MINIMUM
    elif failure:
        cause = FAILURE_STALL
    elif s.replaying:
        cause = LOST_WORK
    elif any(v in (HEALING, STARTING) for v in s.groups.values()):
        cause = REJOIN
    else:
        cause = OTHER
    dt = t1 - st["until"]
    step_s = _step_seconds(st)
    # slow steps: a healthy interval with no commit yet waits (within bounds) for the step in flight to land
    if ds == 0 and cause == OTHER and not membership_changed and dt < min(2 * step_s or DEFER_MAX_S, DEFER_MAX_S):
        return
    if ds > 0 and not first:
        st["stepTimes"] = (st["stepTimes"] + [[dt / ds, int(not membership_changed and not failure)]])[-STEP_WINDOW:]
        step_s = _step_seconds(st)
    productive = min(dt, ds * step_s if step_s else dt) if ds else 0.0
    unobserved = min(dt - productive, gap_excess)
    weights = _contribution(s.groups, contributors_before)
    contributing = sum(weights.values())
    _account(g, dt, productive, unobserved, cause, s.groups, len(s.groups), contributing, weights, states_before)
    st["until"] = t1


def _contribution(groups: dict[int, str], before: set[str]) -> dict[int, float]:
    """The share of the interval each group contributed. A poll sees states, not when they changed: a group that
    started or stopped contributing since the last poll did so at an unknown moment, and half the interval is the
    unbiased estimate (the poll's end state alone would bias every failure's interval one way). One that finished
    trained through its last step in the interval."""
    out: dict[int, float] = {}
    for i, v in groups.items():
        was = str(i) in before
        if v == CONTRIBUTING:
            out[i] = 1.0 if was else 0.5
        elif was:
            out[i] = 1.0 if v == FINISHED else 0.5
    return out


def _account(g: dict[str, Any], dt: float, productive: float, unobserved: float, cause: str, groups: dict[int, str],
             n: int, contributing: float = 0.0, weights: dict[int, float] | None = None,
             states_before: dict[str, str] | None = None) -> None:  # fmt: skip
    """Adds one interval: wall `dt` = productive + cause + unobserved ("other"); group-seconds n * dt likewise."""
    weights = weights or {}
    wall, gs = g["badputSeconds"], g["badputGroupSeconds"]
    observed = dt - unobserved
    g["elapsedSeconds"] += dt
    g["productiveSeconds"] += productive
    wall[cause] += observed - productive
    wall[OTHER] += unobserved
    g["groupSeconds"] += n * dt
    g["productiveGroupSeconds"] += contributing * productive
    gs[OTHER] += n * unobserved
    if cause in (STARTUP, BELOW_MINIMUM):  # nothing can train: every group waits for the same reason
        gs[cause] += n * observed - contributing * productive
        return
    gs[cause] += contributing * (observed - productive)
    for i, v in groups.items():
        idle = 1.0 - weights.get(i, 0.0)
        if idle > 0:  # its state's cause; a group now contributing lost its other share to what it was before
            was = (states_before or {}).get(str(i), HEALING)
            gs[_GROUP_BADPUT.get(v if v != CONTRIBUTING else was, REJOIN)] += idle * observed
    gs[REJOIN] += (n - len(groups)) * observed  # wanted groups the sample does not list yet


def _contributors(s: Sample) -> set[str]:
    return {str(i) for i, v in s.groups.items() if v == CONTRIBUTING}


def _step_seconds(st: dict[str, Any]) -> float:
    times = st["stepTimes"]
    stable = [x for x, ok in times if ok] or [x for x, _ in times]
    return float(statistics.median(stable)) if stable else 0.0


def _blank(created: float) -> dict[str, Any]:
    return {
        "elapsedSeconds": 0.0,
        "productiveSeconds": 0.0,
        "groupSeconds": 0.0,
        "productiveGroupSeconds": 0.0,
        "badputSeconds": dict.fromkeys(WALL_CAUSES, 0.0),
        "badputGroupSeconds": dict.fromkeys(GROUP_CAUSES, 0.0),
        "state": {
            "until": created,  # accounted up to here (time before the first poll is start-up)
            "lastPoll": created,
            "step": None,  # the highest committed step seen
            "committedAt": None,
            "quorum": [],
            "groupsLast": [],
            "restarts": 0,
            "lighthouseGeneration": 0,
            "stepTimes": [],  # [seconds per step, 1 if membership was stable]
            "ended": False,
        },
    }


def _copy(previous: dict[str, Any]) -> dict[str, Any]:
    g = _blank(0.0)
    for key in ("elapsedSeconds", "productiveSeconds", "groupSeconds", "productiveGroupSeconds"):
        g[key] = float(previous.get(key) or 0.0)
    for key, causes in (("badputSeconds", WALL_CAUSES), ("badputGroupSeconds", GROUP_CAUSES)):
        g[key] = {c: float((previous.get(key) or {}).get(c) or 0.0) for c in causes}
    g["state"].update(previous["state"])
    g["state"]["stepTimes"] = [list(x) for x in g["state"]["stepTimes"]]
    return g


def _summarise(g: dict[str, Any]) -> dict[str, Any]:
    ratio = g["productiveSeconds"] / g["elapsedSeconds"] if g["elapsedSeconds"] > 0 else 0.0
    group_ratio = g["productiveGroupSeconds"] / g["groupSeconds"] if g["groupSeconds"] > 0 else 0.0
    g["ratio"], g["groupRatio"] = round(min(1.0, ratio), 6), round(min(1.0, group_ratio), 6)
    g["percent"] = f"{100 * g['ratio']:.1f}%"
    g["stepSeconds"] = round(_step_seconds(g["state"]), 6)
    return g
