"""(h) Two groups of two ranks each (FSDP2 shards the model inside a group) survive a group kill."""

from __future__ import annotations

from pathlib import Path

from tests.support.launch_runs import assert_clean, commits, launch

# Steps padded to 0.7 s: the two-rank victim restarts well before the survivor could finish alone.
STEPS, KILL_AT = 60, 8


def test_fsdp_groups_survive_a_group_kill(tmp_path: Path) -> None:
    rc, report = launch(
        tmp_path,
        "--replicas=2",
        "--pods-per-replica=2",
        "--min-replicas=1",
        f"--steps={STEPS}",
        f"--kill-at={KILL_AT}",
        "--restart-delay=2",
        "--batch-size=8",
        "--min-step-seconds=0.7",
    )
    assert rc == 0, report
    assert_clean(report, 2, STEPS)
    assert report.failures_injected == 1 and report.rejoin_seconds[0] is not None
    by_group = commits(tmp_path)
    victim = next(g.group for g in report.groups if g.restarts == 1)
    survivor = next(g for g in by_group if g != victim)
    assert any(r.num_contributors == 1 and r.step > KILL_AT for r in by_group[survivor])
    assert any(r.healed for r in by_group[victim])
