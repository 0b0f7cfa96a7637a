"""The lighthouse's HTTP/WebSocket front end (aiohttp): authentication, request validation, long-polled quorum
requests, the operator's membership API, status, metrics and the per-rank watch sockets that push abort signals.

All state lives in one QuorumCore driven from this event loop; a ticker re-evaluates it for heartbeat expiry and
join timeouts. Every rejected request changes nothing.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import WSMsgType, web
from ftjob.trainer import contract
from ftjob.trainer.lighthouse_metrics import LighthouseMetrics
from ftjob.trainer.lighthouse_quorum import Formed, QuorumCore, QuorumError
from ftjob.trainer.lighthouse_state import PersistedState, save_state

log = logging.getLogger("ftjob.lighthouse")

_KNOWN_PATHS = {
    contract.PATH_QUORUM,
    contract.PATH_HEARTBEAT,
    contract.PATH_EVICT,
    contract.PATH_STARTING,
    contract.PATH_DESIRED,
    contract.PATH_STATUS,
    contract.PATH_METRICS,
    contract.PATH_HEALTH,
    contract.PATH_WATCH,
}


class BadRequest(QuorumError):
    def __init__(self, message: str) -> None:
        super().__init__(400, message)


def _field(body: dict[str, Any], name: str, kind: type | tuple[type, ...], required: bool = True) -> Any:
    """One typed field of a JSON body; bools never pass as ints."""
    if name not in body:
        if required:
            raise BadRequest(f"missing field {name!r}")
        return None
    value = body[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        names = "/".join(k.__name__ for k in kinds)
        raise BadRequest(f"field {name!r} must be {names}, got {type(value).__name__} {value!r}")
    return value


def _nonempty_str(body: dict[str, Any], name: str) -> str:
    value = _field(body, name, str)
    if not value:
        raise BadRequest(f"field {name!r} must be a non-empty string")
    return value


def _str_list(body: dict[str, Any], name: str, required: bool = True) -> list[str] | None:
    value = _field(body, name, list, required)
    if value is not None and not all(isinstance(v, str) and v for v in value):
        raise BadRequest(f"field {name!r} must be a list of non-empty strings, got {value!r}")
    return value


def validate_quorum_request(body: dict[str, Any]) -> dict[str, Any]:
    req = {
        "group": _nonempty_str(body, "group"),
        "incarnation": _nonempty_str(body, "incarnation"),
        "step": _field(body, "step", int),
        "quorum_id": _field(body, "quorum_id", int),
        "commit_failures": _field(body, "commit_failures", int, required=False) or 0,
        "address": _nonempty_str(body, "address"),
        "store_address": _nonempty_str(body, "store_address"),
        "world_size": _field(body, "world_size", int, required=False) or 1,
        "timeout_s": float(_field(body, "timeout_s", (int, float), required=False) or 60.0),
        "addresses": _str_list(body, "addresses", required=False),
        "store_addresses": _str_list(body, "store_addresses", required=False),
        "want_members": bool(_field(body, "want_members", bool, required=False)),
        "heal_seconds": _field(body, "heal_seconds", (int, float), required=False),
    }
    if req["step"] < 0 or req["commit_failures"] < 0 or req["world_size"] < 1 or req["timeout_s"] <= 0:
        raise BadRequest("step and commit_failures must be >= 0, world_size >= 1 and timeout_s > 0")
    for name in ("addresses", "store_addresses"):
        if req[name] is not None and len(req[name]) != req["world_size"]:
            raise BadRequest(f"field {name!r} must list one address per rank ({req['world_size']}), got {req[name]}")
    return req


class LighthouseServer:
    def __init__(
        self,
        core: QuorumCore,
        token: str,
        state_file: str | None = None,
        tick_s: float = 0.02,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not token:
            raise ValueError(f"the lighthouse needs a bearer token: set {contract.ENV_TOKEN} or --token-file")
        self.core = core
        self.metrics = LighthouseMetrics()
        self._token = token.encode()
        self._state_file = state_file
        self._tick_s = tick_s
        self._clock = clock
        self._waiters: dict[str, tuple[str, asyncio.Future[dict[str, Any]]]] = {}
        self._watchers: dict[str, set[tuple[str, web.WebSocketResponse]]] = {}
        self._pushed_abort = core.abort_below
        self._saved = PersistedState(core.quorum_id, core.committed_step)
        self._members_cache: tuple[int, list[dict[str, Any]]] | None = None
        self._formations = 0
        self._ticker: asyncio.Task[None] | None = None
        self._sends: set[asyncio.Future[None]] = set()  # pushes in flight (kept referenced until done)

    # --- app wiring ----------------------------------------------------------------------------------------------
    def make_app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=4 * 1024 * 1024)
        app.router.add_post(contract.PATH_QUORUM, self._quorum)
        app.router.add_post(contract.PATH_HEARTBEAT, self._heartbeat)
        app.router.add_post(contract.PATH_EVICT, self._evict)
        app.router.add_post(contract.PATH_STARTING, self._starting)
        app.router.add_post(contract.PATH_DESIRED, self._desired)
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
        for sockets in list(self._watchers.values()):
            for _inc, ws in list(sockets):
                await ws.close()

    async def _tick_forever(self) -> None:
        while True:
            await asyncio.sleep(self._tick_s)
            try:
                self._advance()
            except Exception:  # keep serving: a bug in one tick must not stop liveness checks
                log.exception("lighthouse tick failed")

    @web.middleware
    async def _middleware(self, request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
        start = time.perf_counter()
        path = request.path if request.path in _KNOWN_PATHS else "other"
        try:
            if request.path != contract.PATH_HEALTH:
                header = request.headers.get("Authorization", "")
                given = header[7:].encode() if header.startswith("Bearer ") else b""
                if not hmac.compare_digest(given, self._token):
                    why = "wrong bearer token" if given else "missing 'Authorization: Bearer <token>' header"
                    return web.json_response({"error": f"{why}: use the job's token"}, status=401)
            return await handler(request)
        except QuorumError as e:
            return web.json_response({"error": str(e)}, status=e.status)
        finally:
            if path != contract.PATH_WATCH:
                self.metrics.request_seconds.labels(path).observe(time.perf_counter() - start)

    @staticmethod
    async def _body(request: web.Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError) as e:
            raise BadRequest(f"request body is not valid JSON ({e}); send a JSON object") from e
        if not isinstance(body, dict):
            raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
        return body

    # --- state transitions ---------------------------------------------------------------------------------------
    def _advance(self) -> None:
        """Expire heartbeats, form the quorum if due, answer the waiters, push aborts, persist."""
        now = self._clock()
        self.core.sweep(now)
        formed = self.core.poll(now)
        if formed is not None:
            self._issue(formed)
        for group, reason in self.core.dropped_events:
            self.metrics.evictions.labels(reason.split(":")[0]).inc()
            waiter = self._waiters.pop(group, None)
            if waiter and not waiter[1].done():
                status = 410 if reason.startswith("evicted") else 409
                waiter[1].set_exception(QuorumError(status, f"group {group!r} was dropped ({reason}); ask again"))
        self.core.dropped_events.clear()
        self.metrics.live_groups.set(len(self.core.members))
        if self.core.abort_below != self._pushed_abort:
            self._pushed_abort = self.core.abort_below
            self._push({"quorum_id": self.core.quorum_id, "abort_below": self.core.abort_below})
        self._persist()

    def _issue(self, formed: Formed) -> None:
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
        for group, body in formed.responses.items():
            waiter = self._waiters.pop(group, None)
            if waiter and not waiter[1].done():
                waiter[1].set_result(body)

    def _persist(self) -> None:
        state = PersistedState(self.core.quorum_id, self.core.committed_step)
        if self._state_file and state != self._saved:
            save_state(self._state_file, state)
        self._saved = state

    def _push(self, message: dict[str, Any]) -> None:
        text = json.dumps(message)
        for sockets in self._watchers.values():
            for _inc, ws in sockets:
                if not ws.closed:
                    send = asyncio.ensure_future(ws.send_str(text))
                    self._sends.add(send)
                    send.add_done_callback(self._sends.discard)

    def _members(self) -> list[dict[str, Any]]:
        if self._members_cache is None or self._members_cache[0] != self._formations:
            self._members_cache = (self._formations, self.core.members_view())
        return self._members_cache[1]

    # --- handlers ------------------------------------------------------------------------------------------------
    async def _quorum(self, request: web.Request) -> web.Response:
        req = validate_quorum_request(await self._body(request))
        group, incarnation = req["group"], req["incarnation"]
        self.core.request(req, self._clock())  # raises 410 for an evicted incarnation, before any change
        if req["heal_seconds"] is not None:
            self.metrics.heal_seconds.observe(req["heal_seconds"])
        old = self._waiters.pop(group, None)
        if old and not old[1].done():
            old[1].set_exception(QuorumError(409, f"superseded by a newer quorum request from group {group!r}"))
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiters[group] = (incarnation, fut)
        self._advance()
        try:
            body = await asyncio.wait_for(asyncio.shield(fut), req["timeout_s"])
        except TimeoutError:
            self._forget(group, incarnation, fut)
            reason = self.core.blocked_reason or "quorum not formed yet"
            return web.json_response({"error": f"no quorum within {req['timeout_s']}s ({reason}); retry"}, status=504)
        except asyncio.CancelledError:  # the client went away: it will not hear this quorum
            self._forget(group, incarnation, fut)
            raise
        if req["want_members"]:
            body = {**body, "members": self._members()}
        return web.json_response(body)

    def _forget(self, group: str, incarnation: str, fut: asyncio.Future[dict[str, Any]]) -> None:
        if self._waiters.get(group, (None, None))[1] is fut:
            del self._waiters[group]
            self.core.withdraw(group, incarnation)

    async def _heartbeat(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        group, incarnation = _nonempty_str(body, "group"), _nonempty_str(body, "incarnation")
        step = _field(body, "step", int)
        rank = _field(body, "rank", int, required=False) or 0
        finished = bool(_field(body, "finished", bool, required=False))
        digest = _field(body, "param_digest", str, required=False)
        if rank == 0:
            self.core.heartbeat(group, incarnation, step, self._clock(), finished=finished, digest=digest)
        return web.json_response({"ok": True, "quorum_id": self.core.quorum_id, "abort_below": self.core.abort_below})

    async def _evict(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        groups = _str_list(body, "groups")
        reason = _field(body, "reason", str, required=False) or "operator"
        evicted = self.core.evict(groups, reason, self._clock())
        self._advance()  # aborts the quorum in flight now and lets the survivors' pending quorum form
        return web.json_response({"evicted": evicted, "abort_below": self.core.abort_below})

    async def _starting(self, request: web.Request) -> web.Response:
        groups = _str_list(await self._body(request), "groups")
        self.core.mark_starting(groups, self._clock())
        return web.json_response({"starting": groups})

    async def _desired(self, request: web.Request) -> web.Response:
        replicas = _field(await self._body(request), "replicas", int)
        self.core.set_desired(replicas)
        return web.json_response({"replicas": replicas})

    async def _status(self, _request: web.Request) -> web.Response:
        return web.json_response(self.core.status(self._clock()))

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _watch(self, request: web.Request) -> web.WebSocketResponse:
        q = request.query
        group, incarnation = q.get("group", ""), q.get("incarnation", "")
        if not group or not incarnation or not q.get("rank", "0").isdigit():
            raise BadRequest("watch needs query parameters group, incarnation and a numeric rank")
        rank = int(q.get("rank", "0"))
        if rank == 0:
            self.core.heartbeat(group, incarnation, 0, self._clock())  # 410 if evicted, before the upgrade
        ws = web.WebSocketResponse(heartbeat=None)
        await ws.prepare(request)
        entry = (incarnation, ws)
        self._watchers.setdefault(group, set()).add(entry)
        try:
            await ws.send_str(json.dumps({"quorum_id": self.core.quorum_id, "abort_below": self.core.abort_below}))
            async for msg in ws:
                if msg.type != WSMsgType.TEXT or rank != 0:
                    continue
                try:
                    beat = json.loads(msg.data)
                    self.core.heartbeat(
                        group,
                        incarnation,
                        int(beat.get("step", 0)),
                        self._clock(),
                        finished=bool(beat.get("finished", False)),
                        digest=beat.get("param_digest"),
                    )
                except QuorumError as e:
                    await ws.close(code=4000 + e.status, message=str(e)[:120].encode())
                except (ValueError, TypeError, AttributeError):
                    await ws.send_str(json.dumps({"error": "heartbeat must be a JSON object with an integer step"}))
        finally:
            self._watchers.get(group, set()).discard(entry)
            if self.core.disconnected(group, incarnation, self._clock()):
                self._advance()
        return ws
