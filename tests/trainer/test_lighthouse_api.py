"""The lighthouse as a real process on loopback: authentication, input validation (rejections change nothing),
the membership API, status, metrics, the split-brain guard over HTTP, and restarts with a state file."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
from ftjob import contract

from tests.support.local_job import Lighthouse


def quorum_body(group: str, step: int = 0, **extra: object) -> dict:
    return {
        "group": group,
        "incarnation": f"inc-{group}",
        "step": step,
        "quorum_id": -1,
        "address": "127.0.0.1:1",
        "store_address": "127.0.0.1:2",
        "timeout_s": 20.0,
        **extra,
    }


@pytest.fixture
def lighthouse(tmp_path: Path):
    lh = Lighthouse(tmp_path, "--min-replicas", "1", "--join-timeout", "0.3", "--heartbeat-timeout", "30").start()
    yield lh
    lh.kill()


def ask_all(lh: Lighthouse, bodies: list[dict]) -> list[tuple[int, dict]]:
    """Concurrent quorum requests (each long-polls until the quorum forms)."""
    results: list[tuple[int, dict]] = [(0, {})] * len(bodies)

    def one(i: int) -> None:
        results[i] = lh.request("POST", contract.PATH_QUORUM, bodies[i])

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def test_health_needs_no_token_everything_else_does(lighthouse: Lighthouse):
    assert lighthouse.request("GET", contract.PATH_HEALTH, token="") == (200, "ok")
    for method, path in (("GET", contract.PATH_STATUS), ("GET", contract.PATH_METRICS), ("POST", contract.PATH_EVICT)):
        code, body = lighthouse.request(method, path, {"groups": ["0"]}, token="")
        assert code == 401 and "Authorization: Bearer" in body["error"]
        code, body = lighthouse.request(method, path, {"groups": ["0"]}, token="not-the-token")
        assert code == 401 and "wrong bearer token" in body["error"]


def test_unknown_paths_wrong_methods_and_huge_bodies_get_the_contracts_json(lighthouse: Lighthouse):
    before = lighthouse.status()
    for method, path, raw, status in (
        ("GET", "/v1/nope", None, 404),
        ("GET", contract.PATH_QUORUM, None, 405),
        ("POST", contract.PATH_HEARTBEAT, b"x" * (10 * 1024 * 1024), 413),
    ):
        code, body = lighthouse.request(method, path, raw=raw)
        assert code == status and isinstance(body, dict) and body["error"], (method, path, code, body)
    assert lighthouse.status().members == before.members


def test_bad_requests_are_rejected_with_a_reason_and_change_nothing(lighthouse: Lighthouse):
    before = lighthouse.status()
    cases = [
        (contract.PATH_QUORUM, b"{not json", "Invalid JSON"),
        (contract.PATH_QUORUM, b"[1, 2]", "Input should be an object"),
        (contract.PATH_QUORUM, json.dumps({"group": "0"}).encode(), "incarnation: Field required"),
        (
            contract.PATH_QUORUM,
            json.dumps(quorum_body("0", step="3")).encode(),
            "step: Input should be a valid integer",
        ),
        (
            contract.PATH_QUORUM,
            json.dumps(quorum_body("0", step=True)).encode(),
            "step: Input should be a valid integer",
        ),
        (
            contract.PATH_QUORUM,
            json.dumps(quorum_body("0", step=-1)).encode(),
            "step: Input should be greater than or equal to 0",
        ),
        (
            contract.PATH_HEARTBEAT,
            json.dumps({"group": "0", "incarnation": ""}).encode(),
            "incarnation: String should have at least 1 character",
        ),
        (contract.PATH_EVICT, json.dumps({"groups": "0"}).encode(), "groups: Input should be a valid array"),
        (contract.PATH_STARTING, json.dumps({"groups": [1]}).encode(), "groups.0: Input should be a valid string"),
        (
            contract.PATH_DESIRED,
            json.dumps({"replicas": 0}).encode(),
            "replicas: Input should be greater than or equal to 1",
        ),
        (contract.PATH_DESIRED, json.dumps({"replicas": "2"}).encode(), "replicas: Input should be a valid integer"),
        (contract.PATH_QUORUM, json.dumps(quorum_body("0", stpe=1)).encode(), "stpe: Extra inputs are not permitted"),
        (
            contract.PATH_QUORUM,
            json.dumps(quorum_body("0", world_size=2, addresses=["a:1"])).encode(),
            "addresses must list one address per rank (2)",
        ),
    ]
    for path, raw, message in cases:
        code, body = lighthouse.request("POST", path, raw=raw)
        assert code == 400, (path, raw, body)
        assert message in body["error"], (path, raw, body)
    code, body = lighthouse.request("POST", contract.PATH_EVICT, {"groups": ["9"], "reason": "x"})
    assert code == 404 and "unknown replica group" in body["error"]
    after = lighthouse.status()
    assert after.members == before.members == [] and after.quorum_id == before.quorum_id
    assert after.desired_replicas is None and after.history == []


def test_only_the_jobs_own_group_ids_and_bounded_values_are_accepted(tmp_path: Path):
    """With the job's token one can still not join a made-up group, send a 100 KB id or a negative step: each is
    refused (4xx, the contract's JSON) and nothing is kept."""
    lh = Lighthouse(tmp_path, "--min-replicas", "1", "--groups", "3", "--heartbeat-timeout", "30").start()
    try:
        refused = [
            (contract.PATH_QUORUM, quorum_body("abc"), 400, "group: String should match pattern"),
            (contract.PATH_QUORUM, quorum_body("3"), 403, "not one of this job's groups (0..2)"),
            (contract.PATH_QUORUM, quorum_body("01"), 400, "group: String should match pattern"),
            (contract.PATH_QUORUM, quorum_body("0", quorum_id=-5), 400, "quorum_id: Input should be greater"),
            (contract.PATH_QUORUM, quorum_body("0", world_size=0), 400, "world_size: Input should be greater"),
            (contract.PATH_QUORUM, quorum_body("0", address="a" * 100_000), 400, "address: String should have at most"),
            (contract.PATH_HEARTBEAT, {"group": "7", "incarnation": "x", "step": 1}, 403, "not one of this job's"),
            (contract.PATH_HEARTBEAT, {"group": "0", "incarnation": "x", "step": -5}, 400, "step: Input should be"),
            (contract.PATH_HEARTBEAT, {"group": "g" * 100_000, "incarnation": "x", "step": 0}, 400, "group:"),
            (contract.PATH_STARTING, {"groups": ["1", "99"]}, 403, "'99' is not one of this job's groups"),
            (contract.PATH_EVICT, {"groups": ["5"]}, 403, "not one of this job's groups"),
            (contract.PATH_DESIRED, {"replicas": 3, "groups": 2}, 400, "groups (2) must be >= replicas (3)"),
        ]
        for path, body, status, message in refused:
            code, answer = lh.request("POST", path, body)
            assert code == status and message in answer["error"], (path, str(body)[:80], code, answer)
        status = lh.status()
        assert status.members == [] and status.starting == [] and status.history == [], status
        # the operator raises the bound when it scales up; the new group is then accepted
        assert lh.request("POST", contract.PATH_DESIRED, {"replicas": 3, "groups": 5}) == (
            200,
            {"replicas": 3, "groups": 5},
        )
        code, _ = lh.request("POST", contract.PATH_HEARTBEAT, {"group": "4", "incarnation": "x", "step": 0})
        assert code == 200 and [m.group for m in lh.status().members] == ["4"]
    finally:
        lh.kill()


def test_quorum_status_metrics_and_evict_over_http(lighthouse: Lighthouse):
    for g in ("0", "1"):  # both live first, so the first asker waits (join timeout) for the other
        lighthouse.request("POST", contract.PATH_HEARTBEAT, {"group": g, "incarnation": f"inc-{g}", "step": 0})
    results = ask_all(lighthouse, [quorum_body("0"), quorum_body("1")])
    assert [code for code, _ in results] == [200, 200]
    (_, a), (_, b) = results
    assert a["quorum_id"] == b["quorum_id"] == 1 and {a["replica_rank"], b["replica_rank"]} == {0, 1}
    assert "members" not in a  # O(groups) payload only on request
    status = lighthouse.status()
    assert [m.group for m in status.members] == ["0", "1"] and status.quorum_groups == ["0", "1"]
    assert status.members[0].last_heartbeat_age_s >= 0 and status.members[0].contributing

    code, body = lighthouse.request("POST", contract.PATH_EVICT, {"groups": ["1"], "reason": "pod deleted"})
    assert code == 200 and body == {"evicted": ["1"], "abort_below": 2}
    status = lighthouse.status()
    assert [m.group for m in status.members] == ["0"] and status.abort_below == 2
    assert status.history[-1].reason == "evicted: pod deleted"
    code, body = lighthouse.request("POST", contract.PATH_QUORUM, quorum_body("1"))
    assert code == 410 and "evicted" in body["error"]  # that incarnation may not come back

    code, body = lighthouse.request("POST", contract.PATH_QUORUM, quorum_body("0", step=1, want_members=True))
    assert code == 200 and body["quorum_id"] == 2 and [m["group"] for m in body["members"]] == ["0"]
    code, metrics = lighthouse.request("GET", contract.PATH_METRICS)
    assert code == 200
    assert 'ftjob_lighthouse_evictions_total{reason="evicted"} 1.0' in metrics
    assert "ftjob_lighthouse_quorum_size 1.0" in metrics and "ftjob_lighthouse_quorum_changes_total 2.0" in metrics
    assert 'ftjob_lighthouse_request_seconds_count{path="/v1/quorum"}' in metrics


def test_split_brain_guard_over_http(lighthouse: Lighthouse):
    for g in ("0", "1", "2"):
        code, _ = lighthouse.request(
            "POST", contract.PATH_HEARTBEAT, {"group": g, "incarnation": f"inc-{g}", "step": 0}
        )
        assert code == 200
    code, body = lighthouse.request("POST", contract.PATH_QUORUM, quorum_body("0", timeout_s=1.0))
    assert code == 504 and "split-brain guard" in body["error"]  # 1 of 3 live groups never forms a quorum
    results = ask_all(lighthouse, [quorum_body("0"), quorum_body("1")])  # 2 of 3: a majority, after the join wait
    assert [code for code, _ in results] == [200, 200] and results[0][1]["replica_world_size"] == 2


def test_restart_with_state_file_keeps_ids_increasing_and_refuses_older_steps(tmp_path: Path):
    state = tmp_path / "lighthouse-state.json"
    lh = Lighthouse(tmp_path, "--min-replicas", "1", "--join-timeout", "0.2", "--state-file", str(state)).start()
    try:
        code, q = lh.request("POST", contract.PATH_QUORUM, quorum_body("0", step=7))
        assert code == 200 and q["quorum_id"] == 1
        assert json.loads(state.read_text()) == {"quorum_id": 1, "committed_step": 7}
        lh.kill()
        lh.start()  # same port, same state file
        code, body = lh.request("POST", contract.PATH_QUORUM, quorum_body("0", step=3, timeout_s=1.0))
        assert code == 504 and "committed step 7" in body["error"]  # a step behind a committed one never trains
        code, q = lh.request("POST", contract.PATH_QUORUM, quorum_body("0", step=7, quorum_id=1))
        assert code == 200 and q["quorum_id"] == 2
    finally:
        lh.kill()


def test_handover_over_http_needs_the_token_validates_and_replaces_without_an_abort(lighthouse: Lighthouse):
    body = {"groups": ["1"], "reason": "node degrading"}
    code, answer = lighthouse.request("POST", contract.PATH_HANDOVER, body, token="")
    assert code == 401 and "Authorization: Bearer" in answer["error"]
    code, answer = lighthouse.request("POST", contract.PATH_HANDOVER, body, token="not-the-token")
    assert code == 401 and "wrong bearer token" in answer["error"]
    code, answer = lighthouse.request("POST", contract.PATH_HANDOVER, body)
    assert code == 404 and "unknown replica group" in answer["error"]  # never seen yet
    for raw, message in (
        (b"{not json", "Invalid JSON"),
        (json.dumps({"groups": "1"}).encode(), "groups: Input should be a valid array"),
        (json.dumps({"groups": [1]}).encode(), "groups.0: Input should be a valid string"),
        (json.dumps({"groups": ["01"]}).encode(), "groups.0: String should match pattern"),
        (json.dumps({"groups": ["1"], "reason": "r" * 513}).encode(), "reason: String should have at most 512"),
        (json.dumps({"groups": ["1"], "why": "x"}).encode(), "why: Extra inputs are not permitted"),
        (json.dumps({"reason": "x"}).encode(), "groups: Field required"),
    ):
        code, answer = lighthouse.request("POST", contract.PATH_HANDOVER, raw=raw)
        assert code == 400 and message in answer["error"], (raw, answer)
    assert lighthouse.status().handing_over == []

    for g in ("0", "1"):  # both live first, so the first asker waits (join timeout) for the other
        lighthouse.request("POST", contract.PATH_HEARTBEAT, {"group": g, "incarnation": f"inc-{g}", "step": 0})
    results = ask_all(lighthouse, [quorum_body("0", step=4), quorum_body("1", step=4)])
    assert [code for code, _ in results] == [200, 200] and results[0][1]["quorum_id"] == 1
    code, answer = lighthouse.request("POST", contract.PATH_HANDOVER, {"groups": ["1", "7"], "reason": "x"})
    assert code == 404 and lighthouse.status().handing_over == []  # all or nothing
    code, answer = lighthouse.request("POST", contract.PATH_HANDOVER, body)
    assert code == 200 and answer == {"handing_over": ["1"], "expires_in_s": 600.0}
    assert lighthouse.status().handing_over == ["1"]
    new = {"group": "1", "incarnation": "inc-1-new", "step": 0}
    assert lighthouse.request("POST", contract.PATH_HEARTBEAT, new)[0] == 200  # the new incarnation comes up
    status = lighthouse.status()
    assert status.abort_below == 0 and status.handing_over == [] and status.history[-1].reason.startswith("handed")
    code, answer = lighthouse.request("POST", contract.PATH_QUORUM, quorum_body("1", step=5))
    assert code == 410 and "evicted" in answer["error"]  # the old incarnation
    code, q = lighthouse.request("POST", contract.PATH_QUORUM, quorum_body("0", step=5, timeout_s=5.0))
    assert code == 200 and q["quorum_id"] == 2 and q["replica_world_size"] == 1 and q["abort_below"] == 0
    code, metrics = lighthouse.request("GET", contract.PATH_METRICS)
    assert 'ftjob_lighthouse_evictions_total{reason="handed_over"} 1.0' in metrics
    assert 'ftjob_lighthouse_request_seconds_count{path="/v1/membership/handover"}' in metrics
