"""The examples/ loops and the library's safety rules, run the way a user runs them: `ftjob-trainer launch ... --
python <script>` with real processes on loopback and a group SIGKILLed mid-run."""

from __future__ import annotations

import difflib
import os
import subprocess
import sys
from pathlib import Path

from ftjob.launch.report import LaunchReport

from tests.support.launch_runs import assert_clean, launch, starts
from tests.support.paths import REPO

PY = sys.executable
CASES = str(Path(__file__).parent / "loops" / "mlp_cases.py")
# Steps are padded so the survivors cannot finish before the victim restarted (a process start takes seconds here).
PACE = "--min-step-seconds=0.5"  # >= 25 s between the kill and the end


def _example(name: str) -> str:
    return str(REPO / "examples" / name)


def _survives_one_kill(tmp_path: Path, groups: int, script: str, *args: str, ranks: int = 1) -> None:
    """SIGKILL one group at step 8 of 60; every group ends with equal parameters, every sample trained once, the
    victim restarted once, healed and contributed again; nobody else exited."""
    flags = (f"--replicas={groups}", f"--min-replicas={groups - 1}", f"--pods-per-replica={ranks}", "--kill-at=8")
    rc, report = launch(tmp_path, *flags, PACE, command=(PY, _example(script), "--steps=60", *args))
    assert rc == 0, report
    assert_clean(report, groups, 60)
    _assert_one_kill_healed(report)


def _assert_one_kill_healed(report: LaunchReport) -> None:
    assert report.failures_injected == 1 and sum(g.restarts for g in report.groups) == 1, report.groups
    assert report.unexpected_exits == [], report.unexpected_exits
    assert report.rejoin_seconds[0] is not None, "the killed group never contributed again"


def test_mlp_example_survives_a_group_kill(tmp_path: Path) -> None:
    _survives_one_kill(tmp_path, 3, "mlp.py")


def test_mlp_example_with_amp_and_accumulation(tmp_path: Path) -> None:
    _survives_one_kill(tmp_path, 2, "mlp.py", "--amp", "--accumulate=2")


def test_fsdp2_example_survives_a_group_kill(tmp_path: Path) -> None:
    _survives_one_kill(tmp_path, 2, "fsdp.py", ranks=2)


def test_gpt_example_survives_a_group_kill(tmp_path: Path) -> None:
    _survives_one_kill(tmp_path, 3, "gpt.py", "--corpus-bytes=262144")


def test_unsendable_state_fails_only_its_own_group(tmp_path: Path) -> None:
    """Group 1's own state gains a set at step 8: group 1 fails with a message naming it; the others never notice."""
    rc, report = launch(
        tmp_path,
        "--replicas=3",
        "--min-replicas=2",
        "--max-crashes=1000",
        "--restart-delay=0.5",
        PACE,
        command=(PY, CASES, "--steps=40", "--bad-state-group=1", "--bad-state-at=8"),
    )
    assert rc != 0  # group 1 never finished
    by_group = {g.group: g for g in report.groups}
    assert by_group["0"].final_step == by_group["2"].final_step == 40
    assert by_group["0"].param_digest == by_group["2"].param_digest is not None
    assert {e.group for e in report.unexpected_exits} == {"1"}, report.unexpected_exits
    assert by_group["0"].restarts == by_group["2"].restarts == 0
    logs = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("group-1-*.log"))
    assert "StateDictError" in logs and "cannot be sent to a healing peer" in logs, logs[-3000:]
    assert "notes/tags is a builtins.set" in logs, logs[-3000:]  # names the entry and what it is
    healthy = "".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("group-[02]-*.log"))
    assert "Traceback" not in healthy, healthy[-3000:]


def test_groups_started_with_different_weights_end_equal(tmp_path: Path) -> None:
    """Without the step-0 sync the same run ends with different parameters (what the sync prevents)."""
    flags = ("--replicas=3", "--min-replicas=3")
    unsynced_cmd = (PY, CASES, "--steps=10", "--seed-by-group", "--no-sync")
    rc, unsynced = launch(tmp_path / "nosync", *flags, command=unsynced_cmd)
    assert not unsynced.digests_equal, "seeding groups differently did not give different weights: the test is void"
    rc, report = launch(tmp_path / "sync", *flags, command=(PY, CASES, "--steps=10", "--seed-by-group"))
    assert rc == 0, report
    assert_clean(report, 3, 10)


def test_whole_job_restart_resumes_from_the_checkpoint(tmp_path: Path) -> None:
    """The whole job stops after 20 steps; started again on the same run dir it resumes at 20, not 0."""
    flags = ("--replicas=2", "--min-replicas=2", "--checkpoint-every=10")  # both groups train every step
    rc, first = launch(tmp_path, *flags, command=(PY, _example("mlp.py"), "--steps=20"))
    assert rc == 0, first
    assert_clean(first, 2, 20)
    rc, second = launch(tmp_path, *flags, command=(PY, _example("mlp.py"), "--steps=40"))
    assert rc == 0, second
    resumed = [s.step for s in starts(tmp_path)]
    assert sorted(resumed) == [0, 0, 20, 20], resumed
    assert_clean(second, 2, 40)  # the records of both runs: every sample of steps 1..40 exactly once


def test_plain_ddp_loop_becomes_fault_tolerant_by_changing_setup_lines_only(tmp_path: Path) -> None:
    """The README's pair: the loop is the same, every line that differs is setup before it (and plain DDP's closing
    destroy_process_group, which ftjob does at exit); the plain one runs under torchrun, the fault-tolerant one
    under the launcher with a group killed."""
    plain = (REPO / "examples" / "ddp" / "plain.py").read_text().splitlines()
    ftv = (REPO / "examples" / "ddp" / "fault_tolerant.py").read_text().splitlines()
    loop = "for x, y in loader:"

    def loop_block(lines: list[str]) -> tuple[int, int]:
        start = lines.index(loop)
        end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith(" ")), len(lines))
        return start, end

    (p0, p1), (f0, f1) = loop_block(plain), loop_block(ftv)
    assert plain[p0:p1] == ftv[f0:f1], "the loop itself changed"
    assert [s.split("#")[0].strip() for s in plain[p1:] if s.strip()] == ["dist.destroy_process_group()"]
    assert not [s for s in ftv[f1:] if s.strip()], "fault_tolerant.py needs nothing after the loop"
    changed = [op for op in difflib.SequenceMatcher(a=plain[:p1], b=ftv[:f1]).get_opcodes() if op[0] != "equal"]
    assert changed and all(i2 <= p0 and j2 <= f0 for _, _, i2, _, j2 in changed)

    torchrun = Path(PY).parent / "torchrun"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTJOB_", "RANK", "WORLD_SIZE", "MASTER_"))}
    env["OMP_NUM_THREADS"] = "1"
    done = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node=2", str(REPO / "examples" / "ddp" / "plain.py")],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]

    rc, report = launch(tmp_path, "--replicas=3", "--kill-at=8", PACE, command=(PY, _example("ddp/fault_tolerant.py")))
    assert rc == 0, report
    assert_clean(report, 3, 8192 // (32 * 3))  # one epoch of global batches
    _assert_one_kill_healed(report)


def test_the_readme_command_without_pacing_succeeds_whether_or_not_the_victim_is_back_in_time(tmp_path: Path) -> None:
    """The toy loop may end before its killed group's new process has imported torch: the run still succeeds, and
    the report names the group as not needed rather than calling its missing digest a divergence."""
    rc, report = launch(tmp_path, "--replicas=3", "--kill-at=20", command=(PY, _example("ddp/fault_tolerant.py")))
    assert rc == 0 and report.ok, report.problems
    victim_back = report.rejoin_seconds[0] is not None
    assert victim_back or len(report.not_needed_groups) == 1, (report.rejoin_seconds, report.not_needed_groups)
    finished = [(g.final_step, g.param_digest) for g in report.groups if g.group not in report.not_needed_groups]
    steps = 8192 // (32 * 3)  # one epoch of global batches
    assert len(finished) >= 2 and set(finished) == {(steps, finished[0][1])} and finished[0][1], finished
