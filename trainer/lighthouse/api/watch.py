"""The watch sockets at scale: the heartbeat period the lighthouse asks its groups for, the socket itself (aiohttp's
handshake, then ftjob.lighthouse.api.frames reads its frames synchronously), and writing one frame to thousands of
sockets without a task per socket.

Heartbeat pace: every rank 0 beats on its watch socket; at 12,500 groups the client's default 0.1 s would be 125,000
frames/s, several times what one Python lighthouse core receives. The lighthouse therefore tells the groups (in the
hello frame, and again when it changes) to beat every ``interval(groups)``: MIN_INTERVAL_S for a small job (the
client's own default), doubled while the total rate would exceed HEARTBEATS_PER_S, but never longer than a
1/TIMEOUT_BEATS of the heartbeat timeout (liveness first: a group is still heard TIMEOUT_BEATS times per timeout).
Powers of two and a hysteresis keep pushes (O(groups) each) rare while groups come and go.

aiohttp has no public API for handing a WebSocket's incoming bytes to another parser, so ``WatchWebSocket`` overrides
its private ``_post_start`` and sets the private state the rest of ``WebSocketResponse`` reads. pyproject.toml pins
aiohttp to the tested minor and tests/trainer/test_aiohttp_hooks.py fails when one of these hooks changes shape.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any

from aiohttp import WSCloseCode, WSMessage, web
from aiohttp.http_websocket import WebSocketWriter
from aiohttp.web_request import BaseRequest
from ftjob.lighthouse.api.frames import OP_TEXT, FrameReader, frame

log = logging.getLogger("ftjob.lighthouse")
MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # one incoming message (aiohttp's default; a 64k-rank quorum request fits)
# A reader this far behind (bytes queued in the lighthouse for it) is hung up: it reconnects, and a stuck one cannot
# grow the lighthouse's memory with every push.
SLOW_READER_BYTES = 4 * 1024 * 1024

# LighthouseClient's default: a job of up to HEARTBEATS_PER_S / 10 groups beats at the pace the client asks for itself
MIN_INTERVAL_S = 0.1
# The total rank-0 heartbeat rate a lighthouse asks for: every heartbeat frame costs the lighthouse's single core
# (aiohttp's frame handling is most of it), so the rate is capped well below what the core could take, leaving most of
# it to the quorum rounds, which must meet their deadlines (hack/bench/bench_controlplane.py measures the cost).
HEARTBEATS_PER_S = 10_000
# heartbeats per heartbeat timeout, at least: three lost or late in a row never drop a group (and every quorum
# request, once per step, refreshes a group's liveness too)
TIMEOUT_BEATS = 4


class HeartbeatPace:
    """The heartbeat interval for a number of live groups (see the module doc)."""

    def __init__(self, timeout_s: float, per_s: float = HEARTBEATS_PER_S, floor_s: float = MIN_INTERVAL_S) -> None:
        self.per_s, self.floor_s = per_s, floor_s
        self.cap_s = max(floor_s, timeout_s / TIMEOUT_BEATS)
        self._current = floor_s

    def interval(self, groups: int) -> float:
        """The heartbeat period to ask of each of ``groups`` live groups (remembers the last, for the hysteresis)."""
        need = groups / self.per_s  # the shortest interval that keeps the total rate within per_s
        step = self._current
        while step < need:
            step *= 2
        while step > self.floor_s and need < step * 0.4:  # shrink only well below: no flapping at a boundary
            step /= 2
        self._current = max(self.floor_s, step)
        return min(self._current, self.cap_s)


class WatchWebSocket(web.WebSocketResponse):
    """aiohttp's handshake and frame writer; incoming frames go to a FrameReader that calls ``on_text`` for each text
    message as the bytes arrive (no receive loop). ``ended`` resolves when the connection is over."""

    def __init__(self, on_text: Callable[[str], None], max_size: int = MAX_MESSAGE_BYTES) -> None:
        super().__init__(heartbeat=None, compress=False, max_msg_size=max_size)
        self._on_text, self._max_size = on_text, max_size
        self.frames: FrameReader | None = None
        self._transport: asyncio.Transport | Any = None
        self.ended: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def _post_start(self, request: BaseRequest, protocol: str | None, writer: WebSocketWriter) -> None:
        """Instead of aiohttp's reader and message queue (WebSocketResponse._post_start), our FrameReader.

        A private aiohttp hook (no public API swaps the parser): ``prepare()`` calls it after the handshake; it sets
        the private fields aiohttp's own ``_post_start`` sets and installs the FrameReader in the connection's
        payload-parser slot, which calls ``feed_data``/``feed_eof`` as aiohttp's WebSocketReader would be called.
        """
        self._ws_protocol, self._writer = protocol, writer
        transport = request.protocol.transport
        assert transport is not None  # _pre_start checked it
        self._transport = transport
        self.frames = FrameReader(self._on_text, transport.write, transport.close, self._on_ended, self._max_size)
        request.protocol.set_parser(self.frames)  # type: ignore[arg-type]  # aiohttp's payload-parser interface
        request.protocol.keep_alive(False)

    def _on_ended(self, code: int, _why: str) -> None:
        # aiohttp's private close state, so that ``closed`` and ``close_code`` answer as for any of its sockets
        self._set_closed()  # send_now skips it from now on
        self._close_code = code
        if not self.ended.done():
            self.ended.set_result(None)

    def send_text(self, payload: bytes, framed: bytes | None = None) -> None:
        """Writes one text frame now (``framed``: the payload's frame, built once for many sockets); a closed socket:
        nothing; a reader too far behind: hung up instead."""
        if self._closed:
            return
        if self._transport.get_write_buffer_size() > SLOW_READER_BYTES:
            self.hang_up(WSCloseCode.TRY_AGAIN_LATER, "reader too slow: reconnect")
            return
        self._transport.write(framed if framed is not None else frame(OP_TEXT, payload))

    def hang_up(self, code: int, why: str) -> None:
        """Sends a close frame with ``code`` and closes the connection now (no wait for the peer's reply)."""
        if self.frames is not None:
            self.frames.close(code, why)

    async def close(self, *, code: int = WSCloseCode.OK, message: bytes = b"", drain: bool = True) -> bool:
        """Hangs up now with ``code``; False when already closed (aiohttp's reader, which close() waits on, is not
        there)."""
        if self.frames is None or self.frames.closed:
            return False
        self.hang_up(code, message.decode(errors="replace"))
        return True

    async def receive(self, timeout: float | None = None) -> WSMessage:
        """Never used: the frames go to the FrameReader as they arrive."""
        raise RuntimeError("the watch socket's frames go to its FrameReader, not receive()")


def push(sockets: Iterable[WatchWebSocket], payload: bytes) -> int:
    """One text frame to many sockets, framed once and written to each now (no task each); returns how many."""
    framed, n = frame(OP_TEXT, payload), 0
    for ws in sockets:
        n += 1
        ws.send_text(payload, framed)
    return n


def send_now(ws: WatchWebSocket, payload: bytes) -> None:
    """Writes a text frame to one watch socket now (skipped when closed; a reader too far behind is hung up)."""
    ws.send_text(payload)
