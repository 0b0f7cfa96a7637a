"""Pod status: phase and conditions derived from the containers (pure), and a batching status patcher."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
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


@dataclass
class PodFacts:
    """What the pod worker knows; build_pod_status turns it into the API's PodStatus."""

    init: list[dict]  # containerStatus of each init container
    main: list[dict]  # containerStatus of each container
    policy: str
    init_failed: bool
    initialized: bool
    network_ready: bool
    node_ip: str
    pod_ip: str
    start_time: str
    message: str


def build_pod_status(f: PodFacts, clock: ConditionClock) -> dict:
    phase = "Failed" if f.init_failed and not f.init else pod_phase(f.init, f.main, f.init_failed, f.policy)
    terminal = phase in ("Succeeded", "Failed")
    initialized = f.initialized or all((c["state"].get("terminated") or {}).get("exitCode") == 0 for c in f.init)
    ready = phase == "Running" and bool(f.main) and all(c["ready"] for c in f.main)
    why = "PodCompleted" if terminal else ("" if ready else "ContainersNotReady")
    status: dict = {
        "phase": phase,
        "conditions": [
            clock.condition("PodReadyToStartContainers", f.network_ready and not terminal),
            clock.condition("Initialized", initialized, "" if initialized else "ContainersNotInitialized"),
            clock.condition("ContainersReady", ready, why),
            clock.condition("Ready", ready, why),
            clock.condition("PodScheduled", True),
        ],
        "hostIP": f.node_ip,
        "hostIPs": [{"ip": f.node_ip}],
        "startTime": f.start_time,
        "initContainerStatuses": f.init,
        "containerStatuses": f.main,
    }
    if f.pod_ip:
        status["podIP"] = f.pod_ip
        status["podIPs"] = [{"ip": f.pod_ip}]
    if f.message:
        status["message"] = f.message
    return status


class StatusSyncer:
    """Sends pod status patches through a fixed pool of workers.

    Only a pod's latest status is kept, so a burst of changes to one pod costs one patch; at most one patch per pod
    is in flight, so they land in order. Failure news (a container ended, Ready lost) jumps the queue: the operator
    replaces failed pods within a second, and a burst of start-ups must not delay that.
    """

    def __init__(self, client: KubeClient, workers: int = 16) -> None:
        self.client = client
        self._workers = workers
        self._latest: dict[str, tuple[str, str, dict]] = {}
        self._sent: dict[str, str] = {}
        self._urgent: deque[str] = deque()
        self._normal: deque[str] = deque()
        self._inflight: set[str] = set()
        self._wake = asyncio.Event()
        self.patches = 0

    def submit(self, uid: str, namespace: str, name: str, status: dict, urgent: bool = False) -> None:
        queued = uid in self._latest
        self._latest[uid] = (namespace, name, status)
        if urgent:
            self._urgent.append(uid)  # a stale copy left in the normal queue is skipped when popped
        elif not queued:
            self._normal.append(uid)
        self._wake.set()

    def forget(self, uid: str) -> None:
        self._latest.pop(uid, None)
        self._sent.pop(uid, None)

    async def send_now(self, uid: str, namespace: str, name: str, status: dict) -> None:
        self._latest.pop(uid, None)
        await self._patch(uid, namespace, name, status)

    def _next(self) -> str | None:
        for queue in (self._urgent, self._normal):
            for _ in range(len(queue)):
                uid = queue.popleft()
                if uid not in self._latest:
                    continue  # already sent through the other queue, or forgotten
                if uid in self._inflight:
                    queue.append(uid)  # its previous patch is still on the wire: keep the order
                    continue
                return uid
        return None

    async def _patch(self, uid: str, namespace: str, name: str, status: dict) -> bool:
        """True when done (sent, unchanged, or the pod is gone); False when it should be retried."""
        text = json.dumps(status, sort_keys=True)
        if self._sent.get(uid) == text:
            return True
        body = {"metadata": {"uid": uid}, "status": status}  # the uid makes the patch fail on a same-named new pod
        try:
            await self.client.patch(f"/api/v1/namespaces/{namespace}/pods/{name}/status", body, strategic=True)
        except ApiError as e:
            if e.status in (403, 404, 409, 422):
                log.debug("status of %s/%s not patched: %s", namespace, name, e)
                return True
            log.warning("status of %s/%s: %s; retrying", namespace, name, e)
            return False
        except Exception as e:
            log.warning("status of %s/%s: %s; retrying", namespace, name, e)
            return False
        self._sent[uid] = text
        self.patches += 1
        return True

    async def _worker(self) -> None:
        while True:
            uid = self._next()
            if uid is None:
                self._wake.clear()
                await self._wake.wait()
                continue
            namespace, name, status = self._latest.pop(uid)
            self._inflight.add(uid)
            try:
                done = await self._patch(uid, namespace, name, status)
            finally:
                self._inflight.discard(uid)
            if not done:
                await asyncio.sleep(0.5)  # give a struggling apiserver a moment, then send the newest status
                if uid not in self._latest:
                    self.submit(uid, namespace, name, status)
            elif uid in self._latest:
                self._wake.set()  # a newer status arrived while this one was on the wire

    async def run(self) -> None:
        await asyncio.gather(*(self._worker() for _ in range(self._workers)))
