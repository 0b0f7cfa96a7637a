"""`kubectl ftjob timeline`: the committed step of every replica group over time, from the job's .status.history,
with the failures (red) and recoveries (green) marked, drawn with matplotlib into a PNG. A failure is marked once,
where the history shows its groups drop out; the job's Events only name it (they are stamped to the second, and one
failure posts several).

matplotlib is imported only here and only when drawing (it is in the `trainer` extra, not the operator's image).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ftjob.operator.kubectl.events import FAILURE, RECOVERY, JobEvent, parse_time


class TimelineError(Exception):
    """A one-line reason the timeline cannot be drawn."""


@dataclass(frozen=True)
class Mark:
    t: float  # unix seconds
    kind: str  # failure | recovery | other
    label: str


def history(job: dict[str, Any]) -> list[dict[str, Any]]:
    """The usable samples of .status.history, oldest first."""
    rows = (job.get("status") or {}).get("history") or []
    good = [r for r in rows if isinstance(r, dict) and isinstance(r.get("t"), int | float)]
    return sorted(good, key=lambda r: r["t"])


# Events name a failure to the second and may be posted seconds before the group leaves the lighthouse (the pod's
# death is seen first) or after it (the lighthouse's eviction is mirrored at the next poll); an Event this close to
# a drop of the group it names is taken as that drop's cause, not as a failure of its own.
MATCH_S = 30.0
# Reasons that take a group out on purpose: a drop they explain is no failure.
PLANNED_REASONS = frozenset({"ScaledDown", "Suspended"})


@dataclass(frozen=True)
class Drop:
    """Groups that reported in one history sample and were gone (or restarted, their step going back) in the next:
    `t` is the first sample that shows it, the moment the operator saw them drop out."""

    t: float
    groups: tuple[str, ...]


def drops(samples: list[dict[str, Any]]) -> list[Drop]:
    """Every drop in the history, oldest first (groups that left at the same sample are one drop)."""
    out: list[Drop] = []
    for before, after in itertools.pairwise(samples):
        was, now = before.get("groups") or {}, after.get("groups") or {}
        gone = [g for g in was if g not in now or _number(now[g]) < _number(was[g])]
        if gone:
            out.append(Drop(after["t"], tuple(sorted(gone, key=lambda g: (len(g), g)))))
    return out


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) else math.nan


def _explains(event: JobEvent, drop: Drop) -> bool:
    """Whether `event` may be about `drop`: near it, and naming one of its groups or none at all."""
    near = event.time is not None and abs(event.time - drop.t) <= MATCH_S
    return near and (event.group is None or str(event.group) in drop.groups)


def marks(job: dict[str, Any], events: list[JobEvent]) -> list[Mark]:
    """One failure mark per drop in .status.history, at the moment the groups dropped out, named by the Event that
    explains it (each Event explains at most its nearest drop); a failure Event that explains no drop (a pod that
    never ran, a drop the bounded history thinned away) gets a mark of its own, once per group within MATCH_S. A
    recovery where a dropped group is back at the job's step, and one per recovery Event that is not such a return.
    """
    samples = history(job)
    found = drops(samples)
    causes: dict[int, list[JobEvent]] = {i: [] for i in range(len(found))}
    unexplained: list[JobEvent] = []
    for e in events:
        if e.time is None or e.kind == RECOVERY:
            continue
        near = [i for i, d in enumerate(found) if _explains(e, d)]
        if near:
            causes[min(near, key=lambda i: abs(found[i].t - (e.time or 0.0)))].append(e)
        elif e.kind == FAILURE:
            unexplained.append(e)
    out: list[Mark] = []
    returns: list[tuple[float, str]] = []
    for i, d in enumerate(found):
        why = causes[i]
        failures = [e for e in why if e.kind == FAILURE]
        if not failures and any(e.reason in PLANNED_REASONS for e in why):
            continue
        label = failures[0].reason if failures else f"group {', '.join(d.groups)} dropped out"
        out.append(Mark(d.t, FAILURE, label))
        for g in d.groups:
            back = _back_at(samples, g, d.t)
            if back is not None and (back, g) not in returns:  # the first drop of a burst names the whole outage
                returns.append((back, g))
                out.append(Mark(back, RECOVERY, f"group {g} back ({back - d.t:.0f}s)"))
    drawn: dict[int | None, float] = {}
    for e in unexplained:
        t = e.time or 0.0
        if e.group is not None and e.group in drawn and t - drawn[e.group] <= MATCH_S:
            continue  # the same group's failure again, told by another Event
        drawn[e.group] = t
        out.append(Mark(t, FAILURE, e.reason))
    for e in events:
        if e.time is None or e.kind != RECOVERY:
            continue
        if e.group is not None and any(g == str(e.group) and abs(t - e.time) <= MATCH_S for t, g in returns):
            continue  # the return the history shows already marks it
        out.append(Mark(e.time, RECOVERY, e.reason))
    return sorted(out, key=lambda m: m.t)


def _back_at(samples: list[dict[str, Any]], group: str, since: float) -> float | None:
    """The first sample after `since` where `group` reports again at the job's step (not healing behind it)."""
    for s in samples:
        if s["t"] <= since:
            continue
        step = (s.get("groups") or {}).get(group)
        job_step = s.get("step")
        if step is not None and not (isinstance(job_step, int | float) and step < job_step):
            return s["t"]
    return None


def _load_pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise TimelineError(
            "the timeline needs matplotlib, which is not installed: pip install 'ftjob[trainer]' (or matplotlib)"
        ) from None
    matplotlib.use("Agg")  # no display: straight to a file
    import matplotlib.pyplot as plt

    return plt


def plot(
    job: dict[str, Any], events: list[JobEvent], path: Path, progress: Callable[[str], None] = lambda _: None
) -> int:
    """Draw the PNG; returns the number of history samples drawn. Raises TimelineError when there is nothing."""
    samples = history(job)
    meta = job.get("metadata") or {}
    name = meta.get("name", "?")
    if not samples:
        raise TimelineError(
            f"job {name} has no status.history yet (it records once training runs; an older operator never does)"
        )
    plt = _load_pyplot()
    t0 = parse_time(meta.get("creationTimestamp")) or samples[0]["t"]
    t0 = min(t0, samples[0]["t"])
    all_marks = [m for m in marks(job, events) if m.t >= t0]
    progress(f"drawing {len(samples)} history samples and {len(all_marks)} marks")
    groups = sorted({g for s in samples for g in (s.get("groups") or {})}, key=lambda g: (len(g), g))
    ratios = [3, max(1, len(groups)) * 0.45, 1]
    fig, (ax, lanes, qax) = plt.subplots(3, 1, figsize=(11, 7.5), sharex=True, gridspec_kw={"height_ratios": ratios})
    xs = [s["t"] - t0 for s in samples]
    committed = [s.get("step") if isinstance(s.get("step"), int | float) else math.nan for s in samples]
    # the step rises between the ~2 s status samples, so samples are joined by lines (the quorum size stays a staircase)
    ax.plot(xs, committed, color="gray", alpha=0.35, linewidth=5, label="committed (job)", zorder=1)
    for i, g in enumerate(groups):
        ys = [(s.get("groups") or {}).get(g) for s in samples]
        ys = [math.nan if v is None else v for v in ys]  # a gap where the group reported nothing
        ax.plot(xs, ys, color=f"C{i % 10}", linewidth=1.4, label=f"group {g}", zorder=2)
        for state, alpha in (("current", 1.0), ("behind", 0.3)):
            spans = lane_spans(samples, g, state, t0)
            if spans:
                lanes.broken_barh(spans, (i - 0.35, 0.7), color=f"C{i % 10}", alpha=alpha)
    lanes.set_yticks(range(len(groups)), [f"group {g}" for g in groups])
    lanes.set_ylim(-0.6, len(groups) - 0.4)
    lanes.set_title("solid: at the job's step, faded: behind (healing), empty: not reporting", fontsize=9)
    quorum = [s.get("quorum") if isinstance(s.get("quorum"), int | float) else math.nan for s in samples]
    qax.step(xs, quorum, where="post", color="black", linewidth=1.4)
    qax.set_ylabel("quorum size")
    top = max([q for q in quorum if not math.isnan(q)] or [1])
    qax.set_ylim(-0.2, top + 0.8)
    colors = {FAILURE: ("tab:red", "--"), RECOVERY: ("tab:green", ":")}
    for n, m in enumerate(all_marks):
        color, style = colors.get(m.kind, ("purple", "-."))
        for axis in (ax, lanes, qax):
            axis.axvline(m.t - t0, color=color, linestyle=style, linewidth=1.1)
        ax.annotate(
            m.label, (m.t - t0, 0), textcoords="offset points", xytext=(3, 6 + 12 * (n % 4)), color=color, fontsize=8
        )
    ax.set_ylabel("committed step")
    ax.set_title(f"ftjob {meta.get('namespace', '')}/{name}: committed step per replica group", fontsize=11)
    for axis in (ax, qax):
        axis.grid(True, alpha=0.3)
    qax.set_xlabel("seconds since the job was created (red: failures, green: recoveries)")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return len(samples)


def lane_spans(samples: list[dict[str, Any]], group: str, state: str, t0: float) -> list[tuple[float, float]]:
    """(start, width) of the sample intervals where the group was `current` (at the job's step) or `behind`."""
    out: list[tuple[float, float]] = []
    for i, s in enumerate(samples):
        step = (s.get("groups") or {}).get(group)
        if step is None:
            continue
        job_step = s.get("step")
        behind = isinstance(job_step, int | float) and step < job_step
        if behind != (state == "behind"):
            continue
        end = samples[i + 1]["t"] if i + 1 < len(samples) else s["t"] + 0.5
        if out and abs(out[-1][0] + out[-1][1] - (s["t"] - t0)) < 1e-9:
            out[-1] = (out[-1][0], end - t0 - out[-1][0])  # extend the running span
        else:
            out.append((s["t"] - t0, max(end - s["t"], 0.05)))
    return out
