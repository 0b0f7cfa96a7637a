"""The integrity checks over HTTP on a real lighthouse process: guard verdicts and state digests riding on quorum
requests evict the offending group through the evict path (history, status, audit, metrics), bad input to the new
fields is refused with a clear 400 and changes nothing, and reports that merely do not fit are served and ignored."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from ftjob import contract
from ftjob.contract.lighthouse_api import AuditRecord, StatusResponse
from test_lighthouse_api import ask_all, quorum_body

from tests.support.local_job import Lighthouse


def read_records(path: Path) -> list[AuditRecord]:
    return [AuditRecord.model_validate_json(line) for line in path.read_text().splitlines()]


def verdict(quorum_id: int, *offenders: str, step: int = 0) -> dict:
    return {
        "quorum_id": quorum_id,
        "step": step,
        "offenders": [{"group": g, "kind": "norm_outlier", "norm": 1234.0, "median": 1.1} for g in offenders],
    }


def run_round(lh: Lighthouse, bodies: dict[str, dict]) -> dict[str, tuple[int, Any]]:
    """Every group asks at once (each long-polls until its quorum forms or it is refused)."""
    results = ask_all(lh, list(bodies.values()))
    return dict(zip(bodies, results, strict=True))


def first_round(lh: Lighthouse, groups: str) -> int:
    for g in groups:  # all live first, so the quorum waits for all of them
        assert lh.request("POST", contract.PATH_HEARTBEAT, {"group": g, "incarnation": f"inc-{g}", "step": 0})[0] == 200
    answers = run_round(lh, {g: quorum_body(g) for g in groups})
    assert {code for code, _ in answers.values()} == {200}, answers
    return answers[groups[0]][1]["quorum_id"]


def metric(lh: Lighthouse, name: str) -> float:
    code, text = lh.request("GET", contract.PATH_METRICS)
    assert code == 200
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


@pytest.fixture
def lighthouse(tmp_path: Path):
    # a long join timeout: each round forms at once when every member asks, never without one of them
    args = ("--join-timeout", "10", "--heartbeat-timeout", "60", "--guard-max-offences", "2")
    lh = Lighthouse(tmp_path, *args, "--audit-file", str(tmp_path / "audit.jsonl")).start()
    yield lh
    lh.kill()


def test_repeated_guard_offences_evict_the_offender(lighthouse: Lighthouse, tmp_path: Path):
    q = first_round(lighthouse, "012")
    for offence in (1, 2):  # every member reports the same verdict (the offender too), as the trainers do
        body = {"quorum_id": q, "commit_failures": 1, "guard_verdict": verdict(q, "2", step=offence)}
        answers = run_round(lighthouse, {g: quorum_body(g, **body) for g in "012"})
        if offence == 1:
            assert {code for code, _ in answers.values()} == {200} and lighthouse.status().integrity.guard_offences == {
                "2": 1
            }
            q = answers["0"][1]["quorum_id"]
    assert answers["0"][0] == answers["1"][0] == 200 and answers["0"][1]["replica_world_size"] == 2
    code, refused = answers["2"]
    assert code == 410 and "gradient_guard" in refused["error"]
    status = lighthouse.status()
    assert [m.group for m in status.members] == ["0", "1"]
    [reason] = [e.reason for e in status.history if e.event == "dropped"]
    assert reason == (
        "evicted: gradient_guard: norm_outlier in 2 step(s) within 600s (steps 1, 2); last: gradient norm 1.23e+03 "
        "vs median 1.1 of the others"
    )
    assert status.integrity.guard_offences == {"2": 2} and status.integrity.guard_evictions == {"2": 1}
    verdicts = [r for r in status.audit if r.kind in ("guard", "evict")]  # (and the 410 refusal)
    assert [(r.kind, r.group, r.actor, r.outcome) for r in verdicts] == [
        ("guard", "2", "lighthouse", "offence counted: 1 offence(s) within 600s (evicted at 2)"),
        ("guard", "2", "lighthouse", "evicted: 2 offence(s) within 600s (evicted at 2)"),
        ("evict", "2", "lighthouse", "evicted: its incarnation is banned"),
    ]
    assert "counted once 2 of its 3 groups reported it" in verdicts[0].reason
    assert [r for r in read_records(tmp_path / "audit.jsonl") if r.kind in ("guard", "evict")] == verdicts
    assert metric(lighthouse, "ftjob_lighthouse_guard_offences_total") == 2
    assert metric(lighthouse, "ftjob_lighthouse_guard_evictions_total") == 1


def test_a_divergent_digest_is_evicted_and_no_majority_evicts_nobody(lighthouse: Lighthouse, tmp_path: Path):
    q = first_round(lighthouse, "012")  # at step 0: these three commit step 1
    digests = {"0": "aaaa", "1": "aaaa", "2": "bbbb"}
    bodies = {g: quorum_body(g, step=1, quorum_id=q, state_digest={"step": 1, "digest": d}) for g, d in digests.items()}
    answers = run_round(lighthouse, bodies)
    assert answers["0"][0] == answers["1"][0] == 200 and answers["0"][1]["replica_world_size"] == 2
    assert answers["2"][0] == 410 and "divergent" in answers["2"][1]["error"]
    status = lighthouse.status()
    dropped = [e.reason for e in status.history if e.event == "dropped"]
    assert dropped == ["evicted: divergent: digest at step 1 differs from the majority (2 of 3 groups)"]
    assert status.integrity.divergences == {"2": 1} and status.integrity.digests_compared == 1
    assert status.integrity.last_compared_step == 1

    q = answers["0"][1]["quorum_id"]  # groups 0 and 1 commit step 2, then disagree: nobody can tell who is right
    bodies = {g: quorum_body(g, step=2, quorum_id=q, state_digest={"step": 2, "digest": g * 8}) for g in "01"}
    answers = run_round(lighthouse, bodies)
    assert {code for code, _ in answers.values()} == {200}
    status = lighthouse.status()
    assert [m.group for m in status.members] == ["0", "1"] and status.integrity.digests_compared == 2
    verdicts = [r for r in status.audit if r.kind in ("divergence", "evict")]  # (and the 410 refusal)
    assert [(r.kind, r.group, r.outcome) for r in verdicts] == [
        ("divergence", "2", "evicted"),
        ("evict", "2", "evicted: its incarnation is banned"),
        ("divergence", None, "no majority: nobody evicted"),
    ]
    no_majority = "digests at step 2 differ, no strict majority (2 distinct of 2: 0: 00000000, 1: 11111111)"
    assert verdicts[-1].reason == no_majority
    assert [r for r in read_records(tmp_path / "audit.jsonl") if r.kind in ("divergence", "evict")] == verdicts
    assert metric(lighthouse, "ftjob_lighthouse_divergences_total") == 1
    assert metric(lighthouse, "ftjob_lighthouse_digest_checks_total") == 2


def unchanged(status: StatusResponse) -> dict:
    """What a refused request must not change (the clock, heartbeat ages and the audit ring do move)."""
    body = status.model_dump(exclude={"clock", "audit", "blocked_reason"})  # (the ticker renews blocked_reason)
    for m in body["members"]:
        del m["last_heartbeat_age_s"]
    return body


def test_bad_input_to_the_new_fields_gets_a_clear_400_and_changes_nothing(tmp_path: Path):
    lh = Lighthouse(tmp_path, "--groups", "3", "--join-timeout", "0.2").start()
    try:
        q = first_round(lh, "0")
        offence = {"group": "1", "kind": "nonfinite"}
        good = {"quorum_id": q, "step": 0, "offenders": [offence]}
        cases: list[tuple[dict, str]] = [
            ({"guard_verdict": "x"}, "guard_verdict: Input should be an object"),
            ({"guard_verdict": {**good, "extra": 1}}, "guard_verdict.extra: Extra inputs are not permitted"),
            ({"guard_verdict": {**good, "step": -1}}, "guard_verdict.step: Input should be greater than or equal to 0"),
            (
                {"guard_verdict": {**good, "quorum_id": str(q)}},
                "guard_verdict.quorum_id: Input should be a valid integer",
            ),
            ({"guard_verdict": {**good, "offenders": []}}, "guard_verdict.offenders: List should have at least 1 item"),
            (
                {"guard_verdict": {**good, "offenders": [{**offence, "group": "abc"}]}},
                "guard_verdict.offenders.0.group: String should match pattern",
            ),
            (
                {"guard_verdict": {**good, "offenders": [{**offence, "group": "01"}]}},
                "guard_verdict.offenders.0.group: String should match pattern",
            ),
            (
                {"guard_verdict": {**good, "offenders": [{**offence, "kind": "weird"}]}},
                "guard_verdict.offenders.0.kind: Input should be 'nonfinite', 'norm_outlier' or 'norm_mismatch'",
            ),
            (
                {"guard_verdict": {**good, "offenders": [{**offence, "norm": -1.0}]}},
                "guard_verdict.offenders.0.norm: Input should be greater than or equal to 0",
            ),
            (
                {"guard_verdict": {**good, "offenders": [offence, offence]}},
                "guard_verdict.offenders names group '1' twice",
            ),
            ({"guard_verdict": {**good, "quorum_id": q + 1}}, f"guard_verdict.quorum_id ({q + 1}) is newer than"),
            ({"state_digest": []}, "state_digest: Input should be an object"),
            ({"state_digest": {"step": -1, "digest": "a"}}, "state_digest.step: Input should be greater than or equal"),
            (
                {"state_digest": {"step": 0, "digest": "a" * 10240}},
                "state_digest.digest: String should have at most 128",
            ),
            (
                {"state_digest": {"step": 0, "digest": ""}},
                "state_digest.digest: String should have at least 1 character",
            ),
            ({"state_digest": {"step": 0}}, "state_digest.digest: Field required"),
            ({"state_digest": {"step": 0, "digest": "a", "x": 1}}, "state_digest.x: Extra inputs are not permitted"),
            ({"state_digest": {"step": 1, "digest": "a"}}, "state_digest.step (1) is ahead of step (0)"),
        ]
        before = unchanged(lh.status())
        for extra, message in cases:
            body = quorum_body("0", quorum_id=q, **extra)
            code, answer = lh.request("POST", contract.PATH_QUORUM, raw=json.dumps(body).encode())
            assert code == 400 and message in answer["error"], (extra, code, answer)
        assert unchanged(lh.status()) == before
        assert len(lh.status().audit) == 1  # 18 refusals of one kind: one record in the status ring
        code, metrics = lh.request("GET", contract.PATH_METRICS)
        assert f'ftjob_lighthouse_audit_records_total{{kind="refused"}} {len(cases)}.0' in metrics
    finally:
        lh.kill()


def test_reports_that_do_not_fit_are_served_and_ignored(tmp_path: Path):
    """A verdict about a quorum this lighthouse does not know (it restarted since), or naming a group that was not in
    that quorum (or not one of the job's groups), is ignored and audited: the request that carries it is answered."""
    audit = tmp_path / "audit.jsonl"
    lh = Lighthouse(tmp_path, "--groups", "3", "--join-timeout", "0.2", "--audit-file", str(audit)).start()
    try:
        q = first_round(lh, "0")
        for report in (verdict(q - 1, "0"), verdict(q, "2"), verdict(q, "7")):
            code, answer = lh.request("POST", contract.PATH_QUORUM, quorum_body("0", quorum_id=q, guard_verdict=report))
            assert code == 200 and answer["quorum_id"] == q, answer
        status = lh.status()
        assert status.integrity.guard_offences == {} and [m.group for m in status.members] == ["0"]
        ignored = [r for r in read_records(audit) if r.kind == "refused"]
        assert [r.outcome for r in ignored] == ["ignored (the quorum request was served)"]  # folded per peer and kind
        assert f"this lighthouse does not know quorum {q - 1}" in ignored[0].reason
        assert ignored[0].actor.startswith("group 0 (incarnation inc-0) from 127.0.0.1")
    finally:
        lh.kill()


def test_the_guard_and_audit_flags_fall_back_to_the_env_and_are_validated(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
):
    from ftjob.lighthouse.cli import parse_args

    for name in (contract.ENV_GUARD_MAX_OFFENCES, contract.ENV_GUARD_WINDOW_S, contract.ENV_AUDIT_FILE):
        monkeypatch.delenv(name, raising=False)
    args = parse_args([])
    assert (args.guard_max_offences, args.guard_window_s, args.audit_file) == (3, 600.0, None)
    monkeypatch.setenv(contract.ENV_GUARD_MAX_OFFENCES, "5")
    monkeypatch.setenv(contract.ENV_GUARD_WINDOW_S, "90")
    monkeypatch.setenv(contract.ENV_AUDIT_FILE, str(tmp_path / "audit.jsonl"))
    args = parse_args([])
    assert (args.guard_max_offences, args.guard_window_s, args.audit_file) == (5, 90.0, str(tmp_path / "audit.jsonl"))
    assert parse_args(["--guard-max-offences", "1", "--guard-window-s", "0.5"]).guard_max_offences == 1
    for argv, message in (
        (["--guard-max-offences", "0"], "--guard-max-offences (env FTJOB_GUARD_MAX_OFFENCES): must be an integer >= 1"),
        (["--guard-max-offences", "2.5"], "--guard-max-offences (env FTJOB_GUARD_MAX_OFFENCES): invalid int value"),
        (["--guard-window-s", "0"], "--guard-window-s (env FTJOB_GUARD_WINDOW_S): must be a number > 0, got '0'"),
        (["--guard-window-s", "nan"], "--guard-window-s (env FTJOB_GUARD_WINDOW_S): must be a number > 0"),
        (["--audit-file", str(tmp_path / "no" / "such" / "dir")], "--audit-file (env FTJOB_AUDIT_FILE): cannot append"),
    ):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err, argv
    monkeypatch.setenv(contract.ENV_GUARD_MAX_OFFENCES, "-3")  # a bad env value is named like a bad flag
    with pytest.raises(SystemExit):
        parse_args([])
    assert "(env FTJOB_GUARD_MAX_OFFENCES): must be an integer >= 1, got '-3'" in capsys.readouterr().err
