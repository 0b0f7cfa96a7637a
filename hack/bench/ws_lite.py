"""A lean client WebSocket for the control-plane load generator (hack/bench/bench_controlplane.py).

The generators simulate thousands of rank-0 clients on one shared core; aiohttp's client socket costs each of them a
reader task, a queue and a task switch per frame, so at 12,500 groups the generators (not the lighthouse) bounded the
round and the abort latency (~0.7 s of their core per round). This one is an asyncio Protocol: the upgrade request
(RFC 6455 handshake, the job's bearer token), then every server frame parsed from the bytes as they arrive and handed
to a callback synchronously; text frames sent masked, as a client must (the same key-XOR the lighthouse undoes);
pings answered. Closing it is what a dead process does: the transport closes, no close handshake.
"""

from __future__ import annotations

import asyncio
import base64
import os
import struct
import time
from collections.abc import Callable
from urllib.parse import urlencode

from ftjob.lighthouse.api.frames import OP_CLOSE, OP_PING, OP_PONG, OP_TEXT, unmask

_U16 = struct.Struct("!H")
_U64 = struct.Struct("!Q")
SLOW_PEER_BYTES = 64 * 1024  # a heartbeat is skipped while this much waits to be written (a lighthouse behind)


def client_frame(opcode: int, payload: bytes) -> bytes:
    """A final, masked client frame."""
    n, mask = len(payload), os.urandom(4)
    if n < 126:
        head = bytes((0x80 | opcode, 0x80 | n))
    elif n < 1 << 16:
        head = bytes((0x80 | opcode, 0x80 | 126)) + _U16.pack(n)
    else:
        head = bytes((0x80 | opcode, 0x80 | 127)) + _U64.pack(n)
    return head + mask + unmask(mask, payload)


class LiteSocket(asyncio.Protocol):
    """One client watch socket; ``on_text`` gets each text message, ``opened`` resolves with the handshake's status
    once the server answered it, ``ended`` when the connection is gone, ``heard`` when it last received data
    (time.monotonic(): aiohttp's client pings only a socket silent for a whole ping period)."""

    def __init__(self, request: bytes, on_text: Callable[[str], None]) -> None:
        loop = asyncio.get_running_loop()
        self._request, self._on_text = request, on_text
        self.opened: asyncio.Future[int] = loop.create_future()
        self.ended: asyncio.Future[None] = loop.create_future()
        self._transport: asyncio.Transport | None = None
        self._buf = b""
        self.closed = False
        self.heard = time.monotonic()

    @classmethod
    async def connect(cls, host: str, port: int, path: str, query: dict[str, str], token: str,
                      on_text: Callable[[str], None], src: str | None = None) -> LiteSocket:  # fmt: skip
        key = base64.b64encode(os.urandom(16)).decode()
        request = (f"GET {path}?{urlencode(query)} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\n"
                   f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                   f"Authorization: Bearer {token}\r\n\r\n").encode()  # fmt: skip
        loop = asyncio.get_running_loop()
        local = (src, 0) if src else None
        _, sock = await loop.create_connection(lambda: cls(request, on_text), host, port, local_addr=local)
        status = await sock.opened
        if status != 101:
            sock.close()
            raise ConnectionError(f"watch socket refused: HTTP {status}")
        return sock

    # --- asyncio.Protocol --------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        transport.write(self._request)

    def data_received(self, data: bytes) -> None:
        self.heard = time.monotonic()
        buf = self._buf + data
        if not self.opened.done():
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self._buf = buf
                return
            self.opened.set_result(int(buf[9:12]))  # "HTTP/1.1 101 ..."
            buf = buf[end + 4 :]
        while len(buf) >= 2:
            opcode, n, head = buf[0] & 0x0F, buf[1] & 0x7F, 2
            if n == 126:
                if len(buf) < 4:
                    break
                n, head = _U16.unpack_from(buf, 2)[0], 4
            elif n == 127:
                if len(buf) < 10:
                    break
                n, head = _U64.unpack_from(buf, 2)[0], 10
            if len(buf) < head + n:
                break
            payload, buf = buf[head : head + n], buf[head + n :]
            if opcode == OP_TEXT:
                self._on_text(payload.decode())
            elif opcode == OP_PING:
                self.send(OP_PONG, payload)
            elif opcode == OP_CLOSE:
                self.close()
                return
        self._buf = buf

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.opened.done():
            self.opened.set_exception(ConnectionError(f"watch socket lost before its handshake: {exc}"))
        if not self.ended.done():
            self.ended.set_result(None)

    # --- sending -----------------------------------------------------------------------------------------------
    def send(self, opcode: int, payload: bytes, may_skip: bool = False) -> bool:
        """Writes one frame now; False when closed, or (``may_skip``: a heartbeat) when the peer is far behind."""
        if self.closed or self._transport is None:
            return False
        if may_skip and self._transport.get_write_buffer_size() >= SLOW_PEER_BYTES:
            return False
        self._transport.write(client_frame(opcode, payload))
        return True

    def send_text(self, text: str, may_skip: bool = False) -> bool:
        return self.send(OP_TEXT, text.encode(), may_skip)

    def ping(self) -> None:
        self.send(OP_PING, b"")

    def close(self) -> None:
        """The process dies: the connection closes without a close handshake."""
        self.closed = True
        if self._transport is not None:
            self._transport.close()
