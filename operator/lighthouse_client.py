"""HTTP client for a job's lighthouse (the API in ftjob.trainer.contract). Short timeouts: the operator must never
stall a reconcile on a slow lighthouse; every call reports success so the caller can retry later."""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
from ftjob.operator.lighthouse_view import LighthouseView
from ftjob.trainer import contract

log = logging.getLogger("ftjob.operator.lighthouse")
CALL_TIMEOUT_S = 2.0


class LighthouseClient:
    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT_S))
        return self._session

    async def _post(self, base: str, token: str, path: str, body: dict[str, Any]) -> bool:
        try:
            async with self._get_session().post(
                base + path, json=body, headers={"Authorization": f"Bearer {token}"}
            ) as resp:
                if resp.status >= 400:
                    log.warning("lighthouse %s%s answered %s: %s", base, path, resp.status, await resp.text())
                    return False
                return True
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            log.debug("lighthouse %s%s unreachable: %s", base, path, e)
            return False

    async def evict(self, base: str, token: str, groups: list[int], reason: str) -> bool:
        return await self._post(
            base, token, contract.PATH_EVICT, {"groups": [str(g) for g in groups], "reason": reason}
        )

    async def starting(self, base: str, token: str, groups: list[int]) -> bool:
        return await self._post(base, token, contract.PATH_STARTING, {"groups": [str(g) for g in groups]})

    async def desired(self, base: str, token: str, replicas: int) -> bool:
        return await self._post(base, token, contract.PATH_DESIRED, {"replicas": replicas})

    async def status(self, base: str, token: str) -> LighthouseView | None:
        try:
            async with self._get_session().get(
                base + contract.PATH_STATUS, headers={"Authorization": f"Bearer {token}"}
            ) as resp:
                if resp.status != 200:
                    return None
                return LighthouseView.parse(await resp.json())
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as e:
            log.debug("lighthouse %s status unavailable: %s", base, e)
            return None

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def base_url(pod_ip: str) -> str:
    """The operator runs anywhere (in or out of the cluster) and reaches the lighthouse by its pod IP."""
    return f"http://{pod_ip}:{contract.LIGHTHOUSE_PORT}"
