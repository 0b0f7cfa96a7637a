"""`kubectl ftjob status`: one job object and its Events rendered as one screen of text (pure: no I/O).

Every status field may be missing (an older operator, a job created a moment ago): those show as "-".
"""

from __future__ import annotations

from typing import Any

from ftjob.operator.kubectl.events import FAILURE, JobEvent, age, parse_time

DASH = "-"
LAST_FAILURES = 5


def _s(value: Any) -> str:
    return DASH if value is None or value == "" else str(value)


def _seconds(value: Any) -> str:
    if not isinstance(value, int | float):
        return DASH
    return f"{value:.0f}s" if value >= 100 else f"{value:.1f}s"


def _percent(ratio: Any) -> str:
    return f"{100 * ratio:.1f}%" if isinstance(ratio, int | float) else DASH


def group_state(g: dict[str, Any]) -> str:
    """contributing | spare | healing | the pod phase (Pending, Failed, ...) | migrating | finished."""
    phase = g.get("phase")
    if g.get("finished"):
        return "finished"
    if g.get("migrating"):
        return "migrating"
    if phase == "Running":
        if g.get("contributing") is True:
            return "contributing"
        if g.get("spare") is True:
            return "spare"
        if g.get("contributing") is False:
            return "healing"
    return _s(phase)


def header(job: dict[str, Any], now: float) -> list[str]:
    meta = job.get("metadata") or {}
    status = job.get("status") or {}
    spec = job.get("spec") or {}
    phase = _s(status.get("phase"))
    if status.get("reason"):
        phase += f" ({status['reason']})"
    created = parse_time(meta.get("creationTimestamp"))
    lines = [
        f"Job:       {_s(meta.get('name'))}   namespace {_s(meta.get('namespace'))}   age "
        f"{age(now - created) if created is not None else DASH}",
        f"Phase:     {phase}",
    ]
    want = f"replicas {_s(spec.get('replicas'))}, min {_s(spec.get('minReplicas'))}"
    if spec.get("spareReplicas"):
        want += f", spares {spec['spareReplicas']}"
    lines.append(f"Groups:    ready {_s(status.get('ready'))}   ({want})")
    lines.append(shape_line(spec))
    by_reason = status.get("restartsByReason") or {}
    reasons = ", ".join(f"{k}: {v}" for k, v in sorted(by_reason.items(), key=lambda kv: -int(kv[1] or 0)) if v)
    lines.append(f"Restarts:  {_s(status.get('totalRestarts'))}" + (f"   ({reasons})" if reasons else ""))
    q = status.get("quorum") or {}
    lines.append(f"Quorum:    id {_s(q.get('id'))}   size {_s(q.get('size'))}   committed step {_s(q.get('step'))}")
    if status.get("restored"):
        lines.append(restored_line(status["restored"]))
    lines.append(goodput_line(status.get("goodput")))
    if status.get("integrity"):
        lines.append(integrity_line(status["integrity"]))
    return lines


def restored_line(restored: dict[str, Any]) -> str:
    """The newest whole-job restore: the step lost, the step training went on from, and when."""
    frm, to = restored.get("fromStep"), restored.get("toStep")
    source = "step 0 (no checkpoint)" if to == 0 else f"checkpoint of step {_s(to)}"
    lost = f"{frm - to} steps trained again" if isinstance(frm, int) and isinstance(to, int) else "?"
    return f"Restored:  from {source} after losing step {_s(frm)} ({lost}) at {_s(restored.get('time'))}"


def _count(n: Any, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s") if isinstance(n, int) else f"{DASH} {noun}s"


def shape_line(spec: dict[str, Any]) -> str:
    """The job's shape: groups (contributing + spare) x pods per group x ranks per pod, and a group's world size
    (the ranks that share one sharded state)."""
    replicas = spec.get("replicas")
    groups = replicas + (spec.get("spareReplicas") or 0) if isinstance(replicas, int) else None
    pods = spec.get("podsPerReplica", 1)
    ranks = spec.get("ranksPerPod", 1)
    line = f"Shape:     {_count(groups, 'group')} x {_count(pods, 'pod')} x {_count(ranks, 'rank')}"
    if isinstance(pods, int) and isinstance(ranks, int):
        line += f"   ({_count(pods * ranks, 'rank')} per group)"
    return line


def integrity_line(integrity: dict[str, Any]) -> str:
    """The gradient guard's and the digest check's counts (status.integrity)."""
    line = (
        f"Integrity: guard refused {_s(integrity.get('guardOffences'))}, evicted {_s(integrity.get('guardEvictions'))}"
        f"   divergences {_s(integrity.get('divergences'))}   digests compared {_s(integrity.get('digestsCompared'))}"
    )
    if integrity.get("lastComparedStep") is not None:
        line += f" (last at step {integrity['lastComparedStep']})"
    return line


def goodput_line(goodput: dict[str, Any] | None) -> str:
    g = goodput or {}
    wall = g.get("percent") or _percent(g.get("ratio"))
    line = f"Goodput:   {wall}   group {_percent(g.get('groupRatio'))}"
    if isinstance(g.get("elapsedSeconds"), int | float):
        line += f"   over {_seconds(g['elapsedSeconds'])}"
    if isinstance(g.get("stepSeconds"), int | float):
        line += f"   step {_seconds(g['stepSeconds'])}"
    # what rounds to 0.0s is noise
    causes = {k: v for k, v in (g.get("badputSeconds") or {}).items() if isinstance(v, int | float) and v >= 0.05}
    top = sorted(causes.items(), key=lambda kv: -kv[1])[:3]
    line += "\nBadput:    " + (", ".join(f"{k} {_seconds(v)}" for k, v in top) if top else DASH)
    return line


def groups_table(job: dict[str, Any]) -> list[str]:
    status = job.get("status") or {}
    per_group = (job.get("spec") or {}).get("podsPerReplica")
    rows = [("GROUP", "STATE", "PODS", "GEN", "RESTARTS", "STEP", "NODE", "NOTE")]
    for g in status.get("replicaGroups") or []:
        pods = len(g.get("pods") or [])
        note = g.get("waiting") or g.get("migrating") or g.get("lastFailure") or ""
        rows.append(
            (
                _s(g.get("index")),
                group_state(g),
                f"{pods}/{per_group}" if per_group else str(pods),
                _s(g.get("generation")),
                _s(g.get("restarts")),
                _s(g.get("step")),
                _s(g.get("node")),
                note,
            )
        )
    if len(rows) == 1:
        return ["(no replica groups in status yet)"]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    out = []
    for r in rows:
        note = r[-1] if len(r[-1]) <= 70 else r[-1][:69] + "…"
        out.append("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + note)
    return [line.rstrip() for line in out]


def failures(events: list[JobEvent], now: float, last: int = LAST_FAILURES) -> list[str]:
    bad = [e for e in events if e.kind == FAILURE][-last:]
    if not bad:
        return ["(none)"]
    reason_w = max(len(e.reason) for e in bad)
    out = []
    for e in reversed(bad):  # newest first
        msg = e.message.replace("\n", " ")
        msg = msg if len(msg) <= 90 else msg[:89] + "…"
        times = f" (x{e.count})" if e.count > 1 else ""
        out.append(f"{age(now - e.time) if e.time is not None else DASH:>7} ago  {e.reason:<{reason_w}}  {msg}{times}")
    return out


def render(job: dict[str, Any], events: list[JobEvent], now: float) -> str:
    lines = header(job, now)
    lines += ["", *groups_table(job), "", f"Last failures (newest first, at most {LAST_FAILURES}):"]
    lines += ["  " + line for line in failures(events, now)]
    return "\n".join(lines)
