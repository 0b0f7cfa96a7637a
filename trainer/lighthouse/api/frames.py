"""A lean reader for the watch socket's incoming WebSocket frames (RFC 6455), fed the transport's bytes directly.

aiohttp's own reader queues every message and wakes the socket's handler task for it: at 12,500 groups that task
switch, the queue and ``receive()`` cost most of the lighthouse's core per heartbeat. After aiohttp's handshake this
reader takes the connection's data instead (aiohttp's payload-parser slot: ``feed_data``/``feed_eof``) and hands each
complete text message to a callback synchronously -- no task, future or queue per frame. It answers pings itself,
echoes a close, skips binary messages and refuses what a client must not send (an unmasked frame, reserved bits or
opcodes, a fragmented or oversized control frame, a message over ``max_size``, invalid UTF-8) with a close frame
carrying the RFC's code, then closes the transport. Compression is never negotiated on this socket (no RSV1).
"""

from __future__ import annotations

import struct
from collections.abc import Callable

CLOSE_NORMAL = 1000
CLOSE_PROTOCOL_ERROR = 1002
CLOSE_INVALID_DATA = 1007
CLOSE_TOO_BIG = 1009
OP_CONTINUATION, OP_TEXT, OP_BINARY, OP_CLOSE, OP_PING, OP_PONG = 0x0, 0x1, 0x2, 0x8, 0x9, 0xA
_U16 = struct.Struct("!H")
_U64 = struct.Struct("!Q")


def frame(opcode: int, payload: bytes = b"") -> bytes:
    """An unmasked, final server frame."""
    n = len(payload)
    if n < 126:
        head = bytes((0x80 | opcode, n))
    elif n < 1 << 16:
        head = bytes((0x80 | opcode, 126)) + _U16.pack(n)
    else:
        head = bytes((0x80 | opcode, 127)) + _U64.pack(n)
    return head + payload


def close_frame(code: int, reason: bytes = b"") -> bytes:
    return frame(OP_CLOSE, _U16.pack(code) + reason[:123])


def unmask(mask: bytes, payload: bytes) -> bytes:
    """XOR with the 4-byte key, as one big-int operation (no per-byte Python loop)."""
    n = len(payload)
    if n == 0:
        return payload
    key = (mask * (n // 4 + 1))[:n]
    return (int.from_bytes(payload, "little") ^ int.from_bytes(key, "little")).to_bytes(n, "little")


class FrameReader:
    """Parses a client's frames from ``feed_data`` chunks; ``on_text`` gets each complete text message, ``write``
    sends the replies (pong, close), ``on_closed(code, why)`` runs once when the connection ends for any reason
    (the peer's close, a protocol error, end of stream, ``close()``)."""

    def __init__(
        self,
        on_text: Callable[[str], None],
        write: Callable[[bytes], None],
        hang_up: Callable[[], None],
        on_closed: Callable[[int, str], None],
        max_size: int = 4 * 1024 * 1024,
    ) -> None:
        self._on_text, self._write, self._hang_up, self._on_closed = on_text, write, hang_up, on_closed
        self.max_size = max_size
        self._buf = b""
        self._parts: list[bytes] | None = None  # a fragmented message's payloads so far
        self._parts_op = OP_TEXT
        self._parts_size = 0
        self.closed = False
        self.close_code: int | None = None

    # --- aiohttp's payload-parser interface ----------------------------------------------------------------------
    def feed_data(self, data: bytes) -> tuple[bool, bytes]:
        if self.closed:
            return False, b""
        buf = self._buf + data if self._buf else data
        pos, end = 0, len(buf)
        while not self.closed and end - pos >= 2:
            b0, b1 = buf[pos], buf[pos + 1]
            if b1 & 0x80 == 0:
                self.close(CLOSE_PROTOCOL_ERROR, "unmasked client frame")
                break
            if b0 & 0x70:
                self.close(CLOSE_PROTOCOL_ERROR, "reserved bits set (no extension was negotiated)")
                break
            length, head = b1 & 0x7F, pos + 2
            if length == 126:
                if end - head < 2:
                    break
                length, head = _U16.unpack_from(buf, head)[0], head + 2
            elif length == 127:
                if end - head < 8:
                    break
                length, head = _U64.unpack_from(buf, head)[0], head + 8
            opcode, fin = b0 & 0x0F, b0 & 0x80
            if opcode >= 0x8 and (length > 125 or not fin):
                self.close(CLOSE_PROTOCOL_ERROR, "control frame fragmented or longer than 125 bytes")
                break
            if length > self.max_size or self._parts_size + length > self.max_size:
                self.close(CLOSE_TOO_BIG, f"message larger than {self.max_size} bytes")
                break
            if end - head < 4 + length:
                break  # the rest of this frame is still to come
            mask = buf[head : head + 4]
            payload = unmask(mask, buf[head + 4 : head + 4 + length])
            pos = head + 4 + length
            self._frame(opcode, bool(fin), payload)
        self._buf = b"" if self.closed else buf[pos:]
        return False, b""

    def feed_eof(self) -> None:
        """The connection was lost (aiohttp's protocol calls this on connection_lost)."""
        self._closed(1006, "connection lost")

    # --- frames --------------------------------------------------------------------------------------------------
    def _frame(self, opcode: int, fin: bool, payload: bytes) -> None:
        if opcode in (OP_TEXT, OP_BINARY):
            if self._parts is not None:
                self.close(CLOSE_PROTOCOL_ERROR, "new message inside a fragmented one")
            elif fin:
                self._message(opcode, payload)
            else:
                self._parts, self._parts_op, self._parts_size = [payload], opcode, len(payload)
        elif opcode == OP_CONTINUATION:
            if self._parts is None:
                self.close(CLOSE_PROTOCOL_ERROR, "continuation frame without a message to continue")
                return
            self._parts.append(payload)
            self._parts_size += len(payload)
            if fin:
                parts, self._parts, self._parts_size = self._parts, None, 0
                self._message(self._parts_op, b"".join(parts))
        elif opcode == OP_PING:
            self._write(frame(OP_PONG, payload))
        elif opcode == OP_PONG:
            pass
        elif opcode == OP_CLOSE:
            self._peer_close(payload)
        else:
            self.close(CLOSE_PROTOCOL_ERROR, f"reserved opcode {opcode:#x}")

    def _message(self, opcode: int, payload: bytes) -> None:
        if opcode != OP_TEXT:
            return  # the watch protocol has no binary messages: skipped, never an error
        try:
            text = payload.decode()
        except UnicodeDecodeError:
            self.close(CLOSE_INVALID_DATA, "text message is not valid UTF-8")
            return
        self._on_text(text)

    def _peer_close(self, payload: bytes) -> None:
        if len(payload) == 1:
            self.close(CLOSE_PROTOCOL_ERROR, "close frame with a 1-byte payload")
            return
        code = _U16.unpack_from(payload)[0] if payload else CLOSE_NORMAL
        try:
            reason = payload[2:].decode()
        except UnicodeDecodeError:
            self.close(CLOSE_INVALID_DATA, "close reason is not valid UTF-8")
            return
        self.close(code if payload else CLOSE_NORMAL, reason, echo=True)

    def close(self, code: int, why: str = "", echo: bool = False) -> None:
        """Sends a close frame (``echo``: the peer's own code back, its reason kept for ``on_closed``) and hangs up."""
        if self.closed:
            return
        self._write(close_frame(code if not echo or 1000 <= code < 5000 else CLOSE_PROTOCOL_ERROR,
                                b"" if echo else why.encode()))  # fmt: skip
        self._closed(code, why)
        self._hang_up()

    def _closed(self, code: int, why: str) -> None:
        if self.closed:
            return
        self.closed, self.close_code, self._buf, self._parts = True, code, b"", None
        self._on_closed(code, why)
