"""The set of running JobWorkers, keyed by (namespace, name); kopf handlers feed it events."""

from __future__ import annotations

import collections
import logging
from collections.abc import Mapping
from typing import Any

from ftjob.operator.lighthouse.client import LighthouseClient
from ftjob.operator.planning.node_policy import NodePolicy
from ftjob.operator.reconcile.job_reconciler import JobWorker
from ftjob.operator.resources.kubeapi import KubeApi
from ftjob.operator.runtime import operator_metrics as metrics

log = logging.getLogger("ftjob.operator.reconcile.job_registry")
Key = tuple[str, str]


class JobRegistry:
    def __init__(self, kube: KubeApi, node_policy: NodePolicy | None = None) -> None:
        self.kube = kube
        self.node_policy = node_policy or NodePolicy(kube)
        self.lighthouse = LighthouseClient()
        self.workers: dict[Key, JobWorker] = {}
        self.pod_index: Mapping[Any, Any] = {}
        self.node_index: Mapping[Any, Any] | None = None
        self.phases: dict[Key, str] = {}

    def bind_indexes(self, pods: Mapping[Any, Any], nodes: Mapping[Any, Any] | None) -> None:
        """kopf passes its indexes to handlers as live views; workers read them directly."""
        self.pod_index, self.node_index = pods, nodes
        for w in self.workers.values():
            w.pod_index, w.node_index = pods, nodes

    async def upsert(self, key: Key, body: dict[str, Any]) -> None:
        worker = self.workers.get(key)
        if worker is not None and worker.body["metadata"].get("uid") != body["metadata"].get("uid"):
            log.info("job %s/%s was recreated; starting afresh", *key)
            await self.remove(key)
            worker = None
        if worker is None:
            worker = JobWorker(key[0], key[1], body, self.kube, self.lighthouse, self.pod_index, self.node_index,
                               self._phase_changed, self.node_policy)  # fmt: skip
            self.workers[key] = worker
            worker.start()
            log.info("watching job %s/%s", *key)
        else:
            worker.update(body)

    async def remove(self, key: Key) -> None:
        worker = self.workers.pop(key, None)
        if worker is not None:
            await worker.stop()
            log.info("stopped job %s/%s", *key)

    def wake(self, key: Key) -> None:
        worker = self.workers.get(key)
        if worker is not None:
            worker.wake()

    def wake_all(self) -> None:
        for worker in self.workers.values():
            worker.wake()

    async def close(self) -> None:
        for key in list(self.workers):
            await self.remove(key)
        await self.lighthouse.close()

    def _phase_changed(self, key: Key, phase: str | None) -> None:
        if phase is None:
            self.phases.pop(key, None)
        else:
            self.phases[key] = phase
        counts = collections.Counter(self.phases.values())
        for condition in ("Created", "Running", "Degraded", "Recovering", "Suspended", "Succeeded", "Failed"):
            metrics.JOBS.labels(condition).set(counts.get(condition, 0))
