"""The private aiohttp internals ftjob hooks into still have the shape our overrides assume.

No public aiohttp API does these jobs, so pyproject.toml pins aiohttp to the tested minor; these checks fail the
moment a new aiohttp renames, drops or re-signs one of the hooks, before a lighthouse or trainer misbehaves at run time:

- ``ftjob.lighthouse.api.watch.WatchWebSocket`` overrides ``WebSocketResponse._post_start`` and sets its private state
  (``_ws_protocol``, ``_writer``, ``_close_code``, ``_set_closed()``, ``_closed``), and swaps aiohttp's frame parser
  for ``FrameReader`` in the connection's payload-parser slot (``feed_data`` / ``feed_eof``).
- ``ftjob.ft.links.watch_link.PacedWebSocket`` rewrites ``ClientWebSocketResponse``'s ``_heartbeat`` and
  ``_pong_heartbeat`` and reschedules with ``_reset_heartbeat()``.
- ``ftjob.lighthouse.api.http_errors.JsonErrorRunner`` overrides ``AppRunner._make_server`` and builds the connection
  handler from ``Server._loop`` / ``Server._kwargs``.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any
from unittest import mock

import aiohttp
import pytest
from aiohttp import web
from aiohttp.http_websocket import WebSocketReader, WebSocketWriter
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from ftjob.ft.links.watch_link import PacedWebSocket
from ftjob.lighthouse.api.frames import FrameReader
from ftjob.lighthouse.api.http_errors import JsonErrorRunner
from ftjob.lighthouse.api.watch import WatchWebSocket


def params(fn: Callable[..., Any]) -> list[str]:
    """The parameter names of ``fn``, ``self`` included."""
    return list(inspect.signature(fn).parameters)


def source(fn: Callable[..., Any]) -> str:
    """``fn``'s source without whitespace, so that a reformatting of aiohttp does not count as a change."""
    return "".join(inspect.getsource(fn).split())


# --- the lighthouse's watch socket (server side) ------------------------------------------------------------------


def test_prepare_still_hands_the_started_socket_to_post_start() -> None:
    assert params(web.WebSocketResponse._post_start) == ["self", "request", "protocol", "writer"]
    assert params(WatchWebSocket._post_start) == params(web.WebSocketResponse._post_start)
    prepare = source(web.WebSocketResponse.prepare)
    assert "protocol,writer=self._pre_start(request)" in prepare
    assert "self._post_start(request,protocol,writer)" in prepare


def test_the_private_state_our_post_start_and_close_set_still_exists() -> None:
    for name in ("_ws_protocol", "_writer", "_closed", "_close_code"):
        assert hasattr(web.WebSocketResponse, name), name
    assert params(web.WebSocketResponse._set_closed) == ["self"]
    # the public accessors read the fields our override sets
    assert "self._ws_protocol" in source(web.WebSocketResponse.ws_protocol.fget)
    assert "self._closed" in source(web.WebSocketResponse.closed.fget)
    assert "self._close_code" in source(web.WebSocketResponse.close_code.fget)


def test_the_public_methods_we_override_keep_their_parameters() -> None:
    assert params(WatchWebSocket.close) == params(web.WebSocketResponse.close)
    assert params(WatchWebSocket.receive) == params(web.WebSocketResponse.receive)


def test_the_payload_parser_slot_takes_our_frame_reader() -> None:
    assert params(RequestHandler.set_parser)[:2] == ["self", "parser"]
    assert params(RequestHandler.keep_alive) == ["self", "val"]
    assert isinstance(BaseRequest.protocol, property) and isinstance(BaseRequest.transport, property)
    # the connection feeds its bytes to the parser and reads (eof, tail) back; on connection loss it calls feed_eof()
    assert "eof,tail=self._payload_parser.feed_data(data)" in source(RequestHandler.data_received)
    assert "self._payload_parser.feed_eof()" in source(RequestHandler.connection_lost)


@pytest.mark.parametrize("method", ["feed_data", "feed_eof"])
def test_the_frame_reader_has_the_parser_methods_aiohttps_own_reader_has(method: str) -> None:
    theirs, ours = getattr(WebSocketReader, method), getattr(FrameReader, method)
    assert [p for p in params(theirs) if p != "self"] == [p for p in params(ours) if p != "self"]


def test_the_writer_our_post_start_receives_is_still_importable_where_we_import_it() -> None:
    assert inspect.isclass(WebSocketWriter)


# --- the trainer's paced watch socket (client side) ---------------------------------------------------------------


def client_socket(cls: type[aiohttp.ClientWebSocketResponse], heartbeat: float) -> aiohttp.ClientWebSocketResponse:
    """A client socket built as ClientSession builds one, on a loop that never runs (nothing is sent)."""
    loop = asyncio.new_event_loop()
    response = mock.Mock(connection=None)
    return cls(mock.Mock(), mock.Mock(), None, response, mock.Mock(), True, True, loop, heartbeat=heartbeat)


def test_the_client_socket_keeps_its_ping_period_and_pong_allowance_where_pace_writes_them() -> None:
    ws = client_socket(aiohttp.ClientWebSocketResponse, heartbeat=2.0)
    try:
        assert (ws._heartbeat, ws._pong_heartbeat) == (2.0, 1.0)
        assert params(aiohttp.ClientWebSocketResponse._reset_heartbeat) == ["self"]
        # the ping timer and the pong deadline read the fields, not copies taken at connect
        assert "self._heartbeat" in source(aiohttp.ClientWebSocketResponse._reset_heartbeat)
        assert "self._pong_heartbeat" in source(aiohttp.ClientWebSocketResponse._send_heartbeat)
    finally:
        ws._cancel_heartbeat()
        ws._loop.close()


def test_pace_changes_the_timing_of_an_open_client_socket() -> None:
    ws = client_socket(PacedWebSocket, heartbeat=2.0)
    try:
        assert isinstance(ws, PacedWebSocket)
        ws.pace(6.0, 4.0)
        assert ws.timing == (6.0, 4.0)
        assert ws._heartbeat_cb is not None  # a ping is scheduled under the new period
    finally:
        ws._cancel_heartbeat()
        ws._loop.close()


# --- the lighthouse's JSON errors ---------------------------------------------------------------------------------


def test_the_runner_still_builds_its_server_in_make_server() -> None:
    assert inspect.iscoroutinefunction(web.AppRunner._make_server)
    assert params(web.AppRunner._make_server) == ["self"] == params(JsonErrorRunner._make_server)
    assert "self._server=awaitself._make_server()" in source(web.BaseRunner.setup)


def test_the_server_builds_its_connection_handlers_from_loop_and_kwargs() -> None:
    assert "RequestHandler(self,loop=self._loop,**self._kwargs)" in source(web.Server.__call__)
    assert params(RequestHandler.handle_error) == ["self", "request", "status", "exc", "message"]
