"""The launcher's timeline PNG: committed step of each group over wall time, failures and rejoins marked."""

from __future__ import annotations

from pathlib import Path

from ftjob.trainer.report import GroupTimeline


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

    fig, ax = plt.subplots(figsize=(10, 5))
    for g in timelines:
        if not g.commits:
            continue
        ts = [t - t0 for t, _, _ in g.commits]
        steps = [s for _, s, _ in g.commits]
        ax.step(ts, steps, where="post", label=f"group {g.group}", linewidth=1.4)
    for i, (t, group) in enumerate(kills):
        ax.axvline(t - t0, color="red", linestyle="--", linewidth=1, label="group killed" if i == 0 else None)
        ax.annotate(f"kill {group}", (t - t0, 0), textcoords="offset points", xytext=(3, 5), color="red", fontsize=8)
    for i, (t, group) in enumerate(rejoins):
        ax.axvline(t - t0, color="green", linestyle=":", linewidth=1, label="group rejoined" if i == 0 else None)
        ax.annotate(
            f"rejoin {group}", (t - t0, 0), textcoords="offset points", xytext=(3, 18), color="green", fontsize=8
        )
    ax.set_xlabel("wall time since launch (s)")
    ax.set_ylabel("committed step")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
