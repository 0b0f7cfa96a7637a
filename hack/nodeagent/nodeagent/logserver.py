"""The kubelet's log endpoint, so `kubectl logs` works: HTTPS on node_ip:kubelet_port, client certificates required.

GET /containerLogs/<ns>/<pod>/<container>?tailLines=N&previous=true&follow=true&limitBytes=N
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from pathlib import Path

from aiohttp import web

log = logging.getLogger("nodeagent.logs")

# (namespace, pod, container, previous) -> (log file or None, is the container still running?) ; None: no such pod
LogLocator = Callable[[str, str, str, bool], tuple[Path | None, bool] | None]


def tail_bytes(data: bytes, lines: int) -> bytes:
    if lines < 0:
        return data
    if lines == 0:
        return b""
    parts = data.splitlines(keepends=True)
    return b"".join(parts[-lines:])


def latest_log(container_dir: Path, previous: bool) -> Path | None:
    """<dir>/<restart>.log: the current run's file, or the one before it for --previous."""
    runs = sorted((int(p.stem), p) for p in container_dir.glob("*.log") if p.stem.isdigit())
    if previous:
        return runs[-2][1] if len(runs) >= 2 else None
    return runs[-1][1] if runs else None


class LogServer:
    def __init__(self, locate: LogLocator, bind: str, port: int, cert: str, key: str, client_ca: str) -> None:
        self.locate = locate
        self.bind = bind
        self.port = port
        self.cert, self.key, self.client_ca = cert, key, client_ca
        self._runner: web.AppRunner | None = None

    def _tls(self) -> ssl.SSLContext:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(self.cert, self.key)
        tls.load_verify_locations(self.client_ca)
        tls.verify_mode = ssl.CERT_REQUIRED  # only the apiserver (its kubelet client cert) may read logs
        return tls

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/containerLogs/{ns}/{pod}/{container}", self.container_logs)
        app.router.add_get("/healthz", lambda _req: web.Response(text="ok"))
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.bind, self.port, ssl_context=self._tls())
        await site.start()
        log.info("serving container logs on https://%s:%d", self.bind, self.port)

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def container_logs(self, request: web.Request) -> web.StreamResponse:
        ns, pod, container = request.match_info["ns"], request.match_info["pod"], request.match_info["container"]
        q = request.query
        previous = q.get("previous", "false").lower() == "true"
        follow = q.get("follow", "false").lower() == "true"
        try:
            tail = int(q.get("tailLines", "-1"))
            limit = int(q.get("limitBytes", "0"))
        except ValueError:
            raise web.HTTPBadRequest(text="tailLines and limitBytes must be integers") from None
        found = self.locate(ns, pod, container, previous)
        if found is None:
            raise web.HTTPNotFound(text=f"pod {ns}/{pod} is not running on this node")
        path = found[0]
        if path is None or not path.exists():
            what = "previous terminated container" if previous else "container"
            raise web.HTTPBadRequest(text=f'{what} "{container}" in pod "{pod}" has no logs (yet)')
        data = tail_bytes(path.read_bytes(), tail)
        if limit > 0:
            data = data[:limit]
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await resp.prepare(request)
        await resp.write(data)
        if follow and not previous:
            await self._follow(resp, ns, pod, container, path)
        await resp.write_eof()
        return resp

    async def _follow(self, resp: web.StreamResponse, ns: str, pod: str, container: str, path: Path) -> None:
        offset = path.stat().st_size
        while True:
            size = path.stat().st_size if path.exists() else offset
            if size > offset:
                with open(path, "rb") as f:
                    f.seek(offset)
                    chunk = f.read(size - offset)
                offset = size
                await resp.write(chunk)
                continue
            found = self.locate(ns, pod, container, False)
            if found is None or not found[1] or found[0] != path:
                return  # the container ended (or restarted into a new file): the stream ends like kubelet's
            await asyncio.sleep(0.25)
