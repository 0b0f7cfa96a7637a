"""The watch socket (GET /v1/watch), one per replica group's rank 0: heartbeats and quorum requests go up, abort
signals (with the heartbeat period to use) and quorum answers come down. A mixin of LighthouseServer, which owns the
state these handlers drive (the core, the waiters, the auditor)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from ftjob import contract
from ftjob.contract.lighthouse_api import (
    QuorumRequest,
    WatchHeartbeat,
    WatchQuery,
    WatchQuorum,
    WatchQuorumAnswer,
    describe,
)
from ftjob.lighthouse.api.watch import WatchWebSocket, send_now
from ftjob.lighthouse.auditor import actor_of, name_sender
from ftjob.lighthouse.core.answers import Answers
from ftjob.lighthouse.core.quorum import BadRequest, QuorumError
from pydantic import ValidationError

log = logging.getLogger("ftjob.lighthouse")
Waiter = Any  # asyncio.Future[Answers] (POST /v1/quorum) or WatchAsk: done(), set_result(), set_exception(), cancel()


class WatchAsk:
    """A quorum request asked on a watch socket, as the server's waiter (the duck type of the future a POST waits
    on): resolving it queues its answer frame, written with the whole quorum's in one callback -- no future,
    done-callback or timer per request; the ticker expires it at ``deadline`` (time.monotonic())."""

    __slots__ = ("_answer", "_done", "deadline", "req")

    def __init__(self, answer: Callable[[Answers | None, BaseException | None], None], req: QuorumRequest,
                 deadline: float) -> None:  # fmt: skip
        self._answer, self.req, self.deadline, self._done = answer, req, deadline, False

    def done(self) -> bool:
        return self._done

    def cancel(self) -> bool:
        """The socket closed: nobody hears the answer any more."""
        pending, self._done = not self._done, True
        return pending

    def set_result(self, answers: Answers) -> None:
        if not self._done:
            self._done = True
            self._answer(answers, None)

    def set_exception(self, error: BaseException) -> None:
        if not self._done:
            self._done = True
            self._answer(None, error)


class WatchSocketEndpoint:
    """The watch socket's handlers; ``self`` is the LighthouseServer."""

    core: Any
    heartbeats: int
    _watchers: dict[str, set[tuple[str, web.WebSocketResponse]]]
    _waiters: dict[str, tuple[str, Waiter]]
    _answers_due: list[tuple[web.WebSocketResponse, QuorumRequest, Answers | None, BaseException | None]]
    _asks_due: float  # the earliest deadline of a pending WatchAsk (or later): _expire_asks runs then
    open_sockets = 0  # watch sockets open now (ftjob.lighthouse.gc_pacing: memory per connection)

    async def _watch(self, request: web.Request) -> web.WebSocketResponse:
        keys = set(request.query)
        if len(keys) != len(request.query):  # a parameter given twice: which one counts would be a guess
            repeated = ", ".join(sorted(k for k in keys if len(request.query.getall(k)) > 1))
            raise BadRequest(f"invalid WatchQuery: {repeated}: given more than once")
        try:
            query = WatchQuery.model_validate(dict(request.query))
        except ValidationError as e:
            raise BadRequest(describe(e)) from None
        group, incarnation, rank, generation = query.group, query.incarnation, query.rank, query.generation
        name_sender(request, group, incarnation)
        actor = actor_of(request)
        self.core.check_group(group)  # any rank's socket: 403 for an id outside the job's, before anything is kept
        asked: list[WatchAsk] = []  # this socket's quorum requests (the last one may be pending)

        def on_text(data: str) -> None:
            """One text frame, handled synchronously from the connection's data (ftjob.lighthouse.api.frames)."""
            if rank != 0:
                return
            try:
                if '"kind"' in data:  # a WatchQuorum (a heartbeat has no such key)
                    self._ask_on_watch(request, ws, data, group, incarnation, asked)
                    return
                beat = WatchHeartbeat.model_validate_json(data)
                self.heartbeats += 1
                self._beat(group, incarnation, actor, "watch heartbeat", beat, generation)
            except QuorumError as e:
                self._refuse(request, e.status, f"watch socket closed with {4000 + e.status}: {e}")
                ws.hang_up(4000 + e.status, str(e)[:120])
            except ValidationError as e:  # a client bug: say why and hang up (it reconnects with fixed beats)
                self._refuse(request, 400, f"watch socket closed with 4400: {describe(e)}")
                ws.hang_up(4400, describe(e)[:120])
            except Exception:  # a lighthouse bug: this socket closes (the client reconnects), the lighthouse serves on
                log.exception("watch frame from group %s failed", group)
                ws.hang_up(1011, "internal error")

        ws = WatchWebSocket(on_text)
        if not ws.can_prepare(request).ok:  # before rank 0 joins: a request that cannot become a socket changes nothing
            raise BadRequest(f"GET {contract.PATH_WATCH} is a WebSocket: send its upgrade handshake (Connection: "
                             "Upgrade, Upgrade: websocket, Sec-WebSocket-Key, Sec-WebSocket-Version: 13)")  # fmt: skip
        if rank == 0:  # 403/410 (an id outside the job's, an evicted incarnation) before the upgrade
            self._beat(group, incarnation, actor, "watch socket", WatchHeartbeat(step=0), generation)
        await ws.prepare(request)
        entry = (incarnation, ws)
        self._watchers.setdefault(group, set()).add(entry)
        self.open_sockets += 1
        try:
            send_now(ws, self._signal().model_dump_json().encode())
            await ws.ended
        finally:
            self.open_sockets -= 1
            self._watchers.get(group, set()).discard(entry)
            for fut in asked:  # the process is gone: it will not hear this quorum
                self._forget(group, incarnation, fut)
                fut.cancel()
            if self.core.disconnected(group, incarnation, self._clock()):
                self._advance()
        return ws

    def _ask_on_watch(self, request: web.Request, ws: web.WebSocketResponse, data: str, group: str,
                      incarnation: str, asked: list[WatchAsk]) -> None:  # fmt: skip
        """A WatchQuorum frame: the quorum long-poll of POST /v1/quorum, answered by one WatchQuorumAnswer frame."""
        try:
            try:
                req = WatchQuorum.model_validate_json(data).request
            except ValidationError as e:
                raise BadRequest(describe(e)) from None
            if (req.group, req.incarnation) != (group, incarnation):
                raise BadRequest(f"a quorum request on group {group!r} incarnation {incarnation!r}'s watch socket "
                                 f"names group {req.group!r} incarnation {req.incarnation!r}")  # fmt: skip
            # time.monotonic(), the default loop's clock: asyncio.get_running_loop() makes a getpid() syscall on
            # each call in CPython 3.11, a cost paid once per request in every large round.
            deadline = time.monotonic() + req.timeout_s
            ask = WatchAsk(lambda answers, error: self._answer_soon(ws, req, answers, error), req, deadline)
            asked[:] = [a for a in asked if not a.done()] + [ask]
            self._asks_due = min(self._asks_due, deadline)
            self._enqueue(request, req, ask)  # may answer at once (this request completed the quorum)
        except QuorumError as e:
            self._refuse(request, e.status, str(e))
            send_now(ws, WatchQuorumAnswer(status=e.status, error=str(e)).model_dump_json(exclude_none=True).encode())

    def _expire_asks(self, now: float) -> None:
        """The ticker's: answers 504 to the watch-socket requests past their timeout (``now``: time.monotonic()). Runs
        only once the earliest deadline seen has passed, so O(waiters) about once per request timeout, not per tick."""
        due = float("inf")
        for group, (incarnation, waiter) in list(self._waiters.items()):
            if not isinstance(waiter, WatchAsk) or waiter.done():
                continue
            if waiter.deadline > now:
                due = min(due, waiter.deadline)
                continue
            self._forget(group, incarnation, waiter)
            waiter.set_exception(QuorumError(504, self._timed_out(waiter.req)))
        self._asks_due = due

    def _answer_soon(self, ws: web.WebSocketResponse, req: QuorumRequest, answers: Answers | None,
                     error: BaseException | None) -> None:  # fmt: skip
        """Answers once the code that resolved the request is done (as a future's callback would: an abort pushed
        in the same round goes first), in one callback for all the answers of a quorum."""
        self._answers_due.append((ws, req, answers, error))
        if len(self._answers_due) == 1:
            asyncio.get_running_loop().call_soon(self._answer_due)

    def _answer_due(self) -> None:
        due, self._answers_due = self._answers_due, []
        for ws, req, answers, error in due:
            self._answer_on_watch(ws, req, answers, error)

    def _answer_on_watch(self, ws: web.WebSocketResponse, req: QuorumRequest, answers: Answers | None,
                         error: BaseException | None) -> None:  # fmt: skip
        if error is None and answers is not None and not req.want_members:  # the shared part encoded once per quorum
            send_now(ws, b'{"kind":"quorum","status":200,"quorum":' + answers.encoded(req.group) + b"}")
            return
        if error is None and answers is not None:
            answer = WatchQuorumAnswer(
                status=200, quorum=answers[req.group].model_copy(update={"members": self._members()})
            )
        else:
            status = error.status if isinstance(error, QuorumError) else 500
            answer = WatchQuorumAnswer(status=status, error=str(error))
        send_now(ws, answer.model_dump_json(exclude_none=True).encode())
