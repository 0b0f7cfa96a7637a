"""Pod status: phase and conditions derived from the containers (pure), and a batching status patcher."""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

from .kubeapi import ApiError, KubeClient
from .timeutil import now_rfc3339

log = logging.getLogger("nodeagent.podstatus")


def pod_phase(init: list[dict], main: list[dict], init_failed: bool, policy: str) -> str:
    """Phase from container statuses: `init`/`main` are containerStatus dicts; init_failed: an init container
    failed for good."""
    if init_failed:
        return "Failed"
    if any((c["state"].get("terminated") or {}).get("exitCode") != 0 for c in init):
        return "Pending"
    if not main or not any(c.get("started") or c["state"].get("terminated") for c in main):
        return "Pending"
    terminated = [c["state"].get("terminated") for c in main]
    if all(terminated):
        codes = [t.get("exitCode") for t in terminated]
        if policy == "Always":
            return "Running"
        if policy == "OnFailure" and any(code != 0 for code in codes):
            return "Running"  # the failed ones are about to restart
        return "Succeeded" if all(code == 0 for code in codes) else "Failed"
    return "Running"


@dataclass
class ConditionClock:
    """Remembers when each condition last changed, for lastTransitionTime."""

    def __post_init__(self) -> None:
        self._seen: dict[str, tuple[str, str]] = {}

    def condition(self, kind: str, ok: bool, reason: str = "") -> dict:
        status = "True" if ok else "False"
        prev = self._seen.get(kind)
        stamp = prev[1] if prev and prev[0] == status else now_rfc3339()
        self._seen[kind] = (status, stamp)
        out = {"type": kind, "status": status, "lastTransitionTime": stamp, "lastProbeTime": None}
        if reason:
            out["reason"] = reason
        return out

    def seed(self, conditions: list[dict]) -> None:
        for cond in conditions or []:
            if cond.get("lastTransitionTime"):
                self._seen[cond["type"]] = (cond.get("status", ""), cond["lastTransitionTime"])


class StatusSyncer:
    """Sends pod status patches. Updates coalesce per pod while a batch is in flight, so a burst of changes costs
    one patch per pod, and an idle syncer sends a change at once (process exits reach the API in milliseconds)."""

    def __init__(self, client: KubeClient, concurrency: int = 16) -> None:
        self.client = client
        self._pending: dict[str, tuple[str, str, dict]] = {}
        self._sent: dict[str, str] = {}
        self._wake = asyncio.Event()
        self._limit = asyncio.Semaphore(concurrency)
        self.patches = 0

    def submit(self, uid: str, namespace: str, name: str, status: dict) -> None:
        self._pending[uid] = (namespace, name, status)
        self._wake.set()

    def forget(self, uid: str) -> None:
        self._pending.pop(uid, None)
        self._sent.pop(uid, None)

    async def send_now(self, uid: str, namespace: str, name: str, status: dict) -> None:
        self._pending.pop(uid, None)
        await self._patch(uid, namespace, name, status)

    async def _patch(self, uid: str, namespace: str, name: str, status: dict) -> None:
        text = json.dumps(status, sort_keys=True)
        if self._sent.get(uid) == text:
            return
        body = {"metadata": {"uid": uid}, "status": status}  # the uid makes the patch fail on a same-named new pod
        async with self._limit:
            try:
                await self.client.patch(f"/api/v1/namespaces/{namespace}/pods/{name}/status", body, strategic=True)
                self._sent[uid] = text
                self.patches += 1
            except ApiError as e:
                if e.status in (404, 409, 422) or e.status == 403:
                    log.debug("status of %s/%s not patched: %s", namespace, name, e)
                    return
                log.warning("status of %s/%s: %s; retrying", namespace, name, e)
                self._pending.setdefault(uid, (namespace, name, status))
            except Exception as e:
                log.warning("status of %s/%s: %s; retrying", namespace, name, e)
                self._pending.setdefault(uid, (namespace, name, status))

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._pending = self._pending, {}
            await asyncio.gather(*(self._patch(uid, *item) for uid, item in batch.items()))
            if self._pending and not self._wake.is_set():
                await asyncio.sleep(0.5)  # only retries are left: give the apiserver a moment
                self._wake.set()
