"""Two tokens, two roles (ftjob.lighthouse.api.auth), on a real lighthouse process on loopback: the job's worker token
-- every worker pod holds it -- changes nothing of the job's membership and speaks only for the group ids the operator
declared; the operator's token does the membership API and none of a group's calls; either reads the status and the
metrics. Every refusal is a 403 (the contract's JSON), changes nothing, and is audited with who sent it."""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from ftjob import contract
from ftjob.contract.lighthouse_api import AuditRecord, StatusResponse
from ftjob.launch.config import add_launch_flags, config_from_args
from ftjob.launch.launcher import Launcher
from ftjob.launch.procs import start_lighthouse
from test_lighthouse_api import quorum_body

from tests.support.local_job import OPERATOR_TOKEN, TOKEN, Lighthouse
from tests.support.polling import wait_for

PEER = "127.0.0.1"
MEMBERSHIP_CALLS = [
    (contract.PATH_DESIRED, {"replicas": 1, "groups": 100}),
    (contract.PATH_EVICT, {"groups": ["0"], "reason": "not the operator"}),
    (contract.PATH_STARTING, {"groups": ["2"]}),
    (contract.PATH_HANDOVER, {"groups": ["1"], "reason": "not the operator"}),
]


@pytest.fixture
def lh(tmp_path: Path):
    audit = tmp_path / "audit.jsonl"
    lighthouse = Lighthouse(tmp_path, "--min-replicas", "1", "--replicas", "2", "--groups", "3",
                            "--heartbeat-timeout", "60", "--audit-file", str(audit)).start()  # fmt: skip
    lighthouse.audit = audit  # type: ignore[attr-defined]
    yield lighthouse
    lighthouse.kill()


def beat(lh: Lighthouse, group: str, token: str = TOKEN, rank: int = 0) -> tuple[int, Any]:
    body = {"group": group, "incarnation": f"inc-{group}", "step": 0, "rank": rank}
    return lh.request("POST", contract.PATH_HEARTBEAT, body, token=token)


def audit_records(lh: Lighthouse) -> list[AuditRecord]:
    path: Path = lh.audit  # type: ignore[attr-defined]
    return [AuditRecord.model_validate_json(line) for line in path.read_text().splitlines()] if path.exists() else []


def refused_counted(lh: Lighthouse) -> float:
    """Refusals the audit trail counted, folded ones one by one (its metric)."""
    _code, text = lh.request("GET", contract.PATH_METRICS)
    line = next(
        x for x in str(text).splitlines() if x.startswith('ftjob_lighthouse_audit_records_total{kind="refused"}')
    )
    return float(line.split()[-1])


def membership(status: StatusResponse) -> tuple[Any, ...]:
    """Everything a membership call could change."""
    members = [(m.group, m.incarnation, m.finished) for m in status.members]
    return members, status.starting, status.handing_over, status.desired_replicas, status.history, status.abort_below


async def watch_handshake(url: str, token: str, group: str, rank: int = 0) -> int:
    """The status of a watch socket's handshake: 101 when it opened (then closed at once), else the refusal's."""
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as session:
        query = {"group": group, "incarnation": f"inc-{group}", "rank": str(rank)}
        try:
            async with session.ws_connect(url + contract.PATH_WATCH, params=query):
                return 101
        except aiohttp.WSServerHandshakeError as e:
            return e.status


def test_a_worker_token_changes_nothing_of_the_membership_and_every_refusal_is_audited(lh: Lighthouse):
    assert beat(lh, "0")[0] == 200 and beat(lh, "1")[0] == 200
    before = lh.status()
    for path, body in MEMBERSHIP_CALLS:
        code, answer = lh.request("POST", path, body, token=TOKEN)
        assert code == 403, (path, code, answer)
        assert f"{path} is the operator's call" in answer["error"], answer
    after = lh.status()
    assert membership(after) == membership(before)
    assert after.desired_replicas == 2 and [m.group for m in after.members] == ["0", "1"]
    # the group bound is still 3: a worker cannot open the door to group 50 (or to 3) by raising it
    for group in ("50", "3"):
        code, answer = beat(lh, group)
        assert code == 403 and "not one of this job's groups (0..2)" in answer["error"], answer
    assert membership(lh.status()) == membership(before)

    refusals = len(MEMBERSHIP_CALLS) + 2
    assert refused_counted(lh) == refusals  # each refusal is an audited event
    first = next(r for r in audit_records(lh) if r.kind == "refused")  # the first of a kind from a peer: at once
    assert (first.actor, first.outcome) == (f"worker from {PEER}", "refused 403")
    assert first.reason.startswith(f"POST {contract.PATH_DESIRED}: {contract.PATH_DESIRED} is the operator's call")
    # the others from the same peer within the fold window: one line that counts them, the last one's who and why
    folded = wait_for(lambda: [r for r in audit_records(lh) if r.outcome.startswith("refused 403 (x")], 30,
                      "the folded line of the other refusals")  # fmt: skip
    assert folded[0].outcome == f"refused 403 (x{refusals - 1} more from {PEER} in the last 5s)"
    assert folded[0].actor == f"group 3 (incarnation inc-3) from {PEER}"


def test_the_operator_token_does_the_membership_api_and_none_of_a_groups_calls(lh: Lighthouse):
    assert beat(lh, "0")[0] == 200 and beat(lh, "1")[0] == 200
    before = lh.status()
    refused = [
        ("POST", contract.PATH_HEARTBEAT, {"group": "2", "incarnation": "inc-2", "step": 0}),
        ("POST", contract.PATH_QUORUM, quorum_body("2")),
    ]
    for method, path, body in refused:
        code, answer = lh.request(method, path, body, token=OPERATOR_TOKEN)
        assert code == 403 and f"{path} is a replica group's call" in answer["error"], (path, answer)
    assert asyncio.run(watch_handshake(lh.url, OPERATOR_TOKEN, "2")) == 403
    assert membership(lh.status()) == membership(before)  # no group 2 joined
    first = next(r for r in audit_records(lh) if r.kind == "refused")
    assert (first.actor, first.outcome) == (f"operator from {PEER}", "refused 403")
    assert refused_counted(lh) == len(refused) + 1

    op = OPERATOR_TOKEN
    assert lh.request("POST", contract.PATH_DESIRED, {"replicas": 2, "groups": 3}, token=op) == (
        200,
        {"replicas": 2, "groups": 3},
    )
    assert lh.request("POST", contract.PATH_STARTING, {"groups": ["2"]}, token=op) == (200, {"starting": ["2"]})
    code, answer = lh.request("POST", contract.PATH_HANDOVER, {"groups": ["1"], "reason": "drain"}, token=op)
    assert code == 200 and answer["handing_over"] == ["1"]
    code, answer = lh.request("POST", contract.PATH_EVICT, {"groups": ["0"], "reason": "pod lost"}, token=op)
    assert code == 200 and answer["evicted"] == ["0"]
    status = lh.status()
    assert [m.group for m in status.members] == ["1"] and status.starting == ["2"] and status.handing_over == ["1"]
    evict = next(r for r in audit_records(lh) if r.kind == "evict")
    assert evict.actor == f"operator from {PEER}" and evict.group == "0"
    # the status and the metrics are read-only: either token reads them
    for token in (TOKEN, OPERATOR_TOKEN):
        assert lh.request("GET", contract.PATH_STATUS, token=token)[0] == 200
        assert lh.request("GET", contract.PATH_METRICS, token=token)[0] == 200


def test_an_undeclared_group_id_is_refused_on_every_group_call_before_any_change(lh: Lighthouse):
    calls = {
        "quorum": lambda: lh.request("POST", contract.PATH_QUORUM, quorum_body("50", timeout_s=5.0)),
        "heartbeat rank 0": lambda: beat(lh, "50"),
        "heartbeat rank 1": lambda: beat(lh, "50", rank=1),  # not counted, yet refused: no id outside the job's
        "watch rank 0": lambda: (asyncio.run(watch_handshake(lh.url, TOKEN, "50")), None),
        "watch rank 1": lambda: (asyncio.run(watch_handshake(lh.url, TOKEN, "50", rank=1)), None),
    }
    for what, call in calls.items():
        code, _answer = call()
        assert code == 403, (what, code, _answer)
    status = lh.status()
    assert status.members == [] and status.history == [] and status.quorum_id == 0
    assert refused_counted(lh) == len(calls)
    assert beat(lh, "2")[0] == 200 and [m.group for m in lh.status().members] == ["2"]  # a declared id joins


def lighthouse_exit(tmp_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FTJOB_")}
    cmd = [sys.executable, "-m", "ftjob.lighthouse", "--bind", "127.0.0.1:0"]
    return subprocess.run(cmd, env={**clean, **env}, capture_output=True, text=True, timeout=120, cwd=tmp_path)


def test_the_lighthouse_starts_only_with_both_tokens_and_never_with_one_token_twice(tmp_path: Path):
    missing = lighthouse_exit(tmp_path, {contract.ENV_TOKEN: TOKEN})
    assert missing.returncode == 2 and contract.ENV_OPERATOR_TOKEN in missing.stderr, missing.stderr
    same = lighthouse_exit(tmp_path, {contract.ENV_TOKEN: TOKEN, contract.ENV_OPERATOR_TOKEN: TOKEN})
    assert same.returncode == 2 and "must differ" in same.stderr, same.stderr
    token_file = tmp_path / "operator-token"
    token_file.write_text("from-a-file\n")
    lh = Lighthouse(tmp_path, "--operator-token-file", str(token_file)).start()  # the flag wins over the env
    try:
        body = {"replicas": 1}
        assert lh.request("POST", contract.PATH_DESIRED, body, token="from-a-file")[0] == 200
        assert lh.request("POST", contract.PATH_DESIRED, body, token=OPERATOR_TOKEN)[0] == 401
    finally:
        lh.kill()


def test_the_local_launcher_plays_the_operator_with_its_own_token(tmp_path: Path):
    """`ftjob-trainer launch` runs the lighthouse as the operator does: the operator's token for it alone, never in a
    group's environment, and the group ids it runs declared."""
    p = argparse.ArgumentParser()
    add_launch_flags(p)
    launcher = Launcher(config_from_args(p.parse_args(["--replicas=2", "--spares=1", f"--run-dir={tmp_path}"])))
    args, env = launcher.lighthouse_launch
    groups_env = launcher.group_env
    assert contract.ENV_OPERATOR_TOKEN not in groups_env and launcher.operator_token not in groups_env.values()
    assert (
        env[contract.ENV_OPERATOR_TOKEN] == launcher.operator_token != launcher.token == groups_env[contract.ENV_TOKEN]
    )
    proc, log = start_lighthouse(args, env, tmp_path / "lighthouse.log")
    try:
        launcher.status.wait_healthy(deadline=time.monotonic() + 60, proc=proc)
        lh = Lighthouse(tmp_path, port=launcher.port, token=launcher.token, operator_token=launcher.operator_token)
        assert lh.request("POST", contract.PATH_DESIRED, {"replicas": 1}, token=launcher.token)[0] == 403
        assert lh.request("POST", contract.PATH_STARTING, {"groups": ["2"]})[0] == 200  # the operator's token
        assert beat(lh, "3", token=launcher.token)[0] == 403  # 3 groups: 0..2
        assert beat(lh, "2", token=launcher.token)[0] == 200
    finally:
        proc.kill()
        proc.wait(30)
        log.close()
