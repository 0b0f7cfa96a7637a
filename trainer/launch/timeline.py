"""The launcher's timeline PNG: committed step of each group over wall time, failures and rejoins marked."""

from __future__ import annotations

import itertools
from pathlib import Path

from ftjob.launch.run_records import GroupTimeline


def plot_timeline(
    path: Path,
    timelines: list[GroupTimeline],
    t0: float,
    kills: list[tuple[float, str]],
    rejoins: list[tuple[float, str]],
    title: str = "ftjob local run",
) -> None:
    """Write the PNG. ``kills``/``rejoins`` are (wall time, group); times are plotted relative to ``t0``."""
    import matplotlib

    matplotlib.use("Agg")  # no display: render straight to a file
    import matplotlib.pyplot as plt

    fig, (ax, lanes) = plt.subplots(2, 1, figsize=(10, 6.5), sharex=True, height_ratios=[3, 1])
    styles = ["-", "--", "-.", ":"]
    for i, g in enumerate(timelines):
        color = f"C{i % 10}"
        # One line per process incarnation: a dead group shows as a gap, not as a flat line.
        for k, seg in enumerate(g.segments):
            ax.step(
                [t - t0 for t, _ in seg],
                [s for _, s in seg],
                where="post",
                color=color,
                linestyle=styles[i % len(styles)],
                linewidth=2.2 - 0.4 * (i % 3),
                label=f"group {g.group}" if k == 0 else None,
            )
    _draw_lanes(lanes, timelines, t0)
    for i, (t, group) in enumerate(kills):
        lanes.axvline(t - t0, color="red", linestyle="--", linewidth=1)
        ax.axvline(t - t0, color="red", linestyle="--", linewidth=1, label="group killed" if i == 0 else None)
        ax.annotate(f"kill {group}", (t - t0, 0), textcoords="offset points", xytext=(3, 5), color="red", fontsize=8)
    for i, (t, group) in enumerate(rejoins):
        lanes.axvline(t - t0, color="green", linestyle=":", linewidth=1)
        ax.axvline(t - t0, color="green", linestyle=":", linewidth=1, label="group rejoined" if i == 0 else None)
        ax.annotate(
            f"rejoin {group}", (t - t0, 0), textcoords="offset points", xytext=(3, 18), color="green", fontsize=8
        )
    lanes.set_xlabel("wall time since launch (s)")
    ax.set_ylabel("committed step")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _draw_lanes(ax: object, timelines: list[GroupTimeline], t0: float) -> None:
    """One lane per group: green while it commits as a contributor, orange while healing/standing by, empty while
    it is down (no commits from any incarnation)."""
    for row, g in enumerate(timelines):
        contributing, standby = [], []
        for (t_a, _, contrib), (t_b, _, _) in itertools.pairwise(g.commits):
            if t_b - t_a > 5 * _typical_gap(g):
                continue  # a gap this long is the group being down, not a slow step
            (contributing if contrib else standby).append((t_a - t0, t_b - t_a))
        ax.broken_barh(contributing, (row - 0.35, 0.7), color="tab:green")
        ax.broken_barh(standby, (row - 0.35, 0.7), color="tab:orange")
    ax.set_yticks(range(len(timelines)), [f"group {g.group}" for g in timelines])
    ax.set_ylim(-0.6, len(timelines) - 0.4)
    ax.set_title("green: contributing, orange: healing / spare, empty: down", fontsize=8)


def _typical_gap(g: GroupTimeline) -> float:
    gaps = sorted(b[0] - a[0] for a, b in itertools.pairwise(g.commits))
    return gaps[len(gaps) // 2] if gaps else 1.0
