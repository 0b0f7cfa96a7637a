"""The watch socket as a link, below what it carries (heartbeats up, abort signals down): how often it is pinged and
how late a pong may come, paced by the lighthouse, and the quorum requests that ride on it.

Link ping: a silent socket is pinged every ``ping_s`` and dropped when no pong (nor any frame) comes within ``pong_s``;
the client then abandons what waits on it and reconnects. At the fastest heartbeat pace (0.1 s, a small job) that is
LINK_PING_S / LINK_PONG_S: a vanished lighthouse is noticed within 3 s. A lighthouse with many groups paces them
slower (AbortSignal.heartbeat_interval_s, trainer/lighthouse/api/watch.py) because it is busy; the link then follows the
pace -- pinged no more often than every PING_BEATS periods, its pong allowed PONG_BEATS periods, the heartbeat
timeout's own budget (the lighthouse caps the period at a quarter of that timeout) -- so a briefly busy lighthouse
never sees thousands of groups give up their sockets at once on a late pong, sooner than it would drop them itself.
"""

from __future__ import annotations

import asyncio
import collections
import logging

import aiohttp
from ftjob.contract.lighthouse_api import QuorumRequest, QuorumResponse, WatchQuorum, WatchQuorumAnswer
from ftjob.ft.links.lighthouse_errors import EvictedError, LighthouseError, LighthouseLost
from pydantic import ValidationError

log = logging.getLogger("ftjob.lighthouse_client")

LINK_PING_S = 2.0  # the watch socket's ping period at the fastest pace
LINK_PONG_S = 1.0  # how late its pong may come at the fastest pace (GIL, load)
PING_BEATS = 3  # never ping more often than every 3 heartbeat periods
PONG_BEATS = 4  # nor allow the pong less than 4 periods: the lighthouse's TIMEOUT_BEATS, its heartbeat timeout budget


def link_timing(heartbeat_interval_s: float) -> tuple[float, float]:
    """(ping period, pong allowance) of the watch socket for the heartbeat period the lighthouse asks for."""
    return max(LINK_PING_S, PING_BEATS * heartbeat_interval_s), max(LINK_PONG_S, PONG_BEATS * heartbeat_interval_s)


class PacedWebSocket(aiohttp.ClientWebSocketResponse):
    """aiohttp's client socket whose ping period and pong allowance can change while it is open (aiohttp ties the
    allowance to half the period, fixed at connect).

    aiohttp has no public API for either, so this writes its private ``_heartbeat`` / ``_pong_heartbeat`` and
    reschedules with ``_reset_heartbeat()``; pyproject.toml pins aiohttp to the tested minor and
    tests/trainer/test_aiohttp_hooks.py fails when these fields or that method change shape."""

    def pace(self, ping_s: float, pong_s: float) -> None:
        """Pings every ``ping_s`` from now on and drops the socket when a pong is ``pong_s`` late."""
        if (self._heartbeat, getattr(self, "_pong_heartbeat", None)) == (ping_s, pong_s):
            return
        self._heartbeat, self._pong_heartbeat = ping_s, pong_s
        self._reset_heartbeat()  # called on a frame just received: the peer is alive, the next ping is ping_s away

    @property
    def timing(self) -> tuple[float | None, float | None]:
        """(ping period, pong allowance) in force."""
        return self._heartbeat, getattr(self, "_pong_heartbeat", None)


class WatchQuorums:
    """Quorum long-polls sent as WatchQuorum frames on the open watch socket. The lighthouse answers every frame
    exactly once and in order (a superseded request first, with 409), so answers are matched first in, first out; a
    socket that drops fails every request on it (LighthouseLost: retried on the new socket)."""

    def __init__(self) -> None:
        self._asked: collections.deque[asyncio.Future[WatchQuorumAnswer]] = collections.deque()

    async def ask(self, ws: aiohttp.ClientWebSocketResponse, req: QuorumRequest, timeout_s: float,
                  lost: asyncio.Future[None] | None) -> QuorumResponse:  # fmt: skip
        """``lost`` (abandon() or a dropped socket resolves it) ends the wait with LighthouseLost."""
        answer: asyncio.Future[WatchQuorumAnswer] = asyncio.get_running_loop().create_future()
        self._asked.append(answer)
        await ws.send_str(WatchQuorum(kind="quorum", request=req).model_dump_json(exclude_none=True))
        waits = {answer} if lost is None else {answer, lost}
        done, _ = await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        if answer not in done:
            raise LighthouseLost("the lighthouse's watch socket dropped while waiting") if done else TimeoutError(
                f"no quorum answer on the watch socket within {timeout_s:.0f}s")  # fmt: skip
        got = answer.result()
        if got.status == 200 and got.quorum is not None:
            return got.quorum
        cls = EvictedError if got.status == 410 else LighthouseError
        raise cls(got.status, got.error or f"status {got.status}")

    def answered(self, data: str) -> None:
        """A quorum answer frame arrived: it resolves the oldest request still waiting."""
        if not self._asked:
            log.warning("an unexpected quorum answer on the watch socket: %s", data[:200])
            return
        fut = self._asked.popleft()
        if not fut.done():
            try:
                fut.set_result(WatchQuorumAnswer.model_validate_json(data))
            except ValidationError as e:
                fut.set_exception(LighthouseError(0, f"unreadable quorum answer: {e}"))

    def fail_all(self) -> None:
        """The watch socket closed: its pending quorum requests will never be answered."""
        while self._asked:
            fut = self._asked.popleft()
            if not fut.done():
                fut.set_exception(LighthouseLost("the lighthouse's watch socket dropped while waiting"))
