"""A replica group's client of the lighthouse: blocking calls for the training thread, backed by an aiohttp session on
a private event-loop thread that also keeps the watch socket open (heartbeats up, abort signals down).

Quorum requests retry through lighthouse restarts and long-poll timeouts until the caller's deadline; an evicted
incarnation gets EvictedError; any other refusal is a LighthouseError carrying the lighthouse's message.

A lost lighthouse (its pod deleted, its node gone: the peer vanishes without a reset) costs seconds, not the quorum
timeout: the watch socket pings it (paced by the lighthouse: watch_link.py), and when the socket drops every request in
flight is abandoned and retried on fresh connections (DNS looked up again: a new lighthouse pod has a new IP). While
the lighthouse is unreachable, a quorum request keeps retrying for up to ``lost_timeout_s`` (long compared with a
restart); once it answers again, the wait for the quorum itself starts afresh. The caller's state is never touched
meanwhile.

With a TlsConfig (FTJOB_TLS_CA_FILE set) the lighthouse URL must be https:// and its certificate is verified against
the job's CA only; a certificate that fails, or a lighthouse that does not speak TLS, is a configuration error that
no retry repairs: LighthouseTlsError at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from ftjob import contract
from ftjob.contract.lighthouse_api import (
    AbortSignal,
    HeartbeatRequest,
    HeartbeatResponse,
    QuorumRequest,
    QuorumResponse,
    Request,
    StatusResponse,
    WatchHeartbeat,
)
from ftjob.contract.tls import TlsConfig
from ftjob.ft.links.lighthouse_errors import (  # re-exported: importers name them from here
    A,
    EvictedError,
    LighthouseError,
    LighthouseLost,
    LighthouseTlsError,
    decode,
)
from ftjob.ft.links.watch_link import LINK_PING_S, PacedWebSocket, WatchQuorums, link_timing
from pydantic import ValidationError

__all__ = ["LINK_PING_S", "EvictedError", "LighthouseClient", "LighthouseError", "LighthouseLost", "LighthouseTlsError"]

log = logging.getLogger("ftjob.lighthouse_client")

CONNECT_TIMEOUT_S = 2.0  # a SYN to a vanished pod IP is dropped, not refused: give up and retry
RETRY_PAUSE_S = 0.1
LEAVE_TIMEOUT_S = 5.0  # a short part of a pod's termination grace: the leave is worth seconds to the others, not more
DEFAULT_LOST_TIMEOUT_S = 600.0


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
        lost_timeout_s: float = DEFAULT_LOST_TIMEOUT_S,
        on_reconnect: Callable[[], None] | None = None,
        tls: TlsConfig | None = None,
        generation: int | None = None,
    ) -> None:
        """``generation``: the group's generation this process belongs to (FTJOB_GENERATION), sent when it registers
        (watch socket, heartbeats); None: not sent (the lighthouse then cannot tell it from a replaced one)."""
        self.url = url.rstrip("/")
        if tls is not None and not self.url.startswith("https://"):
            raise ValueError(
                f"the lighthouse URL {url!r} is not https:// but {contract.ENV_TLS_CA_FILE} is set: the job's "
                f"lighthouse serves TLS only (set {contract.ENV_LIGHTHOUSE_URL} to its https:// URL)"
            )
        self._tls = tls
        self.group = group
        self.incarnation = incarnation
        self.generation = generation
        self.rank = rank
        self.abort_below = 0
        self.evicted = False
        self.step = 0
        self.progress = 0  # the training thread bumps it at every protocol point (stall detection)
        self.waiting = False  # the training thread is blocked in the step's cross-group collective
        self._headers = {"Authorization": f"Bearer {token}"}
        self._interval = heartbeat_interval_s
        self._last_told = 0.0  # monotonic time of the last frame that told the lighthouse this group lives
        self._on_abort = on_abort
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"lighthouse-client-{group}", daemon=True)
        self._session: aiohttp.ClientSession | None = None
        self._watch_task: asyncio.Future[None] | None = None
        self.watch_connected = threading.Event()
        self.lost_timeout_s = lost_timeout_s
        self._link_lost: asyncio.Future[None] | None = None  # resolved when the open watch socket drops
        self._on_reconnect = on_reconnect  # called (client thread) when the watch re-opens after a lost lighthouse
        self.reconnects = 0
        self.abandoned: str | None = None  # why this process left the lighthouse for good (abandon())
        self._ws: aiohttp.ClientWebSocketResponse | None = None  # the open watch socket (quorum requests go there)
        self._asked = WatchQuorums()
        self._leaving = False  # leave() began: no heartbeat may follow (the lighthouse bans the incarnation)

    # --- lifecycle -----------------------------------------------------------------------------------------------
    def start(self) -> LighthouseClient:
        """Starts the client's event-loop thread and HTTP session, and from then on keeps the watch socket open;
        returns the client."""
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._open(), self._loop).result(10)
        self._watch_task = asyncio.run_coroutine_threadsafe(self._watch_forever(), self._loop)
        return self

    async def _open(self) -> None:
        self._session = self._new_session()

    def _new_session(self) -> aiohttp.ClientSession:
        # No DNS cache: the lighthouse's name follows its pod, and a replacement pod has another IP.
        # ssl=True (an https:// URL without a TlsConfig): the system's trust store, which never holds a job's CA
        verify = self._tls.client_context if self._tls is not None else True
        connector = aiohttp.TCPConnector(limit=8, use_dns_cache=False, ssl=verify)
        timeout = aiohttp.ClientTimeout(sock_connect=CONNECT_TIMEOUT_S)
        return aiohttp.ClientSession(
            headers=self._headers, connector=connector, timeout=timeout, ws_response_class=PacedWebSocket
        )

    async def _renew_session(self) -> None:
        """Drops every pooled connection (they may lead to a vanished pod) and fails the requests still on them."""
        old, self._session = self._session, self._new_session()
        if old is not None:
            await old.close()

    def close(self) -> None:
        """Closes the watch socket and the session and stops the client's thread (best effort, bounded waits)."""
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

    def abandon(self, reason: str) -> None:
        """Leaves the lighthouse for good (this replica group broke: one of its ranks died). The watch socket closes
        and stays closed, which the lighthouse takes as the group disconnecting (it drops the group now, not at the
        heartbeat timeout), and every quorum request, in flight or later, fails with LighthouseError(0, reason)."""
        self.abandoned = reason
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._abandon)

    def _abandon(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
        if self._link_lost is not None and not self._link_lost.done():
            self._link_lost.set_result(None)  # a quorum request in flight gives up (LighthouseLost) and sees why

    async def _close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def _run(self, coro: Any, timeout_s: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    # --- blocking API for the training thread --------------------------------------------------------------------
    def quorum(self, req: QuorumRequest, timeout_s: float) -> QuorumResponse:
        """Long-polls for this step's quorum; retries through 504s for ``timeout_s`` and through a lost lighthouse
        for up to ``lost_timeout_s`` (see the module doc)."""
        return self._run(self._quorum(req, timeout_s), self.quorum_wait_bound(timeout_s))

    def quorum_async(self, req: QuorumRequest, timeout_s: float) -> concurrent.futures.Future[QuorumResponse]:
        """The same long-poll, started now and collected later with ``.result(quorum_wait_bound(timeout_s))``
        (cancel it if never needed)."""
        return asyncio.run_coroutine_threadsafe(self._quorum(req, timeout_s), self._loop)

    def quorum_wait_bound(self, timeout_s: float) -> float:
        """The longest a quorum request can take: a wait, a loss, and a fresh wait after the lighthouse is back."""
        return 2 * timeout_s + self.lost_timeout_s + 10

    def leave(self, step: int, timeout_s: float = LEAVE_TIMEOUT_S) -> bool:
        """Tells the lighthouse this group leaves the job for good after committing ``step`` (HeartbeatRequest.leaving:
        the others' next quorum forms without it at once), then leaves as ``abandon`` does: no heartbeat follows and
        every later quorum request fails. False when the lighthouse did not hear it (unreachable or refusing): it
        then drops the group when the watch socket closes."""
        self._leaving = True
        try:
            self.heartbeat(step, timeout_s=timeout_s, leaving=True)
            heard = True
        except (LighthouseError, ConnectionError, TimeoutError) as e:
            log.warning("group %s could not tell the lighthouse it leaves: %s", self.group, e)
            heard = False
        self.abandon("this group left the job (SIGTERM)")
        return heard

    def heartbeat(
        self,
        step: int,
        finished: bool = False,
        param_digest: str | None = None,
        timeout_s: float = 10.0,
        leaving: bool = False,
    ) -> HeartbeatResponse:
        """Sends one heartbeat over HTTP (the watch socket carries the regular ones): the step, ``finished``
        with the parameters' digest at the end, ``leaving`` when the group leaves the job for good."""
        beat = HeartbeatRequest(
            group=self.group,
            incarnation=self.incarnation,
            generation=self.generation,
            step=step,
            rank=self.rank,
            finished=finished,
            param_digest=param_digest,
            progress=self.progress,
            waiting=self.waiting,
            leaving=leaving,
        )
        return self.post(contract.PATH_HEARTBEAT, beat, HeartbeatResponse, timeout_s)

    def post(self, path: str, body: Request, answer: type[A], timeout_s: float = 10.0) -> A:
        """Any other authenticated POST (membership API), retried while the lighthouse is unreachable for up to
        ``timeout_s``; raises LighthouseError on a refusal, ConnectionError when it never answered."""
        return self._run(self._post_retrying(path, body, answer, timeout_s), timeout_s + 5)

    def status(self, timeout_s: float = 10.0) -> StatusResponse:
        """The lighthouse's status (GET), as the operator and tests read it."""
        return self._run(self._get(contract.PATH_STATUS, StatusResponse, timeout_s), timeout_s + 5)

    # --- coroutines ----------------------------------------------------------------------------------------------
    async def _post(self, path: str, body: Request, answer: type[A], timeout_s: float) -> A:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=CONNECT_TIMEOUT_S)  # replaces the session's
        data = body.model_dump_json(exclude_none=True)
        headers = {"Content-Type": "application/json"}
        try:
            async with self._session.post(self.url + path, data=data, headers=headers, timeout=timeout) as resp:
                return await decode(resp, answer)
        except aiohttp.ClientSSLError as e:
            raise self._tls_error(e) from None

    async def _get(self, path: str, answer: type[A], timeout_s: float) -> A:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=CONNECT_TIMEOUT_S)
        try:
            async with self._session.get(self.url + path, timeout=timeout) as resp:
                return await decode(resp, answer)
        except aiohttp.ClientSSLError as e:
            raise self._tls_error(e) from None

    def _tls_error(self, e: aiohttp.ClientSSLError) -> LighthouseTlsError:
        trust = f"the job's CA ({self._tls.ca_file})" if self._tls and self._tls.ca_file else "the system trust store"
        return LighthouseTlsError(f"TLS with the lighthouse {self.url} failed, verifying against {trust}: {e}")

    async def _post_retrying(self, path: str, body: Request, answer: type[A], timeout_s: float) -> A:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return await self._post(path, body, answer, max(0.5, deadline - time.monotonic()))
            except (TimeoutError, aiohttp.ClientError, ConnectionError) as e:
                if time.monotonic() + RETRY_PAUSE_S >= deadline:
                    raise ConnectionError(f"lighthouse {self.url} unreachable: {type(e).__name__}: {e}") from None
                await asyncio.sleep(RETRY_PAUSE_S)

    async def _post_unless_lost(self, path: str, body: Request, answer: type[A], timeout_s: float) -> A:
        """A POST abandoned (LighthouseLost) as soon as the watch socket that was open when it started drops."""
        lost = self._link_lost
        post = asyncio.ensure_future(self._post(path, body, answer, timeout_s))
        if lost is None:  # the watch is down too: rely on the connect timeout
            return await post
        done, _ = await asyncio.wait({post, lost}, return_when=asyncio.FIRST_COMPLETED)
        if post in done:
            return post.result()
        post.cancel()
        raise LighthouseLost("the lighthouse's watch socket dropped while waiting")

    async def _quorum(self, req: QuorumRequest, timeout_s: float) -> QuorumResponse:
        start = time.monotonic()
        deadline = start + timeout_s  # for the lighthouse to form a quorum while it answers
        hard_stop = start + self.quorum_wait_bound(timeout_s) - 10
        lost_since: float | None = None  # unreachable since then
        last_error = "no attempt"
        while True:
            if self.abandoned is not None:
                raise LighthouseError(0, f"this process left the lighthouse: {self.abandoned}")
            now = time.monotonic()
            if lost_since is not None and now - lost_since > self.lost_timeout_s:
                raise TimeoutError(
                    f"lighthouse {self.url} unreachable for {now - lost_since:.0f}s (lost timeout "
                    f"{self.lost_timeout_s:g}s; last: {last_error})"
                )
            if (lost_since is None and now >= deadline) or now >= hard_stop:
                raise TimeoutError(f"no quorum from {self.url} before the quorum timeout (last: {last_error})")
            remaining = max(0.5, deadline - now)
            try:
                ask = req.model_copy(update={"timeout_s": remaining, "progress": self.progress})
                self._last_told = time.monotonic()  # the lighthouse counts a quorum request as a heartbeat
                if self._ws is not None and not self._ws.closed:  # one connection per group: ask on the watch
                    return await self._asked.ask(self._ws, ask, remaining + 5, self._link_lost)
                return await self._post_unless_lost(contract.PATH_QUORUM, ask, QuorumResponse, remaining + 5)
            except EvictedError:
                self.evicted = True
                raise
            except LighthouseError as e:
                # 403: this group id is not declared yet (a scale-up the operator has not told a new lighthouse)
                if e.status not in (403, 409, 504) and e.status < 500:
                    raise
                last_error = str(e)
                if lost_since is not None:  # it answers again (a new lighthouse): the quorum wait starts afresh
                    lost_since, deadline = None, time.monotonic() + timeout_s
                if e.status == 403:
                    await asyncio.sleep(0.5)
            except (TimeoutError, aiohttp.ClientError, ConnectionError) as e:
                last_error = f"{type(e).__name__}: {e}"  # lighthouse gone or restarting: retry
                if lost_since is None:
                    lost_since = time.monotonic()
                    log.warning("lighthouse %s unreachable (%s); retrying for up to %gs", self.url, last_error,
                                self.lost_timeout_s)  # fmt: skip
                await asyncio.sleep(RETRY_PAUSE_S)

    async def _watch_forever(self) -> None:
        """Keeps the watch socket open; reconnects (the lighthouse may restart) until closed or evicted."""
        assert self._session is not None
        query = {"group": self.group, "incarnation": self.incarnation, "rank": str(self.rank)}
        if self.generation is not None:  # as the quorum requests and heartbeats, which leave a None out
            query["generation"] = str(self.generation)
        backoff = 0.05
        was_open = False
        while not self.evicted:
            try:
                ping_s, pong_s = self.link_timing  # the last pace known: a reconnect to a busy lighthouse keeps it
                ws_cm = self._session.ws_connect(self.url + contract.PATH_WATCH, params=query, heartbeat=ping_s)
                async with ws_cm as ws:
                    if isinstance(ws, PacedWebSocket):  # it always is (the session's class)
                        ws.pace(ping_s, pong_s)  # aiohttp allows a pong half the ping period: ours follows the pace
                    backoff = 0.05
                    self._link_lost = asyncio.get_running_loop().create_future()
                    self._ws = ws
                    self.watch_connected.set()
                    if was_open:  # the first connect is no reconnect
                        self.reconnects += 1
                        if self._on_reconnect is not None:
                            self._on_reconnect()
                    was_open = True
                    sender = asyncio.ensure_future(self._send_heartbeats(ws))
                    try:
                        async for msg in ws:
                            if msg.type != aiohttp.WSMsgType.TEXT:
                                continue
                            if msg.data.startswith('{"kind":"quorum"'):  # the answer to a WatchQuorum
                                self._asked.answered(msg.data)
                            else:
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
            self._ws = None
            self._asked.fail_all()
            if self._link_lost is not None:  # it was open: abandon what waits on the old lighthouse
                lost, self._link_lost = self._link_lost, None
                lost.set_result(None)
                await self._renew_session()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 0.5)

    async def _send_heartbeats(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        """A heartbeat after every interval the group told the lighthouse nothing: a quorum request is one too (it
        refreshes liveness and starts the step's progress clock), so a step shorter than the interval costs the
        lighthouse one frame, not two -- at scale, where the pace is ~1 s, about half of what it reads per round."""
        while not ws.closed and not self._leaving:
            quiet = time.monotonic() - self._last_told
            if quiet < self._interval:
                await asyncio.sleep(self._interval - quiet)
                continue
            beat = WatchHeartbeat(step=self.step, progress=self.progress, waiting=self.waiting)
            self._last_told = time.monotonic()
            await ws.send_str(beat.model_dump_json())

    @property
    def link_timing(self) -> tuple[float, float]:
        """The watch socket's (ping period, pong allowance) for the heartbeat pace in force (watch_link.py)."""
        return link_timing(self._interval)

    @property
    def open_socket_timing(self) -> tuple[float | None, float | None] | None:
        """The (ping period, pong allowance) the open watch socket's own timers run with; None while no socket is
        open. Read-only: what `link_timing` asked for, as the socket applied it."""
        ws = self._ws
        return ws.timing if isinstance(ws, PacedWebSocket) else None

    def _handle_push(self, signal: AbortSignal) -> None:
        if signal.heartbeat_interval_s is not None:  # the lighthouse paces its groups' heartbeats (grows with them)
            self._interval = signal.heartbeat_interval_s
            if isinstance(self._ws, PacedWebSocket):  # the link follows: a busy lighthouse's late pong drops no group
                self._ws.pace(*self.link_timing)
        abort_below = signal.abort_below
        if abort_below != self.abort_below:
            self.abort_below = abort_below
            if self._on_abort is not None:
                self._on_abort(abort_below)
