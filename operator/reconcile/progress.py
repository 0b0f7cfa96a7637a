"""The worker's goodput and progress-history bookkeeping (pure, no I/O): turns what it sees (the last lighthouse
poll, the plan's state and phases) into a goodput Sample, advances .status.goodput and samples .status.history.

Both live in .status only, so an operator restart or leader change goes on from what the last one wrote.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ftjob.operator.lighthouse.view import LighthouseView
from ftjob.operator.planning import goodput as G
from ftjob.operator.planning import plan as P
from ftjob.operator.state.job_spec import JobSpec
from ftjob.operator.state.job_state import JobState

POLL_S = 2.0  # the worker's lighthouse poll period (worker.LIGHTHOUSE_POLL_S)
STALE_S = 3 * POLL_S  # a view older than this says nothing about now: the lighthouse is unreachable
HISTORY_MAX = 120
HISTORY_EVERY_S = 1.9  # at most one history entry per poll, unless membership changed
HISTORY_KEEP_NEWEST = 20  # thinning drops every other entry of the older part only
_DOWN_PHASES = (P.PHASE_RESTARTING, P.PHASE_BACKING_OFF, P.PHASE_FAILED)


@dataclass(frozen=True)
class Progress:
    goodput: dict[str, Any]
    history: list[dict[str, Any]]
    groups: dict[str, int] = field(default_factory=dict)  # group state -> count, in the latest sample
    step: int | None = None
    quorum: int | None = None


def group_states(view: LighthouseView | None, spec: JobSpec, state: JobState, phases: dict[int, str]
                 ) -> dict[int, str]:  # fmt: skip
    """Each wanted group's state: from its lighthouse membership, else from the plan (failed or still starting)."""
    if state.suspended:
        return {}  # no pods, nothing wanted: no group-seconds accrue while suspended
    out: dict[int, str] = {}
    for idx in sorted(set(state.groups) | set(range(spec.total_groups))):
        info = view.groups.get(str(idx)) if view is not None else None
        g = state.groups.get(idx)
        down = g is not None and (g.failed_at is not None or phases.get(idx) in _DOWN_PHASES)
        if view is None:
            out[idx] = G.FAILED if (g is not None and phases.get(idx) == P.PHASE_RUNNING) or down else G.STARTING
        elif info is None:
            out[idx] = G.FAILED if down else G.STARTING
        elif info.contributing and not info.finished:
            out[idx] = G.CONTRIBUTING
        elif info.healing:
            out[idx] = G.HEALING
        elif info.finished:
            out[idx] = G.FINISHED
        elif info.in_quorum:
            out[idx] = G.SPARE
        else:
            out[idx] = G.STARTING  # registered, not yet in a quorum
    return out


def sample(view: LighthouseView | None, t: float, spec: JobSpec, state: JobState, phases: dict[int, str]) -> G.Sample:
    """`view` None: the lighthouse gave no fresh answer (not up yet, unreachable, replaced)."""
    groups = group_states(view, spec, state, phases)
    running = sum(1 for p in phases.values() if p == P.PHASE_RUNNING)
    # once groups finish training, fewer running is the job ending, not a pause
    below = not state.suspended and state.completing_since is None and running < spec.min_replicas
    if view is not None:
        # the lighthouse says "waiting for min_replicas: 0 of N" between quorums too, while every group computes:
        # it is a pause only while some group is actually asking and held back
        asking = any(m.asking for m in view.groups.values())
        below = below or (asking and view.blocked_reason.startswith("waiting for min_replicas"))
        live = len([m for m in view.groups.values() if not m.finished])
        below = below or (bool(view.quorum_id) and not view.finished_groups and live < spec.min_replicas)
    return G.Sample(
        t=t,
        step=None if view is None else view.step,
        quorum=list(view.quorum_groups) if view is not None else [],
        groups=groups,
        below_minimum=below,
        restarts=sum(state.restarts_by_reason.values()),
        lighthouse_generation=state.lighthouse_generation,
        suspended=state.suspended,
        first_quorum=_first_quorum_at(view, t),
        replaying=view is not None and view.replaying,
    )


def _first_quorum_at(view: LighthouseView | None, t: float) -> tuple[float, int] | None:
    """The view's first quorum as (wall time, step): its age is taken back from `t`, when the answer came."""
    if view is None or view.first_quorum is None:
        return None
    age, step = view.first_quorum
    return t - age, step


def track(previous: dict[str, Any] | None, view: LighthouseView | None, view_at: float, spec: JobSpec,
          state: JobState, phases: dict[int, str], created: float, now: float) -> Progress:  # fmt: skip
    """Advance goodput by the newest poll not yet accounted (or by an 'unreachable' sample when polls stopped)."""
    previous = previous or {}
    before = previous.get("goodput") or None
    last_poll = float(((before or {}).get("state") or {}).get("lastPoll") or created)
    s: G.Sample | None = None
    if view is not None and view_at > last_poll:
        s = sample(view, view_at, spec, state, phases)
    elif now - max(view_at, last_poll) >= STALE_S or (view is None and now - last_poll >= POLL_S):
        s = sample(None, now, spec, state, phases)
    end = None
    if state.outcome is not None:
        end = state.completion_time or now
    gp = G.advance(before, s, created, end)
    history = list(previous.get("history") or [])
    if s is not None and s.step is not None and view is not None:
        history = record(history, s.t, gp["state"]["step"] or s.step, view)
    counts = {k: 0 for k in G.GROUP_STATES}
    for v in (s.groups if s is not None else {}).values():
        counts[v] += 1
    quorum = view.quorum_size if view is not None else None
    return Progress(gp, history, counts if s is not None else {}, gp["state"]["step"], quorum)


def record(history: list[dict[str, Any]], t: float, step: int, view: LighthouseView) -> list[dict[str, Any]]:
    """Appends a sample at most every HISTORY_EVERY_S, and always when membership changed; when full, drops every
    other older entry, so the bounded list keeps covering the whole run (first and last always kept)."""
    entry = {
        "t": round(t, 3),
        "step": int(step),
        "quorum": int(view.quorum_size or 0),
        "groups": {g: int(m.step) for g, m in sorted(view.groups.items())},
    }
    last = history[-1] if history else None
    if last is not None:
        if t <= last["t"]:
            return history
        same = last.get("quorum") == entry["quorum"] and set(last.get("groups") or {}) == set(entry["groups"])
        if same and t - last["t"] < HISTORY_EVERY_S:
            return history
    out = [*history, entry]
    while len(out) > HISTORY_MAX:
        cut = len(out) - HISTORY_KEEP_NEWEST
        out = out[:cut:2] + out[cut:]
    return out
