"""The watch socket (GET /v1/watch), one per replica group's rank 0: heartbeats and quorum requests go up, abort
signals (with the heartbeat period to use) and quorum answers come down. A mixin of LighthouseServer, which owns the
state these handlers drive (the core, the waiters, the auditor)."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp import WSMsgType, web
from ftjob.contract.lighthouse_api import (
    QuorumRequest,
    WatchHeartbeat,
    WatchQuery,
    WatchQuorum,
    WatchQuorumAnswer,
    describe,
)
from ftjob.lighthouse.answers import Answers
from ftjob.lighthouse.auditing import actor_of, name_sender
from ftjob.lighthouse.quorum import BadRequest, QuorumError
from ftjob.lighthouse.watch import send_now
from pydantic import ValidationError


class WatchSocketEndpoint:
    """The watch socket's handlers; ``self`` is the LighthouseServer."""

    core: Any
    heartbeats: int
    _watchers: dict[str, set[tuple[str, web.WebSocketResponse]]]

    async def _watch(self, request: web.Request) -> web.WebSocketResponse:
        try:
            query = WatchQuery.model_validate(dict(request.query))
        except ValidationError as e:
            raise BadRequest(describe(e)) from None
        group, incarnation, rank = query.group, query.incarnation, query.rank
        name_sender(request, group, incarnation)
        actor = actor_of(request)
        if rank == 0:  # 403/410 (an id outside the job's, an evicted incarnation) before the upgrade
            self._beat(group, incarnation, actor, "watch socket", WatchHeartbeat(step=0))
        ws = web.WebSocketResponse(heartbeat=None)
        await ws.prepare(request)
        entry = (incarnation, ws)
        self._watchers.setdefault(group, set()).add(entry)
        asked: list[asyncio.Future[Answers]] = []  # this socket's quorum requests (the last one may be pending)
        try:
            await ws.send_str(self._signal().model_dump_json())
            async for msg in ws:
                if msg.type != WSMsgType.TEXT or rank != 0:
                    continue
                try:
                    if '"kind"' in msg.data:  # a WatchQuorum (a heartbeat has no such key)
                        self._ask_on_watch(request, ws, msg.data, group, incarnation, asked)
                        continue
                    beat = WatchHeartbeat.model_validate_json(msg.data)
                    self.heartbeats += 1
                    self._beat(group, incarnation, actor, "watch heartbeat", beat)
                except QuorumError as e:
                    self._refuse(request, e.status, f"watch socket closed with {4000 + e.status}: {e}")
                    await ws.close(code=4000 + e.status, message=str(e)[:120].encode())
                except ValidationError as e:  # a client bug: say why and hang up (it reconnects with fixed beats)
                    self._refuse(request, 400, f"watch socket closed with 4400: {describe(e)}")
                    await ws.close(code=4400, message=describe(e)[:120].encode())
        finally:
            self._watchers.get(group, set()).discard(entry)
            for fut in asked:  # the process is gone: it will not hear this quorum
                self._forget(group, incarnation, fut)
                fut.cancel()
            if self.core.disconnected(group, incarnation, self._clock()):
                self._advance()
        return ws

    def _ask_on_watch(self, request: web.Request, ws: web.WebSocketResponse, data: str, group: str,
                      incarnation: str, asked: list[asyncio.Future[Answers]]) -> None:  # fmt: skip
        """A WatchQuorum frame: the quorum long-poll of POST /v1/quorum, answered by one WatchQuorumAnswer frame."""
        try:
            try:
                req = WatchQuorum.model_validate_json(data).request
            except ValidationError as e:
                raise BadRequest(describe(e)) from None
            if (req.group, req.incarnation) != (group, incarnation):
                raise BadRequest(f"a quorum request on group {group!r} incarnation {incarnation!r}'s watch socket "
                                 f"names group {req.group!r} incarnation {req.incarnation!r}")  # fmt: skip
            fut = self._enqueue(request, req)
        except QuorumError as e:
            self._refuse(request, e.status, str(e))
            send_now(ws, WatchQuorumAnswer(status=e.status, error=str(e)).model_dump_json(exclude_none=True).encode())
            return
        asked[:] = [f for f in asked if not f.done()] + [fut]
        timer = asyncio.get_running_loop().call_later(req.timeout_s, self._expire, req, fut)
        fut.add_done_callback(lambda f: (timer.cancel(), self._answer_on_watch(ws, req, f)))

    def _expire(self, req: QuorumRequest, fut: asyncio.Future[Answers]) -> None:
        if not fut.done():
            self._forget(req.group, req.incarnation, fut)
            fut.set_exception(QuorumError(504, self._timed_out(req)))

    def _answer_on_watch(self, ws: web.WebSocketResponse, req: QuorumRequest, fut: asyncio.Future[Answers]) -> None:
        if fut.cancelled():  # the socket closed
            return
        error = fut.exception()
        if error is None and not req.want_members:  # the shared part of the answer is encoded once per quorum
            send_now(ws, b'{"kind":"quorum","status":200,"quorum":' + fut.result().encoded(req.group) + b"}")
            return
        if error is None:
            answer = WatchQuorumAnswer(
                status=200, quorum=fut.result()[req.group].model_copy(update={"members": self._members()})
            )
        else:
            status = error.status if isinstance(error, QuorumError) else 500
            answer = WatchQuorumAnswer(status=status, error=str(error))
        send_now(ws, answer.model_dump_json(exclude_none=True).encode())
