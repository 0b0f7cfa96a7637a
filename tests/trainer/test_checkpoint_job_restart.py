"""A whole-job restart resumes from the newest intact checkpoint (a corrupted one is reported and skipped) and
ends bitwise where an uninterrupted run ends."""

from __future__ import annotations

from pathlib import Path

from ftjob.ft import checkpoint
from ftjob.launch.report import LaunchReport

from tests.support.launch_runs import assert_clean, launch, starts

FLAGS = ["--replicas=2", "--min-replicas=2", "--checkpoint-every=10", "--batch-size=4"]


def _digest(report: LaunchReport) -> str | None:
    return report.groups[0].param_digest


def test_job_restart_resumes_from_checkpoint(tmp_path: Path) -> None:
    rc, straight = launch(tmp_path / "straight", *FLAGS, "--steps=30")
    assert rc == 0, straight

    job = tmp_path / "job"
    rc, first = launch(job, *FLAGS, "--steps=20")
    assert rc == 0, first
    ckpts = job / "run" / "checkpoints"
    assert {s for s, _ in checkpoint.list_checkpoints(ckpts)} == {10, 20}
    # the newest checkpoint of every group is corrupted: the restart must fall back to step 10
    for _, d in checkpoint.list_checkpoints(ckpts):
        if d.name.endswith("20"):
            victim = next(p for p in d.iterdir() if p.suffix == ".distcp")
            victim.write_bytes(victim.read_bytes()[:-8] + b"garbage!")

    rc, second = launch(job, *FLAGS, "--steps=30")
    assert rc == 0, second
    assert_clean(second, 2, 30)
    assert sorted(r.step for r in starts(job)) == [0, 0, 10, 10], "the restart did not resume from step 10"
    logs = "".join(p.read_text() for p in (job / "run" / "logs").glob("group-*-rank0.log"))
    assert "does not match its sha256" in logs
    assert _digest(second) == _digest(straight)
