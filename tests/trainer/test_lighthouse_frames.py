"""The watch socket's lean frame reader (ftjob.lighthouse.api.frames): every frame a client may send, split anywhere,
and every frame it must not send (refused with the RFC 6455 close code, the lighthouse unharmed); then the same on a
real lighthouse socket."""

from __future__ import annotations

import asyncio
import json
import random
import struct
from pathlib import Path

import aiohttp
import pytest
from ftjob import contract
from ftjob.contract.lighthouse_api import AbortSignal, WatchQuorumAnswer
from ftjob.lighthouse.api.frames import FrameReader, unmask

from tests.support.local_job import TOKEN, Lighthouse


def client_frame(opcode: int, payload: bytes, fin: bool = True, mask: bytes = b"\x11\x22\x33\x44",
                 rsv: int = 0, masked: bool = True) -> bytes:  # fmt: skip
    """A frame as a client sends it (masked)."""
    n = len(payload)
    b0 = (0x80 if fin else 0) | rsv | opcode
    bit = 0x80 if masked else 0
    if n < 126:
        head = bytes((b0, bit | n))
    elif n < 1 << 16:
        head = bytes((b0, bit | 126)) + struct.pack("!H", n)
    else:
        head = bytes((b0, bit | 127)) + struct.pack("!Q", n)
    if not masked:
        return head + payload
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


class Sink:
    def __init__(self, max_size: int = 1 << 20) -> None:
        self.texts: list[str] = []
        self.written: list[bytes] = []
        self.hung_up = 0
        self.closed: list[tuple[int, str]] = []
        self.reader = FrameReader(self.texts.append, self.written.append, self.hang_up, self.on_closed, max_size)

    def hang_up(self) -> None:
        self.hung_up += 1

    def on_closed(self, code: int, why: str) -> None:
        self.closed.append((code, why))

    def feed(self, data: bytes, chunk: int | None = None) -> None:
        step = chunk or len(data) or 1
        for i in range(0, len(data), step):
            assert self.reader.feed_data(data[i : i + step]) == (False, b"")

    def close_code_sent(self) -> int:
        last = self.written[-1]
        assert last[0] == 0x88  # a final close frame
        return struct.unpack("!H", last[2:4])[0]


def test_unmask_matches_the_bytewise_xor():
    rng = random.Random(1)
    for n in (0, 1, 3, 4, 5, 125, 126, 70_000):
        payload, mask = rng.randbytes(n), rng.randbytes(4)
        assert unmask(mask, payload) == bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


@pytest.mark.parametrize("chunk", [None, 1, 2, 3, 7, 130])
def test_messages_of_every_length_arrive_whole_however_the_bytes_are_split(chunk: int | None):
    sink = Sink()
    texts = ['{"step":1}', "é" * 100, "x" * 300, "y" * 70_000, ""]
    sink.feed(b"".join(client_frame(0x1, t.encode()) for t in texts), chunk)
    assert sink.texts == texts and not sink.closed and not sink.written


def test_fragments_join_and_control_frames_between_them_are_answered():
    sink = Sink()
    data = (client_frame(0x1, b'{"st', fin=False) + client_frame(0x9, b"hi") + client_frame(0x0, b'ep":', fin=False)
            + client_frame(0xA, b"") + client_frame(0x0, b"2}"))  # fmt: skip
    sink.feed(data, 5)
    assert sink.texts == ['{"step":2}']
    assert sink.written == [b"\x8a\x02hi"]  # the pong echoes the ping's payload, unmasked


def test_binary_messages_are_skipped():
    sink = Sink()
    sink.feed(client_frame(0x2, b"\x00\xff") + client_frame(0x2, b"a", fin=False) + client_frame(0x0, b"b")
              + client_frame(0x1, b"ok"))  # fmt: skip
    assert sink.texts == ["ok"] and not sink.closed


def test_the_peers_close_is_echoed_once_and_nothing_after_it_is_read():
    sink = Sink()
    sink.feed(client_frame(0x8, struct.pack("!H", 4321) + b"bye") + client_frame(0x1, b"late"))
    assert sink.closed == [(4321, "bye")] and sink.hung_up == 1 and sink.close_code_sent() == 4321
    assert sink.texts == []
    sink.reader.feed_eof()  # the connection then ends: no second report
    assert len(sink.closed) == 1


def test_an_empty_close_is_a_normal_close():
    sink = Sink()
    sink.feed(client_frame(0x8, b""))
    assert sink.closed == [(1000, "")] and sink.close_code_sent() == 1000


def test_end_of_stream_reports_the_connection_lost():
    sink = Sink()
    sink.feed(client_frame(0x1, b"half")[:4])
    sink.reader.feed_eof()
    assert sink.closed == [(1006, "connection lost")] and sink.texts == [] and sink.hung_up == 0


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (client_frame(0x1, b"x", masked=False), 1002),  # clients must mask
        (client_frame(0x1, b"x", rsv=0x40), 1002),  # RSV1 without a negotiated extension
        (client_frame(0x3, b"x"), 1002),  # reserved data opcode
        (client_frame(0xB, b""), 1002),  # reserved control opcode
        (client_frame(0x9, b"p" * 126), 1002),  # control frame over 125 bytes
        (client_frame(0x9, b"p", fin=False), 1002),  # fragmented control frame
        (client_frame(0x0, b"x"), 1002),  # a continuation with nothing to continue
        (client_frame(0x1, b"a", fin=False) + client_frame(0x1, b"b"), 1002),  # a new message inside one
        (client_frame(0x8, b"\x03"), 1002),  # a 1-byte close payload
        (client_frame(0x1, b"\xff\xfe"), 1007),  # text that is not UTF-8
        (client_frame(0x8, struct.pack("!H", 1000) + b"\xff"), 1007),  # a close reason that is not UTF-8
        (client_frame(0x1, b"z" * 2000), 1009),  # over max_size
        (client_frame(0x1, b"z" * 600, fin=False) + client_frame(0x0, b"z" * 600), 1009),  # over it in fragments
    ],
)
def test_what_a_client_must_not_send_is_refused_with_its_close_code(data: bytes, code: int):
    sink = Sink(max_size=1024)
    sink.feed(data + client_frame(0x1, b"after"))
    assert sink.texts == [] and sink.closed and sink.closed[0][0] == code and sink.close_code_sent() == code
    assert sink.hung_up == 1 and sink.reader.closed


def test_an_oversized_frame_is_refused_from_its_header_without_buffering_the_payload():
    sink = Sink(max_size=1024)
    sink.feed(b"\x81\xff" + struct.pack("!Q", 1 << 40) + b"\x00\x00\x00\x00")
    assert sink.close_code_sent() == 1009 and sink.reader.closed


def test_random_garbage_never_raises_and_never_delivers_after_a_close():
    rng = random.Random(11)
    for _ in range(2000):
        sink = Sink(max_size=4096)
        valid = client_frame(0x1, b'{"step":1}')
        garbage = rng.randbytes(rng.randrange(1, 64))
        sink.feed(valid + garbage + valid, rng.randrange(1, 9))
        assert sink.texts[0] == '{"step":1}'
        if sink.closed:
            assert sink.hung_up <= 1 and len(sink.closed) == 1
            assert sink.written[-1][0] == 0x88


# --- on a real lighthouse --------------------------------------------------------------------------------------------
async def _raw_socket_session(url: str) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession(headers=headers) as session:
        watch = url + contract.PATH_WATCH
        healthy = await session.ws_connect(watch, params={"group": "0", "incarnation": "a", "rank": "0"},
                                           autoping=False)  # fmt: skip
        AbortSignal.model_validate_json(await healthy.receive_str(timeout=10))
        bad = await session.ws_connect(watch, params={"group": "1", "incarnation": "b", "rank": "0"})
        await bad.receive_str(timeout=10)
        # a fragmented heartbeat is one heartbeat; then a frame no client sends (unmasked) closes that socket
        transport = bad._response.connection.transport  # type: ignore[union-attr]
        assert transport is not None
        transport.write(client_frame(0x1, b'{"step":', fin=False) + client_frame(0x0, b"3}"))
        transport.write(client_frame(0x1, b'{"step":4}', masked=False))
        msg = await bad.receive(timeout=10)
        assert msg.type == aiohttp.WSMsgType.CLOSE and msg.data == 1002, msg
        # the healthy socket is unharmed: its ping is answered with its payload
        await healthy.ping(b"are you there")
        msg = await healthy.receive(timeout=10)
        assert msg.type == aiohttp.WSMsgType.PONG and msg.data == b"are you there", msg
        await healthy.send_str('{"step":"x"}')  # a bad heartbeat: 4400 naming the field
        msg = await healthy.receive(timeout=10)
        assert msg.type == aiohttp.WSMsgType.CLOSE and msg.data == 4400 and "step" in msg.extra, msg


def test_a_real_watch_socket_answers_pings_joins_fragments_and_refuses_bad_frames(tmp_path: Path):
    lh = Lighthouse(tmp_path, "--min-replicas", "1", "--heartbeat-timeout", "30").start()
    try:
        asyncio.run(_raw_socket_session(lh.url))
        assert lh.request("GET", contract.PATH_HEALTH)[0] == 200  # still serving
    finally:
        lh.kill()


async def _expiry_session(url: str) -> None:
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as session:
        ws = await session.ws_connect(url + contract.PATH_WATCH, params={"group": "0", "incarnation": "a"})
        await ws.receive_str(timeout=10)
        for timeout_s in (0.3, 0.2):  # the second expires too: the ticker keeps expiring after the first one
            body = {"group": "0", "incarnation": "a", "step": 0, "quorum_id": -1, "address": "127.0.0.1:1",
                    "store_address": "127.0.0.1:2", "timeout_s": timeout_s}  # fmt: skip
            await ws.send_str(json.dumps({"kind": "quorum", "request": body}))
            answer = WatchQuorumAnswer.model_validate_json(await ws.receive_str(timeout=10))
            assert answer.status == 504 and "min_replicas" in (answer.error or ""), answer
        assert not ws.closed
        await ws.close()


def test_a_watch_socket_request_past_its_timeout_is_answered_504(tmp_path: Path):
    lh = Lighthouse(tmp_path, "--min-replicas", "2", "--heartbeat-timeout", "30").start()
    try:
        asyncio.run(_expiry_session(lh.url))
    finally:
        lh.kill()
