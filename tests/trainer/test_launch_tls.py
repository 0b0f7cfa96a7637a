"""`ftjob-trainer launch --tls`: the job as in a cluster with TLS on. The lighthouse serves only TLS with the run's
throwaway CA, every rank verifies it, and a SIGKILLed group's heal copies its state from a peer's recovery server,
which speaks only TLS; the groups end bitwise identical."""

from __future__ import annotations

from pathlib import Path

from ftjob.contract import pki

from tests.support.launch_runs import assert_clean, commits, launch

# paced so that the survivor is still training when the victim is back (test_launch_group_kill.py explains)
STEPS, KILL_AT, RESTART_DELAY, PACE = 80, 10, 2.0, 0.5


def test_launch_with_tls_heals_over_tls_and_ends_identical(tmp_path: Path) -> None:
    rc, report = launch(
        tmp_path,
        "--tls",
        "--replicas=2",
        "--min-replicas=1",
        f"--steps={STEPS}",
        f"--kill-at={KILL_AT}",
        f"--restart-delay={RESTART_DELAY}",
        f"--min-step-seconds={PACE}",
    )
    assert rc == 0, report
    assert_clean(report, 2, STEPS)
    assert report.failures_injected == 1
    victim = next(g.group for g in report.groups if g.restarts == 1)
    victim_after = [r for r in commits(tmp_path)[victim] if r.step > KILL_AT]
    assert any(r.healed for r in victim_after), "the restarted group never healed from its peer"

    run = tmp_path / "run"
    assert sorted(p.name for p in (run / "tls").iterdir()) == sorted(pki.SECRET_KEYS)
    # The lighthouse spoke only TLS, so every rank had the run's CA (FTJOB_TLS_*): the same settings the Manager
    # gives its recovery server (then TLS only) and its fetcher (TLS, verified) -- the heal above went over TLS.
    assert "over TLS" in (run / "logs" / "lighthouse.log").read_text()
    logs = "".join(p.read_text(errors="replace") for p in (run / "logs").glob("*.log"))
    assert "TLS with the lighthouse" not in logs and "certificate failed verification" not in logs
