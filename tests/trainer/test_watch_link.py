"""The watch socket's link ping follows the heartbeat pace the lighthouse pushes (trainer/ft/links/watch_link.py): a
lighthouse that paces its many groups slower must not see them drop their sockets on a pong late by a second. And the
heartbeats themselves: one after every interval the group told the lighthouse nothing (a quorum request counts)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest
from aiohttp import web
from ftjob import contract
from ftjob.contract.lighthouse_api import AbortSignal, QuorumRequest, QuorumResponse, WatchQuorum, WatchQuorumAnswer
from ftjob.ft.links.lighthouse_client import LighthouseClient
from ftjob.ft.links.watch_link import LINK_PING_S, LINK_PONG_S, link_timing
from ftjob.lighthouse.api.watch import TIMEOUT_BEATS, HeartbeatPace

from tests.support.polling import wait_for

ANSWER = QuorumResponse(quorum_id=1, max_step=0, replica_rank=0, replica_world_size=1, contributing=True,
                        contributor_rank=0, num_contributors=1, heal=False, store_address="127.0.0.1:2",
                        store_addresses=["127.0.0.1:2"], store_prefix="q1", abort_below=0)  # fmt: skip


class FakeWatch:
    """A watch endpoint that sends the hello frame with the given pace, and pushes another pace on demand."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.loop = asyncio.new_event_loop()
        self.sockets: list[web.WebSocketResponse] = []
        self.frames: list[str] = []  # "beat" or "quorum", in the order they arrived
        self.asked_progress: list[int] = []  # the progress each quorum request carried
        self.port = 0
        self._runner: web.AppRunner | None = None
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get(contract.PATH_WATCH, self._watch)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def _watch(self, request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        self.sockets.append(ws)
        await ws.send_str(self._signal(self.interval_s))
        async for msg in ws:
            if '"kind":"quorum"' not in msg.data:
                self.frames.append("beat")
                continue
            self.frames.append("quorum")  # answered at once: a one-group quorum
            self.asked_progress.append(WatchQuorum.model_validate_json(msg.data).request.progress)
            await ws.send_str(WatchQuorumAnswer(status=200, quorum=ANSWER).model_dump_json())
        return ws

    @staticmethod
    def _signal(interval_s: float) -> str:
        return AbortSignal(quorum_id=0, abort_below=0, heartbeat_interval_s=interval_s).model_dump_json()

    def push(self, interval_s: float) -> None:
        self.interval_s = interval_s
        for ws in self.sockets:
            asyncio.run_coroutine_threadsafe(ws.send_str(self._signal(interval_s)), self.loop).result(5)

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


@pytest.fixture
def busy_lighthouse() -> Iterator[FakeWatch]:
    lh = FakeWatch(interval_s=1.6)  # what HeartbeatPace tells 12,500 groups with a 60 s heartbeat timeout
    yield lh
    lh.stop()


def test_link_timing_is_the_old_one_at_the_fastest_pace_and_never_tighter_than_the_heartbeat_budget():
    assert link_timing(0.1) == (LINK_PING_S, LINK_PONG_S)  # a small job: a vanished lighthouse is noticed within 3 s
    for groups in (8, 2_000, 12_500, 100_000):
        for timeout_s in (5.0, 60.0):
            interval = HeartbeatPace(timeout_s).interval(groups)
            ping_s, pong_s = link_timing(interval)
            assert ping_s >= 3 * interval  # no ping more often than every few heartbeat periods
            assert pong_s >= TIMEOUT_BEATS * interval  # a late pong is forgiven as long as a late heartbeat is


def test_the_open_watch_socket_follows_the_pushed_pace(busy_lighthouse: FakeWatch):
    client = LighthouseClient(f"http://127.0.0.1:{busy_lighthouse.port}", "t", "0", "inc-0").start()
    try:
        assert client.watch_connected.wait(10)
        slow = link_timing(1.6)
        assert slow[1] >= TIMEOUT_BEATS * 1.6
        # the hello frame's pace reaches the live socket's ping period and pong allowance (aiohttp's own timers)
        wait_for(lambda: client.open_socket_timing == slow, 10, "the hello's pace", interval=0.01)
        assert client.link_timing == slow
        busy_lighthouse.push(0.1)  # the groups left: back to the fast pace, a lost lighthouse noticed within 3 s
        wait_for(lambda: client.open_socket_timing == (LINK_PING_S, LINK_PONG_S), 10, "the fast pace", interval=0.01)
        busy_lighthouse.push(0.8)
        wait_for(lambda: client.open_socket_timing == link_timing(0.8), 10, "a slower pace again", interval=0.01)
        assert client.reconnects == 0  # the pace changed on the open socket
    finally:
        client.close()


def test_a_quorum_request_counts_as_a_heartbeat(busy_lighthouse: FakeWatch):
    """At scale a step is shorter than the pace (1.6 s here): a group asking every step sends no heartbeat between
    its requests (the lighthouse reads half the frames per round), and beats again once it stops asking."""
    client = LighthouseClient(f"http://127.0.0.1:{busy_lighthouse.port}", "t", "0", "inc-0").start()
    try:
        wait_for(lambda: client.open_socket_timing == link_timing(1.6), 10, "the hello's pace", interval=0.01)
        req = QuorumRequest(group="0", incarnation="inc-0", step=0, quorum_id=0, address="127.0.0.1:1",
                            store_address="127.0.0.1:2")  # fmt: skip
        for step in range(60):  # back-to-back steps for about two heartbeat periods
            client.progress = 2 * step + 1  # the training thread's protocol points
            client.quorum(req.model_copy(update={"step": step}), timeout_s=10)
            time.sleep(0.05)  # the step's work
        assert busy_lighthouse.asked_progress == [2 * step + 1 for step in range(60)], (
            "standing in for the heartbeats, each request carries the group's progress (the stall rule's news)"
        )
        frames = busy_lighthouse.frames
        asking = frames[frames.index("quorum") : len(frames) - frames[::-1].index("quorum")]
        assert asking.count("quorum") == 60
        assert "beat" not in asking, f"heartbeats between quorum requests 50 ms apart: {asking.count('beat')}"
        beats = frames.count("beat")
        wait_for(
            lambda: busy_lighthouse.frames.count("beat") > beats,
            10,
            "a heartbeat once the group stops asking",
            interval=0.01,
        )
    finally:
        client.close()
