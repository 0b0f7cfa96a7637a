"""Readiness and liveness probes: exec (inside the pod's netns and mounts), httpGet and tcpSocket (to the pod IP from
the node, as a kubelet does, so a cut pod network fails its probes like a real one)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import aiohttp

log = logging.getLogger("nodeagent.probes")

# Runs argv inside the container's namespaces; returns the exit code (the caller enforces the timeout).
ExecRunner = Callable[[list[str]], Awaitable[int]]


def resolve_port(port: int | str, container: dict) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"probe port {port!r} names no port of container {container.get('name')!r}")


async def probe_once(probe: dict, container: dict, pod_ip: str, run_exec: ExecRunner) -> bool:
    timeout = float(probe.get("timeoutSeconds", 1))
    try:
        if "exec" in probe:
            return await asyncio.wait_for(run_exec(list(probe["exec"]["command"])), timeout) == 0
        if "tcpSocket" in probe:
            spec = probe["tcpSocket"]
            host = spec.get("host") or pod_ip
            port = resolve_port(spec["port"], container)
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            return True
        if "httpGet" in probe:
            spec = probe["httpGet"]
            scheme = spec.get("scheme", "HTTP").lower()
            port = resolve_port(spec["port"], container)
            url = f"{scheme}://{spec.get('host') or pod_ip}:{port}{spec.get('path', '/')}"
            headers = {h["name"]: h["value"] for h in spec.get("httpHeaders") or []}
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session,
                session.get(url, headers=headers, ssl=False) as resp,
            ):
                return 200 <= resp.status < 400
    except (TimeoutError, OSError, aiohttp.ClientError, ValueError):
        return False
    log.warning("probe of container %s has no supported handler: %s", container.get("name"), sorted(probe))
    return False


class ProbeLoop:
    """Runs one probe periodically and reports each change of its verdict via on_change(ok)."""

    def __init__(
        self,
        probe: dict,
        container: dict,
        pod_ip: str,
        run_exec: ExecRunner,
        on_change: Callable[[bool], None],
        initial: bool,
    ) -> None:
        self.probe = probe
        self.container = container
        self.pod_ip = pod_ip
        self.run_exec = run_exec
        self.on_change = on_change
        self.ok = initial

    async def run(self) -> None:
        period = float(self.probe.get("periodSeconds", 10))
        success_threshold = int(self.probe.get("successThreshold", 1))
        failure_threshold = int(self.probe.get("failureThreshold", 3))
        await asyncio.sleep(float(self.probe.get("initialDelaySeconds", 0)))
        successes = failures = 0
        while True:
            if await probe_once(self.probe, self.container, self.pod_ip, self.run_exec):
                successes, failures = successes + 1, 0
                if not self.ok and successes >= success_threshold:
                    self.ok = True
                    self.on_change(True)
            else:
                successes, failures = 0, failures + 1
                if self.ok and failures >= failure_threshold:
                    self.ok = False
                    self.on_change(False)
            await asyncio.sleep(period)
