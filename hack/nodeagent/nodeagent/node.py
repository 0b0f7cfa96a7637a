"""The Node object: registration, a Lease heartbeat (every ~2 s) and periodic status with a Ready condition."""

from __future__ import annotations

import asyncio
import logging
import platform

from .config import AgentConfig
from .kubeapi import ApiError, KubeClient
from .timeutil import now_micro, now_rfc3339

log = logging.getLogger("nodeagent.node")

LEASE_NS = "kube-node-lease"
LEASE_DURATION_S = 40
AGENT_VERSION = "v1.36.3-ftjob"


def node_resources(cfg: AgentConfig) -> dict:
    res = {"cpu": cfg.cpu, "memory": cfg.memory, "pods": str(cfg.max_pods), "ephemeral-storage": "100Gi"}
    if cfg.gpus:
        res["nvidia.com/gpu"] = str(cfg.gpus)
    return res


def node_status(cfg: AgentConfig, ready: bool = True) -> dict:
    now = now_rfc3339()

    def cond(kind: str, status: str, reason: str, message: str) -> dict:
        return {
            "type": kind,
            "status": status,
            "reason": reason,
            "message": message,
            "lastHeartbeatTime": now,
            "lastTransitionTime": now,
        }

    return {
        "capacity": node_resources(cfg),
        "allocatable": node_resources(cfg),
        "addresses": [{"type": "InternalIP", "address": cfg.node_ip}, {"type": "Hostname", "address": cfg.node_name}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": cfg.kubelet_port}},
        "conditions": [
            cond("MemoryPressure", "False", "KubeletHasSufficientMemory", "ftjob node agent has memory"),
            cond("DiskPressure", "False", "KubeletHasNoDiskPressure", "ftjob node agent has disk"),
            cond("PIDPressure", "False", "KubeletHasSufficientPID", "ftjob node agent has PIDs"),
            cond("Ready", "True" if ready else "False", "KubeletReady", "ftjob node agent is posting ready status"),
        ],
        "nodeInfo": {
            "machineID": cfg.node_name,
            "systemUUID": cfg.node_name,
            "bootID": cfg.node_name,
            "kernelVersion": platform.release(),
            "osImage": "ftjob process node",
            "containerRuntimeVersion": "ftjob://0.1",
            "kubeletVersion": AGENT_VERSION,
            "kubeProxyVersion": "",
            "operatingSystem": "linux",
            "architecture": "amd64",
        },
    }


class NodeHeartbeat:
    def __init__(
        self, client: KubeClient, cfg: AgentConfig, lease_every_s: float = 2.0, status_every_s: float = 10.0
    ) -> None:
        self.client = client
        self.cfg = cfg
        self.lease_every_s = lease_every_s
        self.status_every_s = status_every_s
        self.node_uid = ""
        self._transition: dict[str, tuple[str, str]] = {}

    async def register(self) -> None:
        name = self.cfg.node_name
        body = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": name,
                "labels": {
                    "kubernetes.io/hostname": name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "ftjob.dev/process-node": "true",
                },
            },
            "spec": {"podCIDR": self.cfg.pod_cidr, "podCIDRs": [self.cfg.pod_cidr]},
        }
        try:
            node = await self.client.post("/api/v1/nodes", body)
            log.info("registered node %s", name)
        except ApiError as e:
            if e.status != 409:
                raise
            node = await self.client.get(f"/api/v1/nodes/{name}")
            log.info("node %s already registered; taking it over", name)
        self.node_uid = node["metadata"]["uid"]
        await self.post_status()

    async def post_status(self) -> None:
        status = node_status(self.cfg)
        for cond in status["conditions"]:
            prev = self._transition.get(cond["type"])
            if prev and prev[0] == cond["status"]:
                cond["lastTransitionTime"] = prev[1]
            self._transition[cond["type"]] = (cond["status"], cond["lastTransitionTime"])
        await self.client.patch(f"/api/v1/nodes/{self.cfg.node_name}/status", {"status": status}, strategic=True)

    async def renew_lease(self) -> None:
        name = self.cfg.node_name
        path = f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NS}/leases/{name}"
        spec = {"holderIdentity": name, "leaseDurationSeconds": LEASE_DURATION_S, "renewTime": now_micro()}
        try:
            await self.client.patch(path, {"spec": spec})
        except ApiError as e:
            if e.status != 404:
                raise
            owner = [{"apiVersion": "v1", "kind": "Node", "name": name, "uid": self.node_uid}]
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": name, "namespace": LEASE_NS, "ownerReferences": owner},
                "spec": spec,
            }
            await self.client.post(f"/apis/coordination.k8s.io/v1/namespaces/{LEASE_NS}/leases", body)

    async def run(self) -> None:
        since_status = 0.0
        while True:
            try:
                await self.renew_lease()
                if since_status >= self.status_every_s:
                    await self.post_status()
                    since_status = 0.0
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("node heartbeat failed: %s", e)
                if isinstance(e, ApiError) and e.status == 404 and "nodes" in str(e):
                    await self.register()  # someone deleted our Node: register again
            await asyncio.sleep(self.lease_every_s)
            since_status += self.lease_every_s
