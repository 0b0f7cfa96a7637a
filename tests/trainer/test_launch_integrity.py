"""The integrity checks end to end under `ftjob-trainer launch` (3 groups of the reference GPT trainer and a real
lighthouse): a group whose gradients turn NaN is refused by the gradient guard until the lighthouse evicts it (after
K offences); a group with one flipped bit in its parameters is caught by the state digests and evicted. Either way
its replacement (generation 1: no fault) heals from a healthy group, the job finishes with bitwise-equal parameters
everywhere, and every sample is trained exactly once."""

from __future__ import annotations

import re
from pathlib import Path

from ftjob.launch.report import LaunchReport

from tests.support.launch_runs import assert_clean, commits, launch

# Each step is padded to PACE seconds so the survivors are still training when the evicted group's replacement has
# started (a process start takes ~5-25 s on a loaded 2-core machine).
STEPS, PACE, RESTART_DELAY = 90, 0.5, 1.0
MAX_OFFENCES = 3  # the lighthouse's default FTJOB_GUARD_MAX_OFFENCES


def run(tmp_path: Path, *flags: str) -> LaunchReport:
    rc, report = launch(
        tmp_path,
        "--replicas=3",
        "--min-replicas=2",
        f"--steps={STEPS}",
        f"--min-step-seconds={PACE}",
        f"--restart-delay={RESTART_DELAY}",
        *flags,
    )
    assert rc == 0, report
    assert_clean(report, 3, STEPS)
    return report


def assert_replaced_and_healed(tmp_path: Path, report: LaunchReport, group: str) -> None:
    """Only ``group`` restarted, once; its second incarnation healed from a peer, then contributed."""
    assert {g.group: g.restarts for g in report.groups} == {g: int(g == group) for g in "012"}, report.groups
    records = commits(tmp_path)[group]
    incarnations = list(dict.fromkeys(r.incarnation for r in records))
    assert len(incarnations) == 2, incarnations
    second = [r for r in records if r.incarnation == incarnations[1]]
    assert second[0].healed and not second[0].contributing, second[0]
    assert second[-1].contributing and second[-1].num_contributors == 3


def test_nan_gradients_are_refused_then_the_group_is_evicted_replaced_and_healed(tmp_path: Path) -> None:
    report = run(tmp_path, f"--inject-fault=group=1,kind=nan,step=10,count={MAX_OFFENCES + 2}")
    assert [e.group for e in report.evictions] == ["1"], report.evictions
    assert report.evictions[0].reason.startswith(f"gradient_guard: nonfinite in {MAX_OFFENCES} step(s)"), report
    assert report.integrity is not None
    assert report.integrity.guard_offences == {"1": MAX_OFFENCES}, report.integrity
    assert report.integrity.guard_evictions == {"1": 1}
    guard = [a for a in report.audit if a.kind == "guard"]
    assert len(guard) == MAX_OFFENCES and {a.group for a in guard} == {"1"}
    assert any(a.kind == "evict" and a.group == "1" and "gradient_guard" in a.reason for a in report.audit)
    assert_replaced_and_healed(tmp_path, report, "1")
    # the refused attempts committed nothing: no group's record shows step 10 twice or a non-finite loss
    for g, recs in commits(tmp_path).items():
        steps = [r.step for r in recs]
        assert len(steps) == len(set(steps)), f"group {g} committed a step twice"
    assert report.final_loss is not None and report.final_loss < 5.0


def test_a_flipped_bit_is_caught_by_the_digests_evicted_and_healed(tmp_path: Path) -> None:
    flip_step, every = 16, 5
    report = run(tmp_path, f"--inject-fault=group=2,kind=bitflip,step={flip_step}", f"--digest-every={every}")
    assert [e.group for e in report.evictions] == ["2"], report.evictions
    reason = report.evictions[0].reason
    found = re.match(r"divergent: digest at step (\d+) differs from the majority \(2 of 3 groups\)", reason)
    assert found, reason
    caught_at = int(found.group(1))
    assert flip_step <= caught_at <= flip_step + every, f"caught at the digest of step {caught_at}"
    assert report.integrity is not None and report.integrity.divergences == {"2": 1}, report.integrity
    assert report.integrity.digests_compared >= STEPS // every - 2  # the healthy comparisons went on
    assert_replaced_and_healed(tmp_path, report, "2")

    # Detection latency, for the record: from the flip (right after group 2 committed flip_step) to the eviction.
    first_incarnation = commits(tmp_path)["2"][0].incarnation
    flipped = next(r for r in commits(tmp_path)["2"] if r.step == flip_step and r.incarnation == first_incarnation)
    evicted = next(a for a in report.audit if a.kind == "divergence" and a.group == "2")
    job_step = max(r.step for recs in commits(tmp_path).values() for r in recs if r.t <= evicted.wall_time)
    print(
        f"\n[bit-flip] flipped after step {flip_step}; caught by the digest of step {caught_at} "
        f"({caught_at - flip_step} steps, digest every {every}); evicted at job step {job_step} "
        f"({job_step - flip_step} steps), {evicted.wall_time - flipped.t:.2f} s after the flip"
    )
