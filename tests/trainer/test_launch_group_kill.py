"""(b) A group SIGKILLed mid-run: the survivors keep committing, the victim restarts, heals, and every group ends
bitwise identical with every sample committed exactly once. Also the report and timeline of such a run."""

from __future__ import annotations

from pathlib import Path

from tests.support.launch_runs import assert_clean, commits, launch

# Each step is padded to PACE seconds so the survivors cannot finish before the victim has restarted (a process
# start takes ~5-25 s on a loaded 2-core machine); the run needs STEPS * PACE seconds at least.
STEPS, KILL_AT, RESTART_DELAY, PACE = 80, 10, 2.0, 0.5


def test_group_kill_heal_and_identical_finish(tmp_path: Path) -> None:
    timeline = tmp_path / "timeline.png"
    rc, report = launch(
        tmp_path,
        "--replicas=3",
        "--min-replicas=2",
        f"--steps={STEPS}",
        f"--kill-at={KILL_AT}",
        f"--restart-delay={RESTART_DELAY}",
        f"--min-step-seconds={PACE}",
        f"--timeline={timeline}",
    )
    assert rc == 0, report
    assert_clean(report, 3, STEPS)
    assert report.failures_injected == 1
    victim = next(g.group for g in report.groups if g.restarts == 1)
    assert sum(g.restarts for g in report.groups) == 1
    assert report.rejoin_seconds[0] is not None and report.rejoin_seconds[0] >= RESTART_DELAY

    by_group = commits(tmp_path)
    survivors = [g for g in by_group if g != victim]
    # While the victim was down the survivors committed steps on their own (two contributors)...
    for g in survivors:
        alone = [r for r in by_group[g] if r.num_contributors == 2 and r.step > KILL_AT]
        assert alone, f"survivor {g} never committed without the victim"
    # ...and the victim came back by healing (a non-contributing step), then contributed again.
    victim_after = [r for r in by_group[victim] if r.step > KILL_AT]
    assert any(r.healed for r in victim_after), "the restarted group never healed from a peer"
    assert victim_after[-1].contributing and victim_after[-1].num_contributors == 3
    # steps never went backwards in any group's record
    for g, recs in by_group.items():
        steps = [r.step for r in recs]
        assert steps == sorted(steps), f"group {g} went backwards"
    assert report.survivor_stall_seconds_max > 0 and report.final_loss < 5.0
    assert timeline.read_bytes()[:4] == b"\x89PNG"
