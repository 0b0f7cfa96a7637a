"""Running `ftjob-trainer launch` from tests: the real CLI, real processes on loopback, the report it writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ftjob.trainer import cli
from ftjob.trainer.report import read_run_dir


def launch(tmp_path: Path, *flags: str) -> tuple[int, dict[str, Any]]:
    """Run the launcher to completion with ``flags``; returns its exit code and the parsed --report."""
    report = tmp_path / "report.json"
    rc = cli.main(["launch", f"--run-dir={tmp_path / 'run'}", f"--report={report}", "--timeout=600", *flags])
    return rc, json.loads(report.read_text())


def commits(tmp_path: Path) -> dict[str, list[dict[str, Any]]]:
    return {g: [r for r in recs if r["event"] == "commit"] for g, recs in read_run_dir(tmp_path / "run").items()}


def assert_clean(report: dict[str, Any], groups: int, steps: int) -> None:
    """Every group finished at ``steps`` with bitwise-equal parameters; every sample committed exactly once."""
    finals = [(g["final_step"], g["param_digest"]) for g in report["groups"]]
    assert len(finals) == groups
    assert all(step == steps for step, _ in finals), finals
    digests = {d for _, d in finals}
    assert len(digests) == 1 and None not in digests, finals
    s = report["samples"]
    assert (s["dropped"], s["duplicated"], s["inconsistent_steps"], s["shard_errors"]) == (0, 0, [], []), s
