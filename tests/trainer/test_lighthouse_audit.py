"""The lighthouse's audit trail: the JSON lines themselves and their folding (AuditTrail, explicit clock), and over HTTP
on a real lighthouse process the lines for joins, leaves, evictions and refused requests, their actors, the status
ring and the metrics."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import Any

import pytest
from ftjob import contract
from ftjob.contract.lighthouse_api import AuditRecord
from ftjob.lighthouse.audit_trail import AUDIT_LOGGER, FOLD_WINDOW_S, RING_LEN, AuditTrail, configure_audit_logging
from prometheus_client import CollectorRegistry, Counter
from test_lighthouse_api import quorum_body

from tests.support.local_job import Lighthouse
from tests.support.polling import wait_for

PEER = "127.0.0.1"


def read_records(path: Path) -> list[AuditRecord]:
    return [AuditRecord.model_validate_json(line) for line in path.read_text().splitlines()] if path.exists() else []


# --- AuditTrail --------------------------------------------------------------------------------------------------
@pytest.fixture
def trail(tmp_path: Path):
    registry = CollectorRegistry()
    counter = Counter("audit_records", "test", ["kind"], registry=registry)
    t = AuditTrail(str(tmp_path / "audit.jsonl"), counter=counter, wall_clock=lambda: 1700000000.0)
    t.registry = registry  # type: ignore[attr-defined]  # what `counted` reads the counter from
    yield t
    t.close()


def counted(trail: AuditTrail, kind: str) -> float:
    value = trail.registry.get_sample_value("audit_records_total", {"kind": kind})  # type: ignore[attr-defined]
    return value or 0.0  # a kind never counted has no sample yet


def test_every_record_is_one_json_line_in_the_file_and_on_the_audit_logger(trail: AuditTrail, tmp_path: Path):
    stream = io.StringIO()
    logger = logging.getLogger(AUDIT_LOGGER)
    handler, level = logging.StreamHandler(stream), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        trail.record(
            1.5, "join", "group 0 (incarnation a) from 10.0.0.1", "a new incarnation registered", "joined", "0"
        )
        trail.record(2.0, "evict", "operator from 10.0.0.2", "pod deleted", "evicted", "0")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    lines = (tmp_path / "audit.jsonl").read_text().splitlines()
    assert lines == stream.getvalue().splitlines()
    assert json.loads(lines[0]) == {
        "seq": 1,
        "time": 1.5,
        "wall_time": 1700000000.0,
        "kind": "join",
        "group": "0",
        "actor": "group 0 (incarnation a) from 10.0.0.1",
        "reason": "a new incarnation registered",
        "outcome": "joined",
    }
    assert [r.seq for r in trail.ring()] == [2]  # only job-level records go to the status ring
    assert counted(trail, "join") == 1 and counted(trail, "evict") == 1


def test_configured_audit_logger_writes_bare_json_whatever_the_root_format():
    stream = io.StringIO()
    logger = configure_audit_logging(stream)
    try:
        logger.info('{"seq": 1}')
        assert stream.getvalue() == '{"seq": 1}\n' and not logger.propagate
    finally:
        for h in [h for h in logger.handlers if getattr(h, "_ftjob_audit", False)]:
            logger.removeHandler(h)
        logger.propagate = True


def test_refusals_from_one_peer_fold_into_one_line_per_window_with_a_count(trail: AuditTrail, tmp_path: Path):
    path = tmp_path / "audit.jsonl"
    for i in range(50):
        trail.refused(0.01 * i, PEER, "refused 401", f"unauthenticated client from {PEER}", f"bad token {i}")
    trail.refused(0.6, "10.0.0.9", "refused 401", "unauthenticated client from 10.0.0.9", "bad token")
    trail.refused(0.7, PEER, "refused 400", f"client from {PEER}", "invalid body")
    assert [(r.actor, r.outcome, r.reason) for r in read_records(path)] == [
        (f"unauthenticated client from {PEER}", "refused 401", "bad token 0"),
        ("unauthenticated client from 10.0.0.9", "refused 401", "bad token"),
        (f"client from {PEER}", "refused 400", "invalid body"),
    ]
    trail.flush(FOLD_WINDOW_S - 0.1)
    assert len(read_records(path)) == 3  # the window is not over yet
    trail.flush(FOLD_WINDOW_S + 0.01)
    summary = read_records(path)[3:]
    assert [(r.outcome, r.reason) for r in summary] == [
        (f"refused 401 (x49 more from {PEER} in the last 5s)", "bad token 49")
    ]
    trail.refused(FOLD_WINDOW_S + 1, PEER, "refused 401", "x", "still at it")  # a flood goes on: still folded
    trail.flush(2 * FOLD_WINDOW_S + 0.1)
    assert read_records(path)[-1].outcome == f"refused 401 (x1 more from {PEER} in the last 5s)"
    trail.flush(3 * FOLD_WINDOW_S + 0.2)  # it stopped: no more lines; the next refusal is written at once
    trail.refused(3 * FOLD_WINDOW_S + 0.3, PEER, "refused 401", "x", "again")
    assert [r.reason for r in read_records(path)[-1:]] == ["again"] and len(read_records(path)) == 6
    assert counted(trail, "refused") == 54  # every refusal counts, folded or not


def test_the_status_ring_keeps_job_level_records_and_one_refusal_per_kind_per_minute(trail: AuditTrail):
    for i in range(30):  # a flood from many peers and of many refusals
        trail.refused(float(i), f"10.0.1.{i}", "refused 401", "x", "bad token")
    trail.refused(30.0, PEER, "refused 410", "group 1 (incarnation a) from x", "evicted")
    for i in range(RING_LEN + 5):
        trail.record(40.0 + i, "guard", "lighthouse", f"offence {i}", "offence counted", "1")
    trail.refused(200.0, "10.0.2.1", "refused 401", "x", "bad token")
    ring = trail.ring()
    assert len(ring) == RING_LEN and ring[-1].outcome == "refused 401" and ring[-2].reason == f"offence {RING_LEN + 4}"
    assert [r.seq for r in ring] == sorted(r.seq for r in ring)  # oldest first
    trail2 = AuditTrail()
    for i in range(30):
        trail2.refused(float(i), f"10.0.1.{i}", "refused 401", "x", "bad token")
    trail2.refused(30.0, PEER, "refused 410", "x", "evicted")
    trail2.record(31.0, "divergence", "lighthouse", "no majority", "no majority: nobody evicted")
    assert [r.outcome for r in trail2.ring()] == ["refused 401", "refused 410", "no majority: nobody evicted"]


# --- over HTTP ---------------------------------------------------------------------------------------------------
def beat(lh: Lighthouse, group: str, inc: str, **extra: Any) -> tuple[int, Any]:
    return lh.request("POST", contract.PATH_HEARTBEAT, {"group": group, "incarnation": inc, "step": 0, **extra})


def test_membership_changes_and_refusals_are_audited_with_who_asked(tmp_path: Path):
    audit = tmp_path / "audit.jsonl"
    # a timeout long enough that only group 0, which never beats again, times out (b2 must live until the evict)
    lh = Lighthouse(tmp_path, "--heartbeat-timeout", "5", "--audit-file", str(audit)).start()
    try:
        me = f"from {PEER}"
        assert beat(lh, "0", "a")[0] == 200  # join
        assert beat(lh, "1", "b")[0] == 200  # join
        assert beat(lh, "1", "b2")[0] == 200  # a restart: the old incarnation leaves, the new one joins
        assert beat(lh, "2", "c", finished=True)[0] == 200  # joins and finishes: a leave
        code, _ = lh.request("POST", contract.PATH_EVICT, {"groups": ["1"], "reason": "pod deleted"})
        assert code == 200
        code, body = lh.request("POST", contract.PATH_QUORUM, {**quorum_body("1"), "incarnation": "b2"})
        assert code == 410 and body["error"].endswith("(evicted: pod deleted)")  # the evicted incarnation, and why
        assert lh.request("GET", contract.PATH_STATUS, token="wrong")[0] == 401
        assert lh.request("POST", contract.PATH_HEARTBEAT, {"group": "0", "step": "1"})[0] == 400
        assert lh.request("POST", contract.PATH_HANDOVER, {"groups": ["2"], "reason": "node draining"})[0] == 200
        records = wait_for(
            lambda: (r := read_records(audit)) and any(x.reason == "heartbeat_timeout" for x in r) and r,
            20,
            "group 0's heartbeat timeout",
            interval=0.05,
        )
        got = [(r.kind, r.group, r.actor, r.reason, r.outcome) for r in records]
        timeout = (
            "leave",
            "0",
            "lighthouse",
            "heartbeat_timeout",
            "dropped: no heartbeat within the heartbeat timeout",
        )
        assert got.count(timeout) == 1  # whenever it came: the lighthouse's own decision
        got.remove(timeout)
        assert got == [
            ("join", "0", f"group 0 (incarnation a) {me}", "a new incarnation registered (heartbeat)", "joined"),
            ("join", "1", f"group 1 (incarnation b) {me}", "a new incarnation registered (heartbeat)", "joined"),
            (
                "leave",
                "1",
                f"group 1 (incarnation b2) {me}",
                "restarted",
                "replaced by a new incarnation of the group (this one is banned)",
            ),
            ("join", "1", f"group 1 (incarnation b2) {me}", "a new incarnation registered (heartbeat)", "joined"),
            ("join", "2", f"group 2 (incarnation c) {me}", "a new incarnation registered (heartbeat)", "joined"),
            ("leave", "2", f"group 2 (incarnation c) {me}", "finished training", "kept in the status as finished"),
            ("evict", "1", f"operator {me}", "evicted: pod deleted", "evicted: its incarnation is banned"),
            (
                "refused",
                "1",
                f"group 1 (incarnation b2) {me}",
                "POST /v1/quorum: group '1' incarnation 'b2' was evicted; restart the group's process to rejoin "
                "(evicted: pod deleted)",
                "refused 410",
            ),
            (
                "refused",
                None,
                f"unauthenticated client {me}",
                "GET /v1/status: wrong bearer token: use the job's token",
                "refused 401",
            ),
            (
                "refused",
                None,
                f"worker {me}",  # the job's token, no group named yet
                "POST /v1/heartbeat: invalid HeartbeatRequest: incarnation: Field required; step: Input should be a "
                "valid integer (got '1')",
                "refused 400",
            ),
            (
                "leave",
                "2",
                f"operator {me}",
                "handover: node draining",
                "marked for a handover: its next incarnation replaces this one without an abort",
            ),
        ]
        assert [r.seq for r in records] == list(range(1, len(records) + 1))
        # the same lines on stderr, bare JSON whatever the log format
        logged = [line for line in (tmp_path / "lighthouse-1.log").read_text().splitlines() if line.startswith("{")]
        assert [AuditRecord.model_validate_json(line) for line in logged] == records
        status = lh.status()
        assert [r.kind for r in status.audit] == ["evict", "refused", "refused", "refused"]  # job-level only
        code, metrics = lh.request("GET", contract.PATH_METRICS)
        for kind, n in (("join", 4), ("leave", 4), ("evict", 1), ("refused", 3)):
            assert f'ftjob_lighthouse_audit_records_total{{kind="{kind}"}} {n}.0' in metrics, kind
    finally:
        lh.kill()


def test_a_flood_of_refused_requests_is_folded_in_the_log_and_the_status(tmp_path: Path):
    audit = tmp_path / "audit.jsonl"
    lh = Lighthouse(tmp_path, "--audit-file", str(audit)).start()
    try:
        for _ in range(30):
            assert lh.request("GET", contract.PATH_STATUS, token="wrong")[0] == 401
        status = lh.status()
        assert [r.outcome for r in status.audit] == ["refused 401"]
        summary = wait_for(
            lambda: [r for r in read_records(audit) if r.outcome.startswith("refused 401 (x")],
            20,
            "the folded line",
            interval=0.05,
        )
        assert [r.outcome for r in read_records(audit)] == ["refused 401", summary[0].outcome]
        assert summary[0].outcome == f"refused 401 (x29 more from {PEER} in the last 5s)"
        assert (
            'ftjob_lighthouse_audit_records_total{kind="refused"} 30.0' in lh.request("GET", contract.PATH_METRICS)[1]
        )
    finally:
        lh.kill()


def test_beyond_max_folds_new_peers_share_one_fold(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setattr("ftjob.lighthouse.audit_trail.MAX_FOLDS", 2)
    trail = AuditTrail(str(tmp_path / "audit.jsonl"))
    for i in range(10):  # ten peers at once: two folds of their own, the rest share one
        trail.refused(0.1 * i, f"10.0.0.{i}", "refused 401", f"client from 10.0.0.{i}", "bad token")
    trail.flush(FOLD_WINDOW_S + 1)
    trail.close()
    outcomes = [r.outcome for r in read_records(tmp_path / "audit.jsonl")]
    assert outcomes == ["refused 401"] * 3 + ["refused 401 (x7 more from many peers in the last 5s)"]
