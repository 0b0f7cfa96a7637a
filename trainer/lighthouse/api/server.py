"""The lighthouse's HTTP/WebSocket front end (aiohttp): authentication (two tokens, two roles:
ftjob.lighthouse.api.auth), request validation, long-polled quorum requests, the operator's membership API, status,
metrics and the groups' watch sockets that push abort signals (ftjob.lighthouse.api.watch_socket).

All state lives in one QuorumCore driven from this event loop; a ticker re-evaluates it for heartbeat expiry and
join timeouts. Every rejected request changes nothing, and every answer that is not a success is the contract's
ErrorResponse (JSON): 400 a malformed query, header or body, 401 no or an unknown token, 403 the other role's call or a
group id outside the job's, 404 an unknown path, 405 a wrong method, 413 a body over MAX_BODY_BYTES, 415 a body that is
not declared JSON; requests aiohttp cannot even parse get it too (ftjob.lighthouse.api.http_errors).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web
from ftjob import contract
from ftjob.contract.lighthouse_api import (
    AbortSignal,
    Answer,
    DesiredRequest,
    DesiredResponse,
    ErrorResponse,
    EvictRequest,
    EvictResponse,
    HandoverRequest,
    HandoverResponse,
    HeartbeatRequest,
    HeartbeatResponse,
    QuorumMember,
    QuorumRequest,
    Request,
    StartingRequest,
    StartingResponse,
    WatchHeartbeat,
    describe,
)
from ftjob.lighthouse.api import auth
from ftjob.lighthouse.api.watch import HeartbeatPace, WatchWebSocket, push
from ftjob.lighthouse.api.watch_socket import Waiter, WatchSocketEndpoint
from ftjob.lighthouse.audit_trail import AuditTrail
from ftjob.lighthouse.auditor import LIGHTHOUSE, ROLE, Auditor, actor_of, name_sender, peer_of
from ftjob.lighthouse.core.integrity_checks import IntegrityChecks
from ftjob.lighthouse.core.quorum import BadRequest, Formed, Outdated, QuorumCore, QuorumError
from ftjob.lighthouse.core.state import PersistedState, save_state
from ftjob.lighthouse.server_metrics import LighthouseMetrics
from pydantic import ValidationError

log = logging.getLogger("ftjob.lighthouse")

_KNOWN_PATHS = {
    contract.PATH_QUORUM,
    contract.PATH_HEARTBEAT,
    contract.PATH_EVICT,
    contract.PATH_STARTING,
    contract.PATH_DESIRED,
    contract.PATH_HANDOVER,
    contract.PATH_STATUS,
    contract.PATH_METRICS,
    contract.PATH_HEALTH,
    contract.PATH_WATCH,
}


_POST_PATHS = auth.OPERATOR_PATHS | {contract.PATH_QUORUM, contract.PATH_HEARTBEAT}  # each takes a JSON body
_QUERY_PATHS = {contract.PATH_WATCH}  # the only path with query parameters (WatchQuery); any other refuses them
MAX_BODY_BYTES = 4 * 1024 * 1024  # a quorum request of a 64k-rank group fits

R = TypeVar("R", bound=Request)


def reply(answer: Answer, status: int = 200, exclude_none: bool = False) -> web.Response:
    body = answer.model_dump_json(exclude_none=exclude_none)
    return web.Response(body=body, status=status, content_type="application/json")


def refuse(status: int, message: str) -> web.Response:
    return reply(ErrorResponse(error=message), status)


async def parse(request: web.Request, model: type[R]) -> R:
    """The request body as ``model``; 400 naming every field that does not fit (nothing changes)."""
    try:
        body = model.model_validate_json(await request.read())
    except ValidationError as e:
        raise BadRequest(describe(e)) from None
    name_sender(request, getattr(body, "group", None), getattr(body, "incarnation", None))  # the audit's actor
    return body


class LighthouseServer(WatchSocketEndpoint):
    def __init__(
        self,
        core: QuorumCore,
        token: str,
        operator_token: str,
        state_file: str | None = None,
        tick_s: float = 0.02,
        clock: Callable[[], float] = time.monotonic,
        integrity: IntegrityChecks | None = None,
        audit_file: str | None = None,
    ) -> None:
        self.credentials = auth.Credentials(token, operator_token)  # ValueError without both, or with one twice
        self.core = core
        self.metrics = LighthouseMetrics()
        self.integrity = integrity or IntegrityChecks()
        self.audit = AuditTrail(audit_file, counter=self.metrics.audit_records)
        self.auditor = Auditor(core, self.audit, self.metrics, self.integrity)
        self._state_file = state_file
        self._tick_s = tick_s
        self._clock = clock
        self._waiters: dict[str, tuple[str, Waiter]] = {}  # group -> its pending quorum request
        self._asks_due = float("inf")
        self._answers_due = []
        self._watchers: dict[str, set[tuple[str, WatchWebSocket]]] = {}
        self._pushed_abort = core.abort_below
        self._saved = PersistedState(quorum_id=core.quorum_id, committed_step=core.committed_step)
        self._members_cache: tuple[int, list[QuorumMember]] | None = None
        self._formations = 0
        self._ticker: asyncio.Task[None] | None = None
        self.pace = HeartbeatPace(core.heartbeat_timeout_s)  # the heartbeat period the groups are told
        self._pushed_interval = self.pace.interval(0)
        self.heartbeats = 0  # rank-0 heartbeats received (the metric follows it at each tick)
        self._request_seconds = {p: self.metrics.request_seconds.labels(p) for p in (*_KNOWN_PATHS, "other")}

    # --- app wiring ----------------------------------------------------------------------------------------------
    def make_app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=MAX_BODY_BYTES)
        app.router.add_post(contract.PATH_QUORUM, self._quorum)
        app.router.add_post(contract.PATH_HEARTBEAT, self._heartbeat)
        app.router.add_post(contract.PATH_EVICT, self._evict)
        app.router.add_post(contract.PATH_STARTING, self._starting)
        app.router.add_post(contract.PATH_DESIRED, self._desired)
        app.router.add_post(contract.PATH_HANDOVER, self._handover)
        app.router.add_get(contract.PATH_STATUS, self._status)
        app.router.add_get(contract.PATH_METRICS, self._metrics)
        app.router.add_get(contract.PATH_HEALTH, self._health)
        app.router.add_get(contract.PATH_WATCH, self._watch)
        app.on_startup.append(self._start_ticker)
        app.on_cleanup.append(self._stop_ticker)
        return app

    async def _start_ticker(self, _app: web.Application) -> None:
        self._ticker = asyncio.create_task(self._tick_forever())

    async def _stop_ticker(self, _app: web.Application) -> None:
        if self._ticker:
            self._ticker.cancel()
        self.audit.close()
        for sockets in list(self._watchers.values()):
            for _inc, ws in list(sockets):
                await ws.close()

    async def shutdown(self) -> None:
        """Before stopping: answer every long-poll (503: retry) and close every watch socket, so the groups move
        on to the replacement lighthouse at once instead of waiting for their sockets to time out."""
        for _inc, fut in list(self._waiters.values()):
            if not fut.done():
                fut.set_exception(QuorumError(503, "the lighthouse is shutting down; retry"))
        sockets = [ws for group in self._watchers.values() for _inc, ws in group]
        await asyncio.gather(*(ws.close(code=1001, message=b"lighthouse shutting down") for ws in sockets))

    async def _tick_forever(self) -> None:
        self._counted_beats = 0
        while True:
            await asyncio.sleep(self._tick_s)
            try:
                self._advance()
                if (now := time.monotonic()) >= self._asks_due:  # the clock of WatchAsk.deadline
                    self._expire_asks(now)
                self.metrics.heartbeats.inc(self.heartbeats - self._counted_beats)
                self._counted_beats = self.heartbeats
            except Exception:  # keep serving: a bug in one tick must not stop liveness checks
                log.exception("lighthouse tick failed")

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        start = time.perf_counter()
        path = request.path if request.path in _KNOWN_PATHS else "other"
        try:
            if request.path not in auth.PUBLIC_PATHS:
                given = auth.bearer(request.headers.get("Authorization", ""))
                role = self.credentials.role(given)
                if role is None:
                    why = "wrong bearer token" if given else "missing 'Authorization: Bearer <token>' header"
                    whose = "the operator's" if request.path in auth.OPERATOR_PATHS else "the job's"
                    return self._refuse(request, 401, f"{why}: use {whose} token")
                request[ROLE] = role
                if (why := auth.refusal(role, request.path)) is not None:  # the other role's call: before any parsing
                    return self._refuse(request, 403, why)
            if (routed := request.match_info.http_exception) is not None:  # 404, 405: before looking at the request
                raise routed
            if (refused := self._malformed(request)) is not None:
                return self._refuse(request, *refused)
            return await handler(request)
        except QuorumError as e:
            return self._refuse(request, e.status, str(e))
        except web.HTTPException as e:  # aiohttp's own refusals (404, 405, 413): the contract's JSON too
            if e.status < 400:
                raise
            why = f"{e.reason}: {request.method} {request.path}"
            if isinstance(e, web.HTTPMethodNotAllowed):
                why += f" (allowed: {', '.join(sorted(e.allowed_methods))})"
            return self._refuse(request, e.status, why)
        except Exception:  # a lighthouse bug: the contract's JSON all the same, and the lighthouse serves on
            log.exception("%s %s failed", request.method, request.path)
            return refuse(500, "internal error in the lighthouse; see its log")
        finally:
            if path != contract.PATH_WATCH:
                self._request_seconds[path].observe(time.perf_counter() - start)

    @staticmethod
    def _malformed(request: web.Request) -> tuple[int, str] | None:
        """What is wrong with a routed request before its handler reads it: a query where none is taken (400), a body
        too large by its declared length (413, unread), a POST body not declared JSON (415); None when nothing is."""
        path = request.path
        if request.query_string and path not in _QUERY_PATHS:
            return 400, f"{request.method} {path} takes no query parameters (got {request.query_string[:100]!r})"
        if request.content_length is not None and request.content_length > MAX_BODY_BYTES:
            return 413, f"a request body is at most {MAX_BODY_BYTES} bytes, this one declares {request.content_length}"
        if path in _POST_PATHS:
            kind = request.headers.get("Content-Type", "")
            if kind != "application/json" and kind.partition(";")[0].strip().lower() != "application/json":
                return 415, f"POST {path} takes a JSON body: send 'Content-Type: application/json' (got {kind[:80]!r})"
        return None

    def _refuse(self, request: web.Request, status: int, message: str) -> web.Response:
        self.auditor.refused(request, status, message, self._clock())
        return refuse(status, message)

    # --- state transitions ---------------------------------------------------------------------------------------
    def _advance(self) -> None:
        """Expire heartbeats, form the quorum if due, answer the waiters, push aborts, persist."""
        now = self._clock()
        self.core.sweep(now)
        formed = self.core.poll(now)
        if formed is not None:
            self._issue(formed, now)
        self.auditor.drops(LIGHTHOUSE, now)
        self.audit.flush(now)
        for group, reason in self.core.dropped_events:
            self.metrics.evictions.labels(reason.split(":")[0]).inc()
            waiter = self._waiters.get(group)
            member = self.core.members.get(group)
            if waiter is None or (member is not None and waiter[0] == member.incarnation):
                continue  # no request, or one from the incarnation that replaced the dropped one: it stands
            del self._waiters[group]
            if not waiter[1].done():
                status = 410 if reason.startswith(("evicted", "handed_over", "left")) else 409  # banned: never again
                waiter[1].set_exception(QuorumError(status, f"group {group!r} was dropped ({reason}); ask again"))
        self.core.dropped_events.clear()
        self.auditor.drained()
        self.metrics.live_groups.set(len(self.core.members))
        interval = self.core.stall.heartbeat_interval_s = self.pace.interval(len(self.core.members))
        if self.core.abort_below != self._pushed_abort or interval != self._pushed_interval:
            self._pushed_abort, self._pushed_interval = self.core.abort_below, interval
            self._push(self._signal())
        self._persist()

    def _signal(self) -> AbortSignal:
        return AbortSignal(quorum_id=self.core.quorum_id, abort_below=self.core.abort_below,
                           heartbeat_interval_s=self._pushed_interval)  # fmt: skip

    def _issue(self, formed: Formed, now: float) -> None:
        self._formations += 1
        self.metrics.quorums.inc()
        self.metrics.quorum_size.set(len(formed.groups))
        self.metrics.quorum_id.set(formed.quorum_id)
        self.metrics.max_step.set(formed.max_step)
        if formed.changed:
            self.metrics.quorum_changes.inc()
            log.info("quorum %d: %d groups at step %d", formed.quorum_id, len(formed.groups), formed.max_step)
        if formed.heals:
            self.metrics.heals.inc(formed.heals)
        for group in formed.responses:
            waiter = self._waiters.pop(group, None)
            if waiter and not waiter[1].done():
                waiter[1].set_result(formed.responses)
        found = self.integrity.quorum_formed(formed.quorum_id, formed.max_step, formed.groups, now, self._incarnation)
        self.auditor.enforce(found, LIGHTHOUSE, LIGHTHOUSE, now)  # digests compared: may evict a divergent member

    def _incarnation(self, group: str) -> str | None:
        member = self.core.members.get(group)
        return member.incarnation if member is not None else None

    def _persist(self) -> None:
        if (self.core.quorum_id, self.core.committed_step) == (self._saved.quorum_id, self._saved.committed_step):
            return  # the common case, checked without building a model
        state = PersistedState(quorum_id=self.core.quorum_id, committed_step=self.core.committed_step)
        if self._state_file:
            save_state(self._state_file, state)
        self._saved = state

    def _push(self, message: AbortSignal) -> None:
        start, payload = time.perf_counter(), message.model_dump_json().encode()
        n = push((ws for sockets in self._watchers.values() for _inc, ws in sockets), payload)
        log.info("pushed %s to %d watch sockets in %.1f ms", payload.decode(), n, (time.perf_counter() - start) * 1e3)

    def _members(self) -> list[QuorumMember]:
        if self._members_cache is None or self._members_cache[0] != self._formations:
            self._members_cache = (self._formations, self.core.members_view())
        return self._members_cache[1]

    # --- handlers ------------------------------------------------------------------------------------------------
    async def _quorum(self, request: web.Request) -> web.Response:
        req = await parse(request, QuorumRequest)
        fut = self._enqueue(request, req)
        try:
            answers = await asyncio.wait_for(asyncio.shield(fut), req.timeout_s)
        except TimeoutError:
            self._forget(req.group, req.incarnation, fut)
            return refuse(504, self._timed_out(req))
        except asyncio.CancelledError:  # the client went away: it will not hear this quorum
            self._forget(req.group, req.incarnation, fut)
            raise
        if req.want_members:  # no members list unless asked for
            answer = answers[req.group].model_copy(update={"members": self._members()})
            return reply(answer, exclude_none=True)
        return web.Response(body=answers.encoded(req.group), content_type="application/json")

    def _timed_out(self, req: QuorumRequest) -> str:
        return f"no quorum within {req.timeout_s}s ({self.core.blocked_reason or 'quorum not formed yet'}); retry"

    def _enqueue(self, request: web.Request, req: QuorumRequest, waiter: Waiter | None = None) -> Waiter:
        """Registers a validated quorum request (403/410/400 before any change); the waiter (a new future unless
        given) resolves to the quorum's answers when it forms, or fails with a QuorumError (409 superseded or
        dropped, 410 evicted, 503)."""
        group, incarnation, now = req.group, req.incarnation, self._clock()
        self.integrity.validate(req)  # 400 for a verdict or digest no honest group sends, before any change
        member = self.core.members.get(group)
        try:  # 403/410 (an id outside the job's, an evicted incarnation) before any change
            if member is not None and member.incarnation == incarnation:  # the steady state: nothing to audit
                self.core.request(req, now)
            else:
                call = lambda: self.core.request(req, now)  # noqa: E731
                self.auditor.touch(group, incarnation, actor_of(request), "quorum request", now, call)
        except QuorumError as e:  # a banned incarnation learns why it was dropped (an outdated one is told already)
            banned = e.status == 410 and not isinstance(e, Outdated)
            raise QuorumError(410, f"{e} ({self._last_drop(group)})") if banned else e from None
        found = self.integrity.report(req, now, self._incarnation)
        if found or req.state_digest is not None:
            self.auditor.enforce(found, actor_of(request), peer_of(request), now)
        if self._incarnation(group) != incarnation:  # the integrity checks just evicted the asker itself
            self._advance()
            raise QuorumError(410, f"group {group!r} incarnation {incarnation!r} was {self._last_drop(group)}")
        if req.heal_seconds is not None:
            self.metrics.heal_seconds.observe(req.heal_seconds)
        old = self._waiters.pop(group, None)
        if old and not old[1].done():
            old[1].set_exception(QuorumError(409, f"superseded by a newer quorum request from group {group!r}"))
        fut = waiter if waiter is not None else asyncio.get_running_loop().create_future()
        self._waiters[group] = (incarnation, fut)
        if self.core.dropped_events:  # it replaced an incarnation: the full round (abort, the old one's waiter)
            self._advance()
        elif (formed := self.core.poll(now)) is not None:  # else only what a request changes: O(1) till it forms
            self._issue(formed, now)
            self._advance()  # the rest (persist, metrics) once per quorum; the ticker expires heartbeats
        return fut

    def _last_drop(self, group: str) -> str:
        """Why the group was last dropped (for a 410: an evicted process learns why before it exits)."""
        reasons = [e.reason for e in self.core.history if e.event == "dropped" and e.group == group]
        return reasons[-1] if reasons else "dropped"

    def _forget(self, group: str, incarnation: str, fut: Waiter) -> None:
        if self._waiters.get(group, (None, None))[1] is fut:
            del self._waiters[group]
            self.core.withdraw(group, incarnation)

    async def _heartbeat(self, request: web.Request) -> web.Response:
        beat = await parse(request, HeartbeatRequest)
        self.core.check_group(beat.group)  # any rank's: a group id outside the job's is refused, counted or not
        if beat.leaving and beat.rank == 0:
            self._leave(beat, actor_of(request))
            return reply(HeartbeatResponse(ok=True, quorum_id=self.core.quorum_id, abort_below=self.core.abort_below))
        if beat.rank == 0:
            frame = WatchHeartbeat.model_validate(beat.model_dump(include=set(WatchHeartbeat.model_fields)))
            self._beat(beat.group, beat.incarnation, actor_of(request), "heartbeat", frame, beat.generation)
        return reply(HeartbeatResponse(ok=True, quorum_id=self.core.quorum_id, abort_below=self.core.abort_below))

    def _beat(self, group: str, incarnation: str, actor: str, how: str, beat: WatchHeartbeat,
              generation: int | None = None) -> None:  # fmt: skip
        """Rank 0's heartbeat (403/410 before any change), audited: a new incarnation joins, a group finishes."""
        now = self._clock()

        def call() -> None:
            self.core.heartbeat(group, incarnation, beat.step, now, beat.finished, beat.param_digest, beat.progress,
                                beat.waiting, generation)  # fmt: skip

        member = self.core.members.get(group)
        if member is not None and member.incarnation == incarnation and not beat.finished:
            call()  # the steady state (most of the lighthouse's work at scale): nothing to audit, no auditor's round
        else:
            self.auditor.touch(group, incarnation, actor, how, now, call)

    def _leave(self, beat: HeartbeatRequest, actor: str) -> None:
        """A group's process leaves the job for good (SIGTERM, at a step boundary): dropped and audited now, as its
        own doing, and the survivors' pending quorum, which need not wait for it, may form at once."""
        now = self._clock()
        self.core.leave(beat.group, beat.incarnation, beat.step, now)
        self.auditor.drops(actor, now)
        self._advance()

    async def _evict(self, request: web.Request) -> web.Response:
        req = await parse(request, EvictRequest)
        for group in req.groups:
            self.core.check_group(group)
        now, actor = self._clock(), actor_of(request)
        evicted = self.core.evict(req.groups, req.reason, now)
        self.auditor.drops(actor, now)
        for group in dict.fromkeys(g for g in req.groups if g not in evicted):
            self.audit.record(now, "evict", actor, req.reason, "not a member: its last incarnation is banned", group)
        self._advance()  # aborts the quorum in flight now and lets the survivors' pending quorum form
        return reply(EvictResponse(evicted=evicted, abort_below=self.core.abort_below))

    async def _handover(self, request: web.Request) -> web.Response:
        req = await parse(request, HandoverRequest)
        now = self._clock()
        marked = self.core.handover(req.groups, req.reason, now)  # 403/404 before any change
        for group in marked:
            outcome = "marked for a handover: its next incarnation replaces this one without an abort"
            self.audit.record(now, "leave", actor_of(request), f"handover: {req.reason}", outcome, group)
        self._advance()
        return reply(HandoverResponse(handing_over=marked, expires_in_s=self.core.handover_timeout_s))

    async def _starting(self, request: web.Request) -> web.Response:
        req = await parse(request, StartingRequest)
        self.core.mark_starting(req.groups, self._clock())
        return reply(StartingResponse(starting=req.groups))

    async def _desired(self, request: web.Request) -> web.Response:
        req = await parse(request, DesiredRequest)  # generations' ids are below its groups, which bound them next
        self.core.set_desired(req.replicas, req.groups)
        if req.generations:
            now = self._clock()
            self.core.declare_generations(req.generations, now)
            self.auditor.drops(actor_of(request), now)  # an outdated member evicted: the operator's doing
            self._advance()  # aborts the quorum in flight if one was in it
        return reply(DesiredResponse(replicas=req.replicas, groups=self.core.group_limit))

    async def _status(self, _request: web.Request) -> web.Response:
        status = self.core.status(self._clock())
        return reply(status.model_copy(update={"integrity": self.integrity.status(), "audit": self.audit.ring()}))

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok")
