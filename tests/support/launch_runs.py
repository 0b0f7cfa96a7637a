"""Running `ftjob-trainer launch` from tests: the real CLI, real processes on loopback, the report it writes."""

from __future__ import annotations

from pathlib import Path

from ftjob import cli
from ftjob.ft.records import CommitRecord, StartRecord, read_run_dir
from ftjob.launch.report import LaunchReport


def launch(tmp_path: Path, *flags: str, command: tuple[str, ...] = ()) -> tuple[int, LaunchReport]:
    """Run the launcher to completion with ``flags`` (and ``command`` after ``--``); its exit code and --report."""
    report = tmp_path / "report.json"
    argv = ["launch", f"--run-dir={tmp_path / 'run'}", f"--report={report}", "--timeout=600", *flags]
    rc = cli.main([*argv, "--", *command] if command else argv)
    return rc, LaunchReport.model_validate_json(report.read_text())


def commits(tmp_path: Path) -> dict[str, list[CommitRecord]]:
    runs = read_run_dir(tmp_path / "run")
    return {g: [r for r in recs if isinstance(r, CommitRecord)] for g, recs in runs.items()}


def starts(tmp_path: Path) -> list[StartRecord]:
    return [r for recs in read_run_dir(tmp_path / "run").values() for r in recs if isinstance(r, StartRecord)]


def assert_clean(report: LaunchReport, groups: int, steps: int) -> None:
    """Every group finished at ``steps`` with bitwise-equal parameters; every sample committed exactly once."""
    finals = [(g.final_step, g.param_digest) for g in report.groups]
    assert len(finals) == groups
    assert all(step == steps for step, _ in finals), finals
    digests = {d for _, d in finals}
    assert len(digests) == 1 and None not in digests, finals
    s = report.samples
    assert (s.dropped, s.duplicated, s.inconsistent_steps, s.shard_errors) == (0, 0, [], []), s
