"""A replica group's client of the lighthouse: blocking calls for the training thread, backed by an aiohttp session on
a private event-loop thread that also keeps the watch socket open (heartbeats up, abort signals down).

Quorum requests retry through lighthouse restarts and long-poll timeouts until the caller's deadline; an evicted
incarnation gets EvictedError; any other refusal is a LighthouseError carrying the lighthouse's message.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import aiohttp
from ftjob import contract
from ftjob.contract.lighthouse_api import (
    AbortSignal,
    Answer,
    ErrorResponse,
    HeartbeatRequest,
    HeartbeatResponse,
    QuorumRequest,
    QuorumResponse,
    Request,
    StatusResponse,
    WatchHeartbeat,
)
from pydantic import ValidationError

log = logging.getLogger("ftjob.lighthouse_client")


A = TypeVar("A", bound=Answer)


class LighthouseError(RuntimeError):
    """The lighthouse refused a request (``status`` is its HTTP status) or answered something unreadable."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"lighthouse answered {status}: {message}")
        self.status = status


class EvictedError(LighthouseError):
    """This process's incarnation was evicted: it must exit (a restarted process gets a new incarnation)."""


class LighthouseClient:
    """One rank's connection to the job's lighthouse: quorum long-polls, heartbeats over the watch socket, and the
    abort signal (``on_abort`` is called from the client's own thread)."""

    def __init__(
        self,
        url: str,
        token: str,
        group: str,
        incarnation: str,
        rank: int = 0,
        heartbeat_interval_s: float = 0.1,
        on_abort: Callable[[int], None] | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.group = group
        self.incarnation = incarnation
        self.rank = rank
        self.abort_below = 0
        self.evicted = False
        self.step = 0
        self._headers = {"Authorization": f"Bearer {token}"}
        self._interval = heartbeat_interval_s
        self._on_abort = on_abort
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"lighthouse-client-{group}", daemon=True)
        self._session: aiohttp.ClientSession | None = None
        self._watch_task: asyncio.Future[None] | None = None
        self.watch_connected = threading.Event()

    # --- lifecycle -----------------------------------------------------------------------------------------------
    def start(self) -> LighthouseClient:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._open(), self._loop).result(10)
        self._watch_task = asyncio.run_coroutine_threadsafe(self._watch_forever(), self._loop)
        return self

    async def _open(self) -> None:
        self._session = aiohttp.ClientSession(headers=self._headers, connector=aiohttp.TCPConnector(limit=8))

    def close(self) -> None:
        if not self._thread.is_alive():
            return
        if self._watch_task is not None:
            self._watch_task.cancel()
        try:
            asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(5)
        except Exception:  # closing best-effort: the process may be exiting anyway
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def _run(self, coro: Any, timeout_s: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    # --- blocking API for the training thread --------------------------------------------------------------------
    def quorum(self, req: QuorumRequest, timeout_s: float) -> QuorumResponse:
        """Long-polls for this step's quorum; retries until ``timeout_s`` through restarts and 504s."""
        return self._run(self._quorum(req, time.monotonic() + timeout_s), timeout_s + 10)

    def quorum_async(self, req: QuorumRequest, timeout_s: float) -> concurrent.futures.Future[QuorumResponse]:
        """The same long-poll, started now and collected later with ``.result()`` (cancel it if never needed)."""
        return asyncio.run_coroutine_threadsafe(self._quorum(req, time.monotonic() + timeout_s), self._loop)

    def heartbeat(self, step: int, finished: bool = False, param_digest: str | None = None) -> HeartbeatResponse:
        beat = HeartbeatRequest(
            group=self.group,
            incarnation=self.incarnation,
            step=step,
            rank=self.rank,
            finished=finished,
            param_digest=param_digest,
        )
        return self.post(contract.PATH_HEARTBEAT, beat, HeartbeatResponse)

    def post(self, path: str, body: Request, answer: type[A], timeout_s: float = 10.0) -> A:
        """Any other authenticated POST (membership API); raises LighthouseError on a refusal."""
        return self._run(self._post(path, body, answer, timeout_s), timeout_s + 5)

    def status(self, timeout_s: float = 10.0) -> StatusResponse:
        return self._run(self._get(contract.PATH_STATUS, StatusResponse, timeout_s), timeout_s + 5)

    # --- coroutines ----------------------------------------------------------------------------------------------
    async def _post(self, path: str, body: Request, answer: type[A], timeout_s: float) -> A:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        data = body.model_dump_json(exclude_none=True)
        headers = {"Content-Type": "application/json"}
        async with self._session.post(self.url + path, data=data, headers=headers, timeout=timeout) as resp:
            return await self._decode(resp, answer)

    async def _get(self, path: str, answer: type[A], timeout_s: float) -> A:
        assert self._session is not None
        async with self._session.get(self.url + path, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            return await self._decode(resp, answer)

    @staticmethod
    async def _decode(resp: aiohttp.ClientResponse, answer: type[A]) -> A:
        raw = await resp.read()
        if resp.status >= 400:
            try:
                error = ErrorResponse.model_validate_json(raw).error
            except ValidationError:
                error = raw.decode(errors="replace")
            cls = EvictedError if resp.status == 410 else LighthouseError
            raise cls(resp.status, error)
        try:
            return answer.model_validate_json(raw)
        except ValidationError as e:
            raise LighthouseError(resp.status, f"unreadable {answer.__name__}: {e}") from None

    async def _quorum(self, req: QuorumRequest, deadline: float) -> QuorumResponse:
        last_error = "no attempt"
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no quorum from {self.url} before the quorum timeout (last: {last_error})")
            try:
                ask = req.model_copy(update={"timeout_s": remaining})
                return await self._post(contract.PATH_QUORUM, ask, QuorumResponse, remaining + 5)
            except EvictedError:
                self.evicted = True
                raise
            except LighthouseError as e:
                # 403: this group id is not declared yet (a scale-up the operator has not told a new lighthouse)
                if e.status not in (403, 409, 504) and e.status < 500:
                    raise
                last_error = str(e)
                if e.status == 403:
                    await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
            except (TimeoutError, aiohttp.ClientError, ConnectionError) as e:
                last_error = f"{type(e).__name__}: {e}"  # lighthouse down or restarting: retry
                await asyncio.sleep(min(0.1, max(0.0, deadline - time.monotonic())))

    async def _watch_forever(self) -> None:
        """Keeps the watch socket open; reconnects (the lighthouse may restart) until closed or evicted."""
        assert self._session is not None
        query = {"group": self.group, "incarnation": self.incarnation, "rank": str(self.rank)}
        backoff = 0.05
        while not self.evicted:
            try:
                async with self._session.ws_connect(self.url + contract.PATH_WATCH, params=query) as ws:
                    backoff = 0.05
                    self.watch_connected.set()
                    sender = asyncio.ensure_future(self._send_heartbeats(ws))
                    try:
                        async for msg in ws:
                            if msg.type == aiohttp.WSMsgType.TEXT:
                                self._handle_push(AbortSignal.model_validate_json(msg.data))
                    finally:
                        sender.cancel()
                    if ws.close_code == 4410:
                        self.evicted = True
            except aiohttp.WSServerHandshakeError as e:
                if e.status == 410:
                    self.evicted = True
            except (TimeoutError, aiohttp.ClientError, ConnectionError, ValidationError):
                pass  # reconnect: the lighthouse may be restarting
            self.watch_connected.clear()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 0.5)

    async def _send_heartbeats(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        while not ws.closed:
            await ws.send_str(WatchHeartbeat(step=self.step).model_dump_json())
            await asyncio.sleep(self._interval)

    def _handle_push(self, signal: AbortSignal) -> None:
        abort_below = signal.abort_below
        if abort_below != self.abort_below:
            self.abort_below = abort_below
            if self._on_abort is not None:
                self._on_abort(abort_below)
