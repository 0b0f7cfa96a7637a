"""Generations at the lighthouse: a process says which generation of its group it is (FTJOB_GENERATION), the
lighthouse keeps it on the member, reports it in the status and in every drop, and refuses (410, audited, nothing
changed) a process of a generation the operator declared replaced -- also one that registered first and is dropped
when the declaration comes. A replacement lighthouse judges no group for the silence before it registered there.
The core with an explicit clock, then the HTTP server and the trainer's client in this process (no other process)."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from ftjob import contract
from ftjob.contract.lighthouse_api import AuditRecord, DesiredRequest, StatusResponse
from ftjob.ft.links.lighthouse_client import LighthouseClient
from ftjob.lighthouse.api.server import LighthouseServer
from ftjob.lighthouse.cli import build_server, parse_args
from ftjob.lighthouse.core.quorum import Outdated, QuorumCore
from ftjob.lighthouse.core.stall import MIN_INTERVALS, StallRule
from pydantic import ValidationError
from test_lighthouse_quorum import ask

from tests.support.polling import wait_for

WORKER, OPERATOR = "worker-token", "operator-token"


def core(**kw: Any) -> QuorumCore:
    c = QuorumCore(min_replicas=1, join_timeout_s=1.0, heartbeat_timeout_s=kw.pop("hb", 5.0), **kw)
    c.set_desired(3, 3)
    return c


def membership(c: QuorumCore, now: float) -> Any:
    """Everything a refused registration must leave as it was."""
    s = c.status(now)
    return (s.members, s.history, s.starting, s.quorum_id, s.abort_below, c.dropped_events, c.generations)


# --- the core -----------------------------------------------------------------------------------------------------
def test_a_replaced_generation_is_refused_once_the_operator_declared_its_successor_and_nothing_changes():
    c = core()
    ask(c, "0", generation=4)
    c.declare_generations({"1": 2}, now=1.0)
    before = membership(c, 2.0)
    with pytest.raises(Outdated) as refused:
        c.heartbeat("1", "old-process", 10, now=2.0, progress=7, generation=1)
    assert refused.value.status == 410 and "generation 1, which was replaced: generation 2" in str(refused.value)
    with pytest.raises(Outdated):
        ask(c, "1", step=10, inc="old-process", now=2.0, generation=1)
    assert membership(c, 2.0) == before, "a refused registration changes nothing"
    c.heartbeat("1", "new-process", 0, now=3.0, generation=2)  # the declared generation itself joins
    c.heartbeat("2", "old-client", 0, now=3.0)  # a client that does not say: as before
    assert {m.group: m.generation for m in c.status(3.0).members} == {"0": 4, "1": 2, "2": None}


def test_a_newer_generation_that_registered_keeps_an_older_one_out_without_the_operator():
    """A process that outlived its pod may reach a replacement lighthouse after its successor: it must not replace
    the successor (the newest incarnation of a group otherwise wins)."""
    c = core()
    c.heartbeat("1", "gen-1", 0, now=0.0, generation=1)
    with pytest.raises(Outdated):
        c.heartbeat("1", "gen-0", 50, now=0.5, generation=0)
    assert c.members["1"].incarnation == "gen-1" and c.history == type(c.history)()


def test_a_member_of_a_replaced_generation_is_evicted_when_the_declaration_comes():
    c = core()
    for g in ("0", "1"):
        ask(c, g, generation=0)
    assert c.poll(0.0) is not None
    abort_below = c.abort_below
    assert c.declare_generations({"0": 0, "1": 1}, now=1.0) == ["1"]
    [drop] = list(c.history)[-1:]
    assert (drop.group, drop.generation) == ("1", 0)
    assert drop.reason == "evicted: outdated: generation 0 was replaced by generation 1"
    assert c.abort_below > abort_below, "the quorum it was in aborts now, not at a timeout"
    assert "1" not in c.members and "0" in c.members
    with pytest.raises(Exception, match="was evicted"):
        c.heartbeat("1", "inc-1", 0, now=1.5, generation=0)  # banned as well


def test_every_drop_says_which_generation_it_dropped():
    c = core(hb=5.0)
    c.heartbeat("0", "a", 0, now=0.0, generation=3)
    c.heartbeat("0", "b", 0, now=1.0, generation=4)  # a restart: the old one is dropped as "restarted"
    c.heartbeat("1", "c", 0, now=1.0, generation=7)
    c.heartbeat("2", "d", 0, now=1.0)
    c.evict(["1"], "operator", now=2.0)
    c.sweep(now=20.0)  # "0" and "2" time out
    drops = [(e.group, e.reason.split(":")[0], e.generation) for e in c.history if e.event == "dropped"]
    assert drops == [("0", "restarted", 3), ("1", "evicted", 7), ("0", "heartbeat_timeout", 4),
                     ("2", "heartbeat_timeout", None)]  # fmt: skip


def test_generations_outside_the_jobs_groups_are_refused_before_any_change():
    c = core()
    with pytest.raises(Exception) as e:
        c.declare_generations({"0": 1, "5": 1}, now=0.0)
    assert getattr(e.value, "status", None) == 403 and c.generations == {}
    with pytest.raises(ValidationError, match="generations need groups"):
        DesiredRequest(replicas=1, generations={"0": 1})
    with pytest.raises(ValidationError, match=r"outside 0..2"):
        DesiredRequest(replicas=1, groups=3, generations={"3": 1})


def trained_replacement(groups: tuple[str, ...]) -> tuple[QuorumCore, float]:
    """A replacement lighthouse (restored quorum id and step, every group expected back) whose ``groups`` came back
    and trained enough steps for the stall rule to judge; returns it and the time of its last quorum."""
    c = QuorumCore(min_replicas=1, join_timeout_s=0.5, heartbeat_timeout_s=5.0, quorum_id=40, committed_step=300,
                   step_floor_until=1e9, stall=StallRule())  # fmt: skip
    c.set_desired(3, 3)
    c.expect_back(["0", "1", "2"])
    now = 1000.0  # a monotonic clock: the loss was long before, for this lighthouse nothing happened then
    for step in range(300, 300 + MIN_INTERVALS + 2):
        for g in groups:
            ask(c, g, step=step, now=now, progress=10 * step)
        while c.poll(now) is None:  # the first quorum waits the join timeout for the group still away
            now += 0.1
        now += 0.1
    assert c.stall.limit_s() is not None, "the rule judges from here on"
    return c, now


def test_a_replacement_lighthouse_judges_no_group_for_the_silence_before_it_registered():
    c, now = trained_replacement(("0", "1"))
    # group 2 comes back late: it was silent since the old lighthouse died (no frame reached this one), and its
    # progress counter has not moved since; it registers with one heartbeat, then is silent again (it is dying)
    registered = now
    c.heartbeat("2", "inc-2", 300, now=registered, progress=2900, waiting=False, generation=0)
    limit = c.stall.limit_s()
    assert limit is not None
    dropped: list[str] = []
    while not dropped and now < registered + 10:
        now += 0.05
        for g in ("0", "1"):  # the others train on: heard all along
            c.heartbeat(g, f"inc-{g}", 306, now=now, progress=int(now * 100), waiting=False)
        dropped = c.sweep(now)
    assert dropped == ["2"], "its silence after registering does count"
    assert now > registered + limit, f"evicted {now - registered:.2f}s after it registered (limit {limit:.2f}s)"
    assert c.history[-1].reason.startswith("evicted: stalled: no heartbeat for")


def test_a_replacement_lighthouse_times_a_heartbeat_out_from_the_groups_registration():
    c = QuorumCore(min_replicas=1, join_timeout_s=0.5, heartbeat_timeout_s=5.0, quorum_id=40, committed_step=300,
                   step_floor_until=1e9, stall=StallRule(factor=0))  # fmt: skip
    c.heartbeat("1", "inc-1", 300, now=1000.0, progress=50, generation=2)
    assert c.sweep(1004.9) == [] and c.sweep(1005.1) == ["1"]


# --- the lighthouse's command line ---------------------------------------------------------------------------------
def test_a_replacement_lighthouse_knows_the_generations_from_its_start(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(contract.ENV_GROUP_GENERATIONS, "0:1, 2:3")
    args = parse_args(["--groups", "3", "--replicas", "2"])
    server = build_server(args, WORKER, OPERATOR)
    assert server.core.generations == {"0": 1, "2": 3}
    with pytest.raises(Outdated):
        server.core.heartbeat("2", "old", 0, now=0.0, generation=2)
    for bad in ("0:x", "1", "0:1,5:1"):
        monkeypatch.setenv(contract.ENV_GROUP_GENERATIONS, bad)
        with pytest.raises(SystemExit):
            parse_args(["--groups", "3"])


# --- over HTTP ----------------------------------------------------------------------------------------------------
def headers(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}


async def post(client: TestClient, path: str, body: dict[str, Any], token: str = WORKER) -> tuple[int, Any]:
    async with client.post(path, data=json.dumps(body), headers=headers(token)) as resp:
        return resp.status, await resp.json()


async def lighthouse_status(client: TestClient) -> StatusResponse:
    async with client.get(contract.PATH_STATUS, headers=headers(OPERATOR)) as resp:
        return StatusResponse.model_validate_json(await resp.read())


def quorum(group: str, inc: str, generation: int) -> dict[str, Any]:
    return {"group": group, "incarnation": inc, "generation": generation, "step": 3, "quorum_id": -1,
            "address": "10.0.0.1:1", "store_address": "10.0.0.1:2", "timeout_s": 0.5}  # fmt: skip


def test_over_http_only_the_operator_declares_and_an_outdated_process_is_refused_and_audited(tmp_path: Path):
    audit = tmp_path / "audit.jsonl"

    async def scenario() -> None:
        c = QuorumCore(min_replicas=1, join_timeout_s=0.2, heartbeat_timeout_s=30.0)
        server = LighthouseServer(c, WORKER, OPERATOR, audit_file=str(audit))
        async with TestClient(TestServer(server.make_app())) as client:
            declare = {"replicas": 2, "groups": 3, "generations": {"0": 0, "1": 2}}
            assert (await post(client, contract.PATH_DESIRED, declare))[0] == 403, "a worker may not declare"
            assert c.generations == {}
            code, answer = await post(client, contract.PATH_DESIRED, {**declare, "groups": None}, OPERATOR)
            assert code == 400 and "generations need groups" in answer["error"]
            assert await post(client, contract.PATH_DESIRED, declare, OPERATOR) == (200, {"replicas": 2, "groups": 3})

            before = await lighthouse_status(client)
            beat = {"group": "1", "incarnation": "old", "step": 9, "generation": 1}
            code, answer = await post(client, contract.PATH_HEARTBEAT, beat)
            assert code == 410 and "generation 1, which was replaced: generation 2" in answer["error"], answer
            code, answer = await post(client, contract.PATH_QUORUM, quorum("1", "old", 1))
            assert code == 410 and "was replaced" in answer["error"], answer
            query = {"group": "1", "incarnation": "old", "generation": "1"}
            with pytest.raises(aiohttp.WSServerHandshakeError) as handshake:
                await client.ws_connect(contract.PATH_WATCH, params=query, headers=headers(WORKER))
            assert handshake.value.status == 410
            after = await lighthouse_status(client)
            assert (after.members, after.history) == (before.members, before.history) == ([], [])

            # the current generation joins; a member of generation 0 is dropped when the operator declares 1
            for joining in ({**beat, "incarnation": "new", "generation": 2}, {**beat, "group": "0", "generation": 0}):
                assert (await post(client, contract.PATH_HEARTBEAT, joining))[0] == 200
            assert {m.group: m.generation for m in (await lighthouse_status(client)).members} == {"0": 0, "1": 2}
            assert (await post(client, contract.PATH_DESIRED, {**declare, "generations": {"0": 1}}, OPERATOR))[0] == 200
            status = await lighthouse_status(client)
            assert [m.group for m in status.members] == ["1"]
            [drop] = [e for e in status.history if e.event == "dropped"]
            assert (drop.group, drop.generation, drop.reason) == ("0", 0, "evicted: outdated: generation 0 was "
                                                                  "replaced by generation 1")  # fmt: skip
            server.audit.close()

    asyncio.run(scenario())
    records = [AuditRecord.model_validate_json(line) for line in audit.read_text().splitlines()]
    refused = [r for r in records if r.kind == "refused" and r.group == "1"]
    assert refused and refused[0].outcome.startswith("refused 410"), records
    assert "generation 1, which was replaced" in refused[0].reason and "incarnation old" in refused[0].actor
    [evicted] = [r for r in records if r.kind == "evict"]
    assert (evicted.group, evicted.actor.split(" from ")[0]) == ("0", "operator"), evicted
    assert "outdated: generation 0" in evicted.reason


# --- the trainer's client against a real lighthouse (in this process: its own event loop thread) -------------------
class ServedLighthouse:
    """A LighthouseServer on 127.0.0.1, served from its own event loop thread (the client runs another)."""

    def __init__(self) -> None:
        self.core = QuorumCore(min_replicas=1, join_timeout_s=0.2, heartbeat_timeout_s=30.0)
        self.core.set_desired(1, 3)
        self.server = LighthouseServer(self.core, WORKER, OPERATOR)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.runner = web.AppRunner(self.server.make_app())
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> None:
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"

    def members(self) -> dict[str, int | None]:
        """group -> generation of every member, read on the server's loop."""

        async def read() -> dict[str, int | None]:
            return {g: m.generation for g, m in self.core.members.items()}

        return asyncio.run_coroutine_threadsafe(read(), self.loop).result(5)

    def declare(self, generations: dict[str, int]) -> int:
        body = json.dumps({"replicas": 1, "groups": 3, "generations": generations}).encode()
        req = urllib.request.Request(self.url + contract.PATH_DESIRED, body, headers(OPERATOR), method="POST")
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_the_trainers_client_registers_with_its_generation_and_a_replaced_one_is_turned_away():
    lh = ServedLighthouse()
    clients: list[LighthouseClient] = []

    def client(incarnation: str, generation: int) -> LighthouseClient:
        c = LighthouseClient(lh.url, WORKER, "0", incarnation, generation=generation, lost_timeout_s=5)
        clients.append(c)
        return c.start()

    try:
        old = client("gen-3", 3)
        wait_for(lambda: lh.members() == {"0": 3}, 10, "the watch socket to register generation 3")
        assert lh.declare({"0": 4}) == 200  # the operator replaced the group: its process is gone or going
        wait_for(lambda: old.evicted, 10, "the outdated process to be told it was evicted")
        assert lh.members() == {}
        late = client("gen-3-again", 3)  # another process of the replaced generation, reaching the lighthouse late
        wait_for(lambda: late.evicted, 10, "the late process to be turned away at its handshake")
        assert lh.members() == {}
        new = client("gen-4", 4)
        wait_for(lambda: lh.members() == {"0": 4}, 10, "the replacement to register")
        assert new.heartbeat(5).ok and not new.evicted and lh.members() == {"0": 4}
    finally:
        for c in clients:
            c.close()
        lh.stop()
