"""HTTP client for a job's lighthouse (typed messages: ftjob.contract.lighthouse_api). Short timeouts: the operator must
never stall a reconcile on a slow lighthouse; every call reports success so the caller can retry later.

The operator reaches a lighthouse by pod IP; with the job's TLS on it verifies the certificate against the job's CA
(from the job's TLS Secret) and the lighthouse Service's DNS name, which the certificate carries."""

from __future__ import annotations

import logging
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
from ftjob import contract
from ftjob.contract.lighthouse_api import (
    DesiredRequest,
    EvictRequest,
    HandoverRequest,
    Request,
    StartingRequest,
    StatusResponse,
)
from ftjob.operator.lighthouse.view import LighthouseView
from pydantic import ValidationError

log = logging.getLogger("ftjob.operator.lighthouse")
CALL_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class LighthouseEndpoint:
    """One lighthouse pod: its base URL by pod IP, and for a TLS job the job's CA and the name to verify."""

    url: str
    tls: ssl.SSLContext | None = None
    server_name: str | None = None

    def __str__(self) -> str:
        return self.url


class LighthouseClient:
    """One aiohttp session for every job's lighthouse (each call names the lighthouse's base URL and token)."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT_S))
        return self._session

    async def _post(self, base: LighthouseEndpoint, token: str, path: str, body: Request) -> bool:
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        try:
            async with self._get_session().post(
                base.url + path, data=body.model_dump_json(), headers=headers, **_tls_args(base)
            ) as resp:
                if resp.status >= 400:
                    log.warning("lighthouse %s%s answered %s: %s", base, path, resp.status, await resp.text())
                    return False
                return True
        except aiohttp.ClientSSLError as e:  # not transient: a certificate that is not the job's, or no TLS
            log.warning("lighthouse %s%s: TLS failed: %s", base, path, e)
            return False
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            log.debug("lighthouse %s%s unreachable: %s", base, path, e)
            return False

    async def evict(self, base: LighthouseEndpoint, token: str, groups: list[int], reason: str) -> bool:
        return await self._post(
            base, token, contract.PATH_EVICT, EvictRequest(groups=[str(g) for g in groups], reason=reason)
        )

    async def handover(self, base: LighthouseEndpoint, token: str, groups: list[int], reason: str) -> bool:
        """Make-before-break: the groups' next incarnation replaces the current one without aborting its quorum."""
        return await self._post(
            base, token, contract.PATH_HANDOVER, HandoverRequest(groups=[str(g) for g in groups], reason=reason)
        )

    async def starting(self, base: LighthouseEndpoint, token: str, groups: list[int]) -> bool:
        return await self._post(base, token, contract.PATH_STARTING, StartingRequest(groups=[str(g) for g in groups]))

    async def desired(self, base: LighthouseEndpoint, token: str, replicas: int, groups: int,
                      generations: Mapping[int, int] | None = None) -> bool:  # fmt: skip
        """Contributors wanted, the bound on group ids (every group the operator created is below it) and each group's
        oldest running generation (the lighthouse refuses older ones)."""
        declared = {str(g): gen for g, gen in generations.items()} if generations else None
        request = DesiredRequest(replicas=replicas, groups=groups, generations=declared)
        return await self._post(base, token, contract.PATH_DESIRED, request)

    async def status(self, base: LighthouseEndpoint, token: str) -> LighthouseView | None:
        try:
            async with self._get_session().get(
                base.url + contract.PATH_STATUS, headers={"Authorization": f"Bearer {token}"}, **_tls_args(base)
            ) as resp:
                if resp.status != 200:
                    return None
                return LighthouseView.from_status(StatusResponse.model_validate_json(await resp.read()))
        except (aiohttp.ClientError, TimeoutError, OSError, ValidationError) as e:
            log.debug("lighthouse %s status unavailable: %s", base, e)
            return None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _tls_args(base: LighthouseEndpoint) -> dict[str, Any]:
    return {"ssl": base.tls, "server_hostname": base.server_name} if base.tls is not None else {}


def endpoint(pod_ip: str, tls: ssl.SSLContext | None = None, server_name: str | None = None) -> LighthouseEndpoint:
    """The operator runs anywhere (in or out of the cluster) and reaches the lighthouse by its pod IP: over TLS
    (verified against ``tls``'s CA and ``server_name``) when given a context, else plain HTTP."""
    if tls is None:
        return LighthouseEndpoint(f"http://{pod_ip}:{contract.LIGHTHOUSE_PORT}")
    return LighthouseEndpoint(f"https://{pod_ip}:{contract.LIGHTHOUSE_PORT}", tls, server_name)
