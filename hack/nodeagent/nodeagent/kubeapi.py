"""A small asyncio Kubernetes REST client (aiohttp) plus a list+watch informer.

The official client is synchronous; one agent serves hundreds of pods, so everything here is a coroutine sharing one
connection pool. Credentials come from a kubeconfig (client certificate or bearer token).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import ssl
import tempfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml

log = logging.getLogger("nodeagent.kubeapi")


class ApiError(Exception):
    def __init__(self, status: int, method: str, path: str, body: str) -> None:
        self.status = status
        self.body = body
        try:
            self.reason = json.loads(body).get("reason", "")
        except (ValueError, AttributeError):
            self.reason = ""
        super().__init__(f"{method} {path}: HTTP {status}: {body[:300]}")


def _materialise(entry: dict, path_key: str, data_key: str, scratch: Path, name: str) -> str | None:
    """A kubeconfig field given as a file path or as inline base64 data, returned as a file path."""
    if entry.get(path_key):
        return entry[path_key]
    if entry.get(data_key):
        scratch.mkdir(parents=True, exist_ok=True)
        target = scratch / name
        target.write_bytes(base64.b64decode(entry[data_key]))
        target.chmod(0o600)
        return str(target)
    return None


def ssl_context_from_kubeconfig(kubeconfig: str, ca_file: str = "") -> tuple[str, ssl.SSLContext, str]:
    """(server URL, TLS context, bearer token or '') for the kubeconfig's current context."""
    doc = yaml.safe_load(Path(kubeconfig).read_text(encoding="utf-8"))
    ctx_name = doc.get("current-context") or doc["contexts"][0]["name"]
    context = next(c["context"] for c in doc["contexts"] if c["name"] == ctx_name)
    cluster = next(c["cluster"] for c in doc["clusters"] if c["name"] == context["cluster"])
    user = next(u["user"] for u in doc["users"] if u["name"] == context["user"])
    scratch = Path(tempfile.mkdtemp(prefix="nodeagent-creds-"))
    ca = ca_file or _materialise(cluster, "certificate-authority", "certificate-authority-data", scratch, "ca.crt")
    tls = ssl.create_default_context(cafile=ca) if ca else ssl.create_default_context()
    cert = _materialise(user, "client-certificate", "client-certificate-data", scratch, "client.crt")
    key = _materialise(user, "client-key", "client-key-data", scratch, "client.key")
    if cert and key:
        tls.load_cert_chain(cert, key)
    return cluster["server"], tls, user.get("token", "")


class KubeClient:
    """Coroutine wrappers around the REST verbs the agent needs."""

    def __init__(self, server: str, tls: ssl.SSLContext, token: str = "", pool: int = 32) -> None:
        self.server = server.rstrip("/")
        self._tls = tls
        self._token = token
        self._pool = pool
        self._session: aiohttp.ClientSession | None = None

    @classmethod
    def from_kubeconfig(cls, kubeconfig: str, server: str = "", ca_file: str = "") -> KubeClient:
        url, tls, token = ssl_context_from_kubeconfig(kubeconfig, ca_file)
        return cls(server or url, tls, token)

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            headers = {"Accept": "application/json", "User-Agent": "ftjob-nodeagent"}
            if self._token:
                headers["Authorization"] = f"Bearer {self._token}"
            connector = aiohttp.TCPConnector(ssl=self._tls, limit=self._pool)
            self._session = aiohttp.ClientSession(headers=headers, connector=connector)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: dict | None = None,
        body: Any = None,
        content_type: str = "application/json",
        timeout_s: float = 30.0,
    ) -> dict:
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if body is not None else {}
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self.session.request(
            method, self.server + path, params=params, data=data, headers=headers, timeout=timeout
        ) as resp:
            text = await resp.text()
            if resp.status >= 400:
                raise ApiError(resp.status, method, path, text)
            return json.loads(text) if text else {}

    async def get(self, path: str, **kw: Any) -> dict:
        return await self.request("GET", path, **kw)

    async def post(self, path: str, body: Any, **kw: Any) -> dict:
        return await self.request("POST", path, body=body, **kw)

    async def put(self, path: str, body: Any, **kw: Any) -> dict:
        return await self.request("PUT", path, body=body, **kw)

    async def patch(self, path: str, body: Any, strategic: bool = False, **kw: Any) -> dict:
        kind = "application/strategic-merge-patch+json" if strategic else "application/merge-patch+json"
        return await self.request("PATCH", path, body=body, content_type=kind, **kw)

    async def delete(self, path: str, body: Any = None, **kw: Any) -> dict:
        return await self.request("DELETE", path, body=body, **kw)

    async def watch(self, path: str, params: dict) -> AsyncIterator[tuple[str, dict]]:
        """Yields (type, object) from a watch stream until the server closes it."""
        query = {**params, "watch": "1", "allowWatchBookmarks": "true", "timeoutSeconds": "300"}
        timeout = aiohttp.ClientTimeout(total=None, sock_read=330)
        async with self.session.get(self.server + path, params=query, timeout=timeout) as resp:
            if resp.status >= 400:
                raise ApiError(resp.status, "WATCH", path, await resp.text())
            async for line in resp.content:
                if line.strip():
                    event = json.loads(line)
                    yield event["type"], event["object"]


def object_key(obj: dict) -> str:
    meta = obj["metadata"]
    return f"{meta.get('namespace', '')}/{meta['name']}"


class Informer:
    """Keeps an up-to-date cache of one resource list and calls on_event(type, obj, old) for every change.

    Relists (diffing against the cache, so consumers see ADDED/MODIFIED/DELETED as usual) when the watch expires.
    """

    def __init__(
        self,
        client: KubeClient,
        path: str,
        on_event: Callable[[str, dict, dict | None], None],
        params: dict | None = None,
        name: str = "",
    ) -> None:
        self.client = client
        self.path = path
        self.params = params or {}
        self.on_event = on_event
        self.name = name or path
        self.store: dict[str, dict] = {}
        self.synced = asyncio.Event()

    def _emit(self, kind: str, obj: dict, old: dict | None) -> None:
        try:
            self.on_event(kind, obj, old)
        except Exception:
            log.exception("informer %s: handler failed on %s %s", self.name, kind, object_key(obj))

    async def _relist(self) -> str:
        listing = await self.client.get(self.path, params=self.params, timeout_s=120)
        fresh = {object_key(o): o for o in listing.get("items", [])}
        for key, old in list(self.store.items()):
            if key not in fresh:
                del self.store[key]
                self._emit("DELETED", old, old)
        for key, obj in fresh.items():
            old = self.store.get(key)
            self.store[key] = obj
            if old is None:
                self._emit("ADDED", obj, None)
            elif old["metadata"].get("resourceVersion") != obj["metadata"].get("resourceVersion"):
                self._emit("MODIFIED", obj, old)
        self.synced.set()
        return listing["metadata"]["resourceVersion"]

    async def run(self) -> None:
        version = ""
        backoff = 0.2
        while True:
            try:
                if not version:
                    version = await self._relist()
                async for kind, obj in self.client.watch(self.path, {**self.params, "resourceVersion": version}):
                    backoff = 0.2
                    if kind == "ERROR":
                        version = ""  # usually 410 Gone: our version is too old
                        break
                    version = obj["metadata"].get("resourceVersion", version)
                    if kind == "BOOKMARK":
                        continue
                    key = object_key(obj)
                    old = self.store.get(key)
                    if kind == "DELETED":
                        self.store.pop(key, None)
                    else:
                        self.store[key] = obj
                    self._emit(kind, obj, old)
            except asyncio.CancelledError:
                raise
            except ApiError as e:
                if e.status == 410:
                    version = ""
                    continue
                log.warning("informer %s: %s; retrying in %.1fs", self.name, e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
            except (TimeoutError, aiohttp.ClientError, ConnectionError) as e:
                log.warning("informer %s: connection problem (%s); retrying in %.1fs", self.name, e, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
