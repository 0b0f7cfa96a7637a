"""The launcher's report and timeline, built from group record files like a real run leaves them."""

from __future__ import annotations

import json
from pathlib import Path

from ftjob.ft.records import CommitRecord, GroupLog, group_log_path, read_group_log, read_run_dir
from ftjob.launch.report import LaunchEvents, build_report, rejoin_marks
from ftjob.launch.run_records import Coverage, group_timeline
from ftjob.launch.timeline import plot_timeline


def _write(run_dir: Path, group: str, records: list[dict]) -> None:
    path = group_log_path(run_dir, group)
    with open(path, "a") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def _fake_run(run_dir: Path) -> LaunchEvents:
    """Groups 0,1,2 at one step/second; group 2 killed at t=104.5, the survivors stall 2.5s; group 2 restarts at
    t=106, heals (step 7, not contributing) and contributes again from step 8 (t=110.5); 10 steps."""
    b, cursor = 4, 0
    recs: dict[str, list[dict]] = {
        g: [{"event": "start", "t": 100.0, "incarnation": f"a{g}", "corpus_digest": "x"}] for g in "012"
    }
    recs["2"].append({"event": "start", "t": 106.0, "incarnation": "b2", "corpus_digest": "x"})
    for step in range(1, 11):
        t = 100.0 + step + (2.5 if step >= 5 else 0.0)
        members = ["0", "1", "2"] if step <= 4 or step >= 8 else ["0", "1"]
        if step == 7:
            members = ["0", "1", "2"]  # group 2 healed: it takes part but does not contribute
        contributors = [g for g in members if not (g == "2" and step == 7)]
        for g in members:
            c = g in contributors
            shard = contributors.index(g) if c else -1
            recs[g].append(
                {
                    "event": "commit",
                    "t": t,
                    "incarnation": "b2" if g == "2" and step >= 7 else f"a{g}",
                    "step": step,
                    "cursor": cursor,
                    "step_samples": len(contributors) * b,
                    "contributing": c,
                    "shard": shard,
                    "shard_start": cursor + shard * b if c else -1,
                    "shard_count": b if c else 0,
                    "num_contributors": len(contributors),
                    "participants": len(members),
                    "loss": 5.0 - step / 10,
                }
            )
        cursor += len(contributors) * b
    for g in "012":
        recs[g].append({"event": "finished", "t": 113.0, "step": 10, "param_digest": "abc"})
        _write(run_dir, g, recs[g])
    return LaunchEvents(t0=100.0, kills=[(104.5, "2")], restarts={"0": 0, "1": 0, "2": 1})


def test_report_has_every_field_and_measures_the_kill(tmp_path: Path) -> None:
    events = _fake_run(tmp_path)
    report = build_report(tmp_path, events, ["0", "1", "2"], t_end=114.0)
    assert report.steps_committed == 10
    assert [g.param_digest for g in report.groups] == ["abc"] * 3 and report.digests_equal
    assert [g.restarts for g in report.groups] == [0, 0, 1]
    assert report.failures_injected == 1
    assert report.rejoin_seconds == [110.5 - 104.5]  # first contributing commit of the new incarnation
    assert report.survivor_stall_seconds_max == 3.5  # step 4 -> 5 took 3.5s instead of 1s
    assert report.samples == Coverage(committed=4 * 12 + 3 * 8 + 3 * 12)
    assert report.final_loss == 4.0 and report.corpus_digests_equal
    assert rejoin_marks(report, events) == [(110.5, "2")]


def test_a_survivors_own_restart_is_not_counted_as_its_stall(tmp_path: Path) -> None:
    events = _fake_run(tmp_path)
    events.kills.append((109.0, "0"))  # group 2 (down from 104.5 to 109.5) is a "survivor" of this kill
    report = build_report(tmp_path, events, ["0", "1", "2"], t_end=114.0)
    assert report.survivor_stall_seconds[1] == 1.0  # not group 2's 6s gap between its two incarnations


def test_unequal_digests_are_flagged(tmp_path: Path) -> None:
    events = _fake_run(tmp_path)
    _write(tmp_path, "1", [{"event": "finished", "t": 114.0, "step": 10, "param_digest": "zzz"}])
    assert not build_report(tmp_path, events, ["0", "1", "2"], t_end=115.0).digests_equal


def test_a_killed_group_back_only_after_the_others_finished_is_not_needed_not_a_failure(tmp_path: Path) -> None:
    events = _fake_run(tmp_path)
    path = group_log_path(tmp_path, "2")
    first_life = [r.model_dump_json() for r in read_group_log(path) if r.t < 104.5]  # killed, never back
    path.write_text("\n".join(first_life) + "\n")
    assert not build_report(tmp_path, events, ["0", "1", "2"], t_end=114.0).ok  # (the launcher did not say so)
    events.not_needed.append("2")
    report = build_report(tmp_path, events, ["0", "1", "2"], t_end=114.0)
    assert report.ok and report.digests_equal and report.not_needed_groups == ["2"], report.problems
    assert report.rejoin_seconds == [None]


def test_shares_that_do_not_tile_a_step_fail_the_run(tmp_path: Path) -> None:
    events = _fake_run(tmp_path)
    assert build_report(tmp_path, events, ["0", "1", "2"], t_end=114.0).ok
    step3 = next(
        r for r in read_group_log(group_log_path(tmp_path, "1")) if isinstance(r, CommitRecord) and r.step == 3
    )
    _write(
        tmp_path, "1", [json.loads(step3.model_copy(update={"shard_start": step3.shard_start + 1}).model_dump_json())]
    )
    report = build_report(tmp_path, events, ["0", "1", "2"], t_end=114.0)
    assert not report.ok and report.problems == ["steps whose shares do not tile them: [3]"]


def test_timeline_png_is_written(tmp_path: Path) -> None:
    events = _fake_run(tmp_path)
    records = read_run_dir(tmp_path)
    out = tmp_path / "plots" / "timeline.png"
    plot_timeline(out, [group_timeline(g, records[g]) for g in "012"], 100.0, events.kills, [(108.0, "2")])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_group_log_survives_a_torn_last_line(tmp_path: Path) -> None:
    log = GroupLog(tmp_path / "group-0.jsonl")
    log.write(CommitRecord(step=1, cursor=0, step_samples=4, num_contributors=1))
    log.close()
    with open(tmp_path / "group-0.jsonl", "a") as f:
        f.write('{"event": "commit", "st')  # killed mid-write
    assert [r.step for r in read_group_log(tmp_path / "group-0.jsonl")] == [1]
