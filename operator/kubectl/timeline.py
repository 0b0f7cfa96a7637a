"""`kubectl ftjob timeline`: the committed step of every replica group over time, from the job's .status.history,
with the failures (red) and recoveries (green) of its Events marked, drawn with matplotlib into a PNG.

matplotlib is imported only here and only when drawing (it is in the `trainer` extra, not the operator's image).
"""

from __future__ import annotations

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


def marks(job: dict[str, Any], events: list[JobEvent]) -> list[Mark]:
    """A mark per failure or recovery Event, and a derived recovery where a failed group is back at the job's step."""
    out = [Mark(e.time, e.kind, e.reason) for e in events if e.time is not None and e.kind in (FAILURE, RECOVERY)]
    samples = history(job)
    back: set[tuple[float, int]] = set()
    for e in events:
        if e.kind != FAILURE or e.time is None or e.group is None:
            continue
        behind_seen = False  # the group must first drop out (or fall behind) and then be back at the job's step
        for s in (s for s in samples if s["t"] > e.time):
            step = (s.get("groups") or {}).get(str(e.group))
            job_step = s.get("step")
            if step is None or (isinstance(job_step, int | float) and step < job_step):
                behind_seen = True
            elif behind_seen:
                if (s["t"], e.group) not in back:  # the first failure of a burst names the whole outage
                    back.add((s["t"], e.group))
                    out.append(Mark(s["t"], RECOVERY, f"group {e.group} back ({s['t'] - e.time:.0f}s)"))
                break
    return sorted(out, key=lambda m: m.t)


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
