"""The watch socket's link ping follows the heartbeat pace the lighthouse pushes (trainer/ft/watch_link.py): a
lighthouse that paces its many groups slower must not see them drop their sockets on a pong late by a second."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator

import pytest
from aiohttp import web
from ftjob import contract
from ftjob.contract.lighthouse_api import AbortSignal
from ftjob.ft.lighthouse_client import LighthouseClient
from ftjob.ft.watch_link import LINK_PING_S, LINK_PONG_S, link_timing
from ftjob.lighthouse.watch import TIMEOUT_BEATS, HeartbeatPace


class FakeWatch:
    """A watch endpoint that sends the hello frame with the given pace, and pushes another pace on demand."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self.loop = asyncio.new_event_loop()
        self.sockets: list[web.WebSocketResponse] = []
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
        async for _ in ws:  # heartbeats: ignored
            pass
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


def wait_for(what: object, predicate: object, deadline_s: float = 10.0) -> None:
    deadline = time.monotonic() + deadline_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not within {deadline_s}s: {what}"
        time.sleep(0.01)


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
        wait_for("the hello's pace", lambda: client._ws is not None and client._ws.timing == slow)
        assert client.link_timing == slow
        busy_lighthouse.push(0.1)  # the groups left: back to the fast pace, a lost lighthouse noticed within 3 s
        wait_for("the fast pace", lambda: client._ws is not None and client._ws.timing == (LINK_PING_S, LINK_PONG_S))
        busy_lighthouse.push(0.8)
        wait_for("a slower pace again", lambda: client._ws is not None and client._ws.timing == link_timing(0.8))
        assert client.reconnects == 0  # the pace changed on the open socket
    finally:
        client.close()
