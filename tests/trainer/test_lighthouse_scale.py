"""The lighthouse's scale features: answers spliced from a once-encoded shared part, the heartbeat pace it asks for,
and the quorum long-poll over the watch socket (one connection per group)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest
from ftjob import contract
from ftjob.contract.lighthouse_api import AbortSignal, QuorumRequest, QuorumResponse, WatchQuorumAnswer
from ftjob.lighthouse.api.watch import HeartbeatPace
from ftjob.lighthouse.core.quorum import QuorumCore

from tests.support.local_job import OPERATOR_TOKEN, TOKEN, Lighthouse


def ask(core: QuorumCore, group: str, step: int, ranks: int = 2) -> None:
    addrs = [f"10.0.0.{group}:{100 + r}" for r in range(ranks)]
    stores = [f"10.0.0.{group}:{200 + r}" for r in range(ranks)]
    req = QuorumRequest(group=group, incarnation=f"inc-{group}", step=step, quorum_id=-1, address=addrs[0],
                        store_address=stores[0], addresses=addrs, store_addresses=stores, world_size=ranks)  # fmt: skip
    core.request(req, 0.0)


def test_each_spliced_answer_is_exactly_its_quorum_response():
    core = QuorumCore(min_replicas=1, join_timeout_s=0.0, heartbeat_timeout_s=60.0)
    core.set_desired(3)  # a spare among the up-to-date groups
    for g, step in (("0", 7), ("1", 7), ("2", 3), ("3", 7), ("10", 7)):  # "2" is behind: it heals from a peer
        ask(core, g, step)
    formed = core.poll(0.0)
    assert formed is not None and len(formed.responses) == 5 and formed.heals == 1
    spare = [g for g in formed.responses if not formed.responses[g].contributing and not formed.responses[g].heal]
    assert spare and formed.responses["2"].recover_from is not None and formed.responses["2"].heal
    for group in formed.responses:
        model = formed.responses[group]
        raw = json.loads(formed.responses.encoded(group))
        assert raw == json.loads(model.model_dump_json(exclude_none=True)), group  # what POST /v1/quorum sent before
        assert QuorumResponse.model_validate_json(formed.responses.encoded(group)) == model


def test_heartbeat_pace_keeps_the_total_rate_and_stays_well_inside_the_timeout():
    pace = HeartbeatPace(timeout_s=60.0, per_s=20_000, floor_s=0.1)
    assert pace.interval(8) == 0.1 and pace.interval(2_000) == 0.1  # a small job beats as before
    for groups in (2_001, 5_000, 12_500, 100_000):
        interval = pace.interval(groups)
        assert groups / interval <= 20_000 and groups / (interval / 2) > 20_000  # within the rate, not slower
    assert pace.interval(90_000) == pace.interval(100_000)  # hysteresis: a few groups leaving push nothing
    assert pace.interval(10) == 0.1  # all gone: back to the floor
    capped = HeartbeatPace(timeout_s=5.0, per_s=10_000, floor_s=0.1)
    assert capped.interval(12_500) == 5.0 / 4 and capped.interval(100_000) == 5.0 / 4  # liveness first
    assert HeartbeatPace(timeout_s=0.3).interval(100_000) == 0.1  # never faster than the client's default


async def _watch_session(url: str) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession(headers=headers) as session:
        sockets = {}
        for g in ("0", "1"):
            query = {"group": g, "incarnation": f"inc-{g}", "rank": "0"}
            sockets[g] = await session.ws_connect(url + contract.PATH_WATCH, params=query)
            hello = AbortSignal.model_validate_json(await sockets[g].receive_str(timeout=10))
            assert hello.heartbeat_interval_s == 0.1  # two groups: the client's default pace

        def frame(g: str, step: int, **extra: object) -> str:
            body = {"group": g, "incarnation": f"inc-{g}", "step": step, "quorum_id": -1, "address": "127.0.0.1:1",
                    "store_address": "127.0.0.1:2", "timeout_s": 20.0, **extra}  # fmt: skip
            return json.dumps({"kind": "quorum", "request": body})

        async def answer(g: str) -> WatchQuorumAnswer:
            return WatchQuorumAnswer.model_validate_json(await sockets[g].receive_str(timeout=20))

        await sockets["0"].send_str(frame("1", 0))  # another group's request on this socket
        wrong = await answer("0")
        assert wrong.status == 400 and "names group '1'" in (wrong.error or "")
        await sockets["0"].send_str(json.dumps({"kind": "quorum", "request": {"group": "0"}}))
        bad = await answer("0")
        assert bad.status == 400 and "request.incarnation: Field required" in (bad.error or "")
        for g in sockets:
            await sockets[g].send_str(frame(g, 5))
        answers = {g: await answer(g) for g in sockets}
        assert all(a.status == 200 and a.quorum is not None for a in answers.values())
        assert sorted(a.quorum.replica_rank for a in answers.values() if a.quorum) == [0, 1]
        assert {a.quorum.quorum_id for a in answers.values() if a.quorum} == {1}

        await sockets["0"].send_str(frame("0", 6))  # pending: group 1 has not asked yet
        operator = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}  # the membership API is the operator's
        async with session.post(
            url + contract.PATH_EVICT, json={"groups": ["1"], "reason": "test"}, headers=operator
        ) as r:
            assert r.status == 200
        abort = AbortSignal.model_validate_json(await sockets["0"].receive_str(timeout=10))
        assert abort.abort_below == 2  # the quorum in flight lost a member: every socket hears it at once
        alone = await answer("0")  # the survivor's pending request forms a quorum of one
        assert alone.status == 200 and alone.quorum is not None and alone.quorum.replica_world_size == 1
        for ws in sockets.values():
            await ws.close()


def test_quorum_over_the_watch_socket_answers_refuses_and_aborts(tmp_path: Path):
    lh = Lighthouse(tmp_path, "--min-replicas", "1", "--join-timeout", "0.3", "--heartbeat-timeout", "30").start()
    try:
        asyncio.run(_watch_session(lh.url))
    finally:
        lh.kill()


def quorum_posts(lh: Lighthouse) -> float:
    """How many quorum requests reached the lighthouse over HTTP (from its /metrics)."""
    _code, text = lh.request("GET", contract.PATH_METRICS)
    lines = str(text).splitlines()
    key = f'ftjob_lighthouse_request_seconds_count{{path="{contract.PATH_QUORUM}"}}'
    return sum(float(line.split()[-1]) for line in lines if line.startswith(key))


def test_the_client_asks_for_its_quorum_on_the_watch_socket_and_hears_an_eviction_there(tmp_path: Path):
    from ftjob.ft.links.lighthouse_client import EvictedError, LighthouseClient

    lh = Lighthouse(tmp_path, "--min-replicas", "1", "--join-timeout", "0.3", "--heartbeat-timeout", "30").start()
    client = LighthouseClient(lh.url, TOKEN, "0", "inc-0").start()
    try:
        assert client.watch_connected.wait(10)
        req = QuorumRequest(group="0", incarnation="inc-0", step=0, quorum_id=-1, address="127.0.0.1:1",
                            store_address="127.0.0.1:2")  # fmt: skip
        first = client.quorum(req, timeout_s=20)
        second = client.quorum(req.model_copy(update={"step": 1, "quorum_id": first.quorum_id}), timeout_s=20)
        assert (first.replica_world_size, second.quorum_id) == (1, first.quorum_id)
        assert quorum_posts(lh) == 0, "one connection per group: no HTTP long-poll beside the watch socket"
        code, _ = lh.request("POST", contract.PATH_EVICT, {"groups": ["0"], "reason": "test"})
        assert code == 200
        with pytest.raises(EvictedError):
            client.quorum(req.model_copy(update={"step": 2}), timeout_s=20)
    finally:
        client.close()
        lh.kill()
