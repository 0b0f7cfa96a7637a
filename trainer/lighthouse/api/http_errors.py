"""The contract's JSON error even where aiohttp answers by itself: a request it cannot parse (a garbled request line or
header, a Content-Length that is no number, a header too long) never reaches the application or its middleware, and
aiohttp would answer it with a text/plain (or HTML) page. ``JsonErrorRunner`` serves the app with a connection handler
whose errors are an ``ErrorResponse`` like every other refusal of the lighthouse (the server's middleware handles the
rest: unknown paths, wrong methods, bodies too large)."""

from __future__ import annotations

from http import HTTPStatus

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest
from ftjob.contract.lighthouse_api import ErrorResponse


def error_response(status: int, message: str) -> web.Response:
    """The contract's error body with ``status``."""
    body = ErrorResponse(error=message).model_dump_json()
    return web.Response(body=body, status=status, content_type="application/json")


class _JsonErrorHandler(RequestHandler):
    def handle_error(
        self, request: BaseRequest, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        super().handle_error(request, status, exc, message)  # logs it (and raises if an answer was already begun)
        if isinstance(exc, HttpProcessingError) and exc.message:
            why = f"malformed HTTP request: {exc.message}"
        elif status >= 500:
            why = "internal error in the lighthouse; see its log"
        else:
            why = f"malformed HTTP request ({_phrase(status)})"
        resp = error_response(status, why)
        resp.force_close()  # the stream cannot be trusted past a request that did not parse
        return resp


def _phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return str(status)


class _JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JsonErrorHandler(self, loop=self._loop, **self._kwargs)


class JsonErrorRunner(web.AppRunner):
    """web.AppRunner whose connections answer unparsable requests with the contract's JSON error."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # aiohttp builds the Server itself (Application._make_handler) and has no option for the connection handler's
        # class: the same object, with only the factory of its connection handlers replaced
        server.__class__ = _JsonErrorServer
        return server
