"""The agent: registers the node, watches pods and services, runs this node's pods, serves their logs."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import time

from .background import background
from .config import AgentConfig
from .context import NodeContext
from .dns import DnsWriter, dns_signature, service_signature
from .kubeapi import Informer, KubeClient
from .logserver import LogServer, latest_log
from .network import IpAllocator, PodNet, teardown_pod_network
from .node import NodeHeartbeat
from .podstatus import StatusSyncer
from .podworker import PodWorker
from .process import process_start_time
from .state import PodRecord
from .volumes import ObjectSource

log = logging.getLogger("nodeagent")


def _kill_recorded(rec: PodRecord) -> None:
    for c in rec.containers.values():
        if c.start_time is not None and process_start_time(c.pid) == c.start_time:
            try:
                os.killpg(c.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


class Agent:
    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.client = KubeClient.from_kubeconfig(cfg.kubeconfig, server=cfg.api_server, ca_file=cfg.ca_file)
        # The node identity may list only its own pods, so DNS (which needs every pod) reads with another credential.
        dns_kubeconfig = cfg.dns_kubeconfig_path
        if dns_kubeconfig:
            self.dns_client = KubeClient.from_kubeconfig(dns_kubeconfig, server=cfg.api_server)
        else:
            log.warning("no dns_kubeconfig: pod DNS names will cover only this node's pods")
            self.dns_client = self.client
        own = {"fieldSelector": f"spec.nodeName={cfg.node_name}"}
        self.pods = Informer(self.client, "/api/v1/pods", self.on_pod, params=own, name="pods")
        self.all_pods = (
            Informer(self.dns_client, "/api/v1/pods", self.on_any_pod, name="all-pods") if dns_kubeconfig else None
        )
        self.services = Informer(self.dns_client, "/api/v1/services", self.on_service, name="services")
        self.ctx = NodeContext(
            config=cfg,
            client=self.client,
            objects=ObjectSource(self.client),
            dns=DnsWriter(
                cfg.cluster_domain,
                lambda: self.services.store.values(),
                lambda: self._dns_pods().values(),
                shared_dir=cfg.state_dir / "dns",
            ),
            status=StatusSyncer(self.client),
            ips=IpAllocator(cfg.pod_cidr, cfg.pod_gateway),
            setup_slots=asyncio.Semaphore(8),
        )
        self.heartbeat = NodeHeartbeat(self.client, cfg)
        self.workers: dict[str, PodWorker] = {}  # by pod UID
        self.by_name: dict[tuple[str, str], str] = {}
        self.records: dict[str, PodRecord] = {}

    # --- events -----------------------------------------------------------------------------------------------
    def on_service(self, kind: str, svc: dict, old: dict | None) -> None:
        if kind != "MODIFIED" or old is None or service_signature(old) != service_signature(svc):
            self.ctx.dns.mark_dirty()

    def _dns_pods(self) -> dict[str, dict]:
        return (self.all_pods or self.pods).store

    def on_any_pod(self, kind: str, pod: dict, old: dict | None) -> None:
        if kind != "MODIFIED" or old is None or dns_signature(old) != dns_signature(pod):
            self.ctx.dns.mark_dirty()

    def on_pod(self, kind: str, pod: dict, old: dict | None) -> None:
        if self.all_pods is None:
            self.on_any_pod(kind, pod, old)
        if pod.get("spec", {}).get("nodeName") != self.cfg.node_name:
            return
        meta = pod["metadata"]
        uid = meta["uid"]
        worker = self.workers.get(uid)
        if kind == "DELETED":
            if worker is not None:
                self._stop_worker(worker, 0, object_gone=True)  # force-deleted: no grace left
            else:
                self._forget_record(uid)
            return
        if worker is None:
            worker = self._new_worker(pod)
        if meta.get("deletionTimestamp"):
            self._stop_worker(worker, meta.get("deletionGracePeriodSeconds"))

    def _stop_worker(self, worker: PodWorker, grace_s: float | None, object_gone: bool = False) -> None:
        if worker.request_delete(grace_s, object_gone):
            worker.on_deleted(lambda: self._drop(worker.uid))

    def _new_worker(self, pod: dict) -> PodWorker:
        meta = pod["metadata"]
        uid = meta["uid"]
        record = self.records.pop(uid, None)
        phase = pod.get("status", {}).get("phase")
        finished = phase in ("Succeeded", "Failed") or (record is not None and record.phase in ("Succeeded", "Failed"))
        if finished and record is not None:
            _kill_recorded(record)
            background(teardown_pod_network(PodNet(record.netns, record.host_veth, record.ip)))
        worker = PodWorker(self.ctx, pod, record=record, finished=finished)
        self.workers[uid] = worker
        self.by_name[(meta["namespace"], meta["name"])] = uid
        if not finished and not meta.get("deletionTimestamp"):
            worker.start()
            log.info("pod %s/%s: starting", meta["namespace"], meta["name"])
        return worker

    def _drop(self, uid: str) -> None:
        worker = self.workers.pop(uid, None)
        if worker and self.by_name.get((worker.namespace, worker.name)) == uid:
            del self.by_name[(worker.namespace, worker.name)]

    def _forget_record(self, uid: str) -> None:
        rec = self.records.pop(uid, None)
        if rec is not None:
            _kill_recorded(rec)
            background(teardown_pod_network(PodNet(rec.netns, rec.host_veth, rec.ip)))
            shutil.rmtree(self.cfg.pods_dir / uid, ignore_errors=True)

    # --- logs -------------------------------------------------------------------------------------------------
    def locate_log(self, ns: str, pod: str, container: str, previous: bool):
        uid = self.by_name.get((ns, pod))
        worker = self.workers.get(uid or "")
        if worker is None:
            return None
        path = latest_log(worker.dir / "logs" / container, previous)
        running = any(r.name == container and r.proc is not None for r in [*worker.init_runners, *worker.runners])
        return path, running

    # --- main -------------------------------------------------------------------------------------------------
    def _load_records(self) -> None:
        self.cfg.pods_dir.mkdir(parents=True, exist_ok=True)
        for pod_dir in self.cfg.pods_dir.iterdir():
            rec = PodRecord.load(pod_dir)
            if rec is not None:
                self.records[rec.uid] = rec
                if rec.ip:
                    self.ctx.ips.reserve(rec.ip)
            else:
                shutil.rmtree(pod_dir, ignore_errors=True)
        if self.records:
            log.info("found %d pod record(s) from a previous run", len(self.records))

    @staticmethod
    async def _wait_synced(informer: Informer) -> None:
        """Waits for an informer's first list, saying so every 10 s (its own log says why it cannot list)."""
        while True:
            try:
                await asyncio.wait_for(informer.synced.wait(), timeout=10)
                return
            except TimeoutError:
                log.warning("still waiting for the first list of %s", informer.name)

    async def run(self) -> None:
        self._load_records()
        await self.heartbeat.register()
        tasks = [
            asyncio.create_task(self.heartbeat.run(), name="heartbeat"),
            asyncio.create_task(self.ctx.status.run(), name="status"),
            asyncio.create_task(self.ctx.dns.run(), name="dns"),
            asyncio.create_task(self.services.run(), name="services"),
        ]
        if self.all_pods is not None:
            tasks.append(asyncio.create_task(self.all_pods.run(), name="all-pods"))
            await self._wait_synced(self.all_pods)
        await self._wait_synced(self.services)
        tasks.append(asyncio.create_task(self.pods.run(), name="pods"))
        await self._wait_synced(self.pods)
        # Records whose pod no longer exists: kill what is left of them and free their network.
        for uid in list(self.records):
            log.info(
                "cleaning up pod %s/%s (gone while the agent was down)",
                self.records[uid].namespace,
                self.records[uid].name,
            )
            self._forget_record(uid)
        server = None
        if self.cfg.serving_cert and self.cfg.client_ca_file:
            server = LogServer(
                self.locate_log,
                self.cfg.node_ip,
                self.cfg.kubelet_port,
                self.cfg.serving_cert,
                self.cfg.serving_key,
                self.cfg.client_ca_file,
            )
            await server.start()
        log.info("node %s ready: %d pod(s) on this node", self.cfg.node_name, len(self.workers))
        # Tells tools and tests that *this* agent process has registered, reconciled and serves (the Node's Ready
        # condition alone cannot: a restarted agent finds it already True).
        ready = {"pid": os.getpid(), "pods": len(self.workers), "since": time.time()}
        (self.cfg.state_dir / "agent-ready.json").write_text(json.dumps(ready), encoding="utf-8")
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for t in done:
                t.result()
        finally:
            for t in tasks:
                t.cancel()
            if server is not None:
                await server.stop()
            await self.client.close()
