"""Liveness/readiness endpoint on --health-port: GET /healthz answers 200 with whether this replica leads."""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web


async def serve(port: int, is_leader: Callable[[], bool], host: str = "0.0.0.0") -> web.AppRunner | None:
    """Start the endpoint; port 0 disables it. A standby is healthy too (it is alive and ready to take over)."""
    if not port:
        return None

    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"ok": True, "leader": is_leader()})

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
