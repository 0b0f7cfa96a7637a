"""The demo's timeline: samples of the lighthouse status (committed step, quorum membership per replica group) taken
while a job runs, and the PNG drawn from them: committed step per group over time, the failure (where the killed group
dropped out of the lighthouse) and the recovery marked, and a lane per group showing when it took part in the quorum."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ftjob.contract.lighthouse_api import StatusResponse


@dataclass
class GroupSample:
    step: int
    in_quorum: bool
    contributing: bool
    healing: bool
    incarnation: str


@dataclass
class Sample:
    t: float  # seconds since the job was applied
    max_step: int
    quorum_groups: list[str]
    groups: dict[str, GroupSample]


@dataclass
class Timeline:
    job: str
    samples: list[Sample] = field(default_factory=list)
    marks: list[tuple[float, str, str]] = field(default_factory=list)  # (t, kind: kill|recovered|succeeded, label)

    def add_status(self, t: float, status: StatusResponse) -> Sample:
        """One lighthouse GET /v1/status answer as a sample."""
        groups = {
            m.group: GroupSample(
                step=m.step,
                in_quorum=m.in_quorum,
                contributing=m.contributing,
                healing=m.healing,
                incarnation=m.incarnation,
            )
            for m in status.members
        }
        sample = Sample(t, status.max_step, list(status.quorum_groups), groups)
        self.samples.append(sample)
        return sample

    def mark(self, t: float, kind: str, label: str) -> None:
        self.marks.append((t, kind, label))

    def dropped_out(self, group: str, incarnation: str, since: float) -> float | None:
        """When `group`'s `incarnation` left the lighthouse: the first sample from `since` on that lacks it (gone,
        or replaced by a new incarnation). A failure is marked there, once, whatever caused it; None: not yet."""
        for s in self.samples:
            if s.t < since:
                continue
            member = s.groups.get(group)
            if member is None or member.incarnation != incarnation:
                return s.t
        return None

    def save_json(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps({"job": self.job, "marks": self.marks, "samples": [asdict(s) for s in self.samples]})
        )


MARK_STYLE = {"kill": ("tab:red", "--"), "recovered": ("tab:green", ":"), "succeeded": ("black", "-")}


def plot(timeline: Timeline, path: Path, title: str) -> None:
    """Top: committed step per group. Bottom: one lane per group, solid where it contributed to the quorum, faded
    where it was alive but healing or a spare."""
    import matplotlib

    matplotlib.use("Agg")  # no display: render straight to a file
    import matplotlib.pyplot as plt

    groups = sorted({g for s in timeline.samples for g in s.groups}, key=lambda g: (len(g), g))
    fig, (ax, lanes) = plt.subplots(
        2, 1, figsize=(11, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, max(1, len(groups)) * 0.45]}
    )
    colors = {g: f"C{i % 10}" for i, g in enumerate(groups)}
    for g in groups:
        # A gap (NaN) where the group is not a lighthouse member: no line pretends it was there.
        pts = [(s.t, s.groups[g].step if g in s.groups else math.nan) for s in timeline.samples]
        if any(g in s.groups for s in timeline.samples):
            ax.step(*zip(*pts, strict=True), where="post", color=colors[g], label=f"group {g}", linewidth=1.6)
    if timeline.samples:
        quorum = [(s.t, s.max_step) for s in timeline.samples]
        ax.step(
            *zip(*quorum, strict=True), where="post", color="gray", alpha=0.4, linewidth=4, label="committed (quorum)"
        )
    ends = timeline.samples[-1].t if timeline.samples else 1.0
    for row, g in enumerate(groups):
        for state, style in (
            ("contributing", {"color": colors[g]}),
            ("alive", {"color": colors[g], "alpha": 0.3}),
        ):
            spans = _spans(timeline.samples, g, state, ends)
            if spans:
                lanes.broken_barh(spans, (row - 0.35, 0.7), **style)
    lanes.set_yticks(range(len(groups)), [f"group {g}" for g in groups])
    lanes.set_ylim(-0.6, len(groups) - 0.4)
    lanes.set_xlabel("seconds since the job was applied")
    lanes.set_title("taking part: solid = contributing to the quorum, faded = alive but healing/spare", fontsize=9)
    marks = sorted(timeline.marks, key=lambda m: m[0])
    for t, kind, label in marks:
        color, style = MARK_STYLE.get(kind, ("purple", "-."))
        for axis in (ax, lanes):
            axis.axvline(t, color=color, linestyle=style, linewidth=1.2)
        ax.annotate(
            label,
            (t, 0),
            textcoords="offset points",
            xytext=(4, 6 + 14 * list(MARK_STYLE).index(kind) if kind in MARK_STYLE else 6),
            color=color,
            fontsize=8,
        )
    for (t0, k0, _), (t1, k1, _) in itertools.pairwise(marks):
        if k0 == "kill" and k1 == "recovered":
            ax.axvspan(t0, t1, color="tab:red", alpha=0.08, label=f"recovery ({t1 - t0:.1f}s)")
    ax.set_ylabel("committed step")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _spans(samples: list[Sample], group: str, state: str, end: float) -> list[tuple[float, float]]:
    """(start, width) runs of samples where the group was in `state` ('contributing', or 'alive' but not that)."""

    def on(s: Sample) -> bool:
        m = s.groups.get(group)
        if m is None:
            return False
        contributing = m.contributing and group in s.quorum_groups
        return contributing if state == "contributing" else not contributing

    spans, start = [], None
    for i, s in enumerate(samples):
        if on(s) and start is None:
            start = s.t
        if start is not None and (not on(s) or i == len(samples) - 1):
            stop = s.t if not on(s) else end
            spans.append((start, max(stop - start, 0.05)))
            start = None
    return spans
