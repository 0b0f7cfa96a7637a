"""kopf registrations: indexes of the jobs' pods and of node readiness (the observed state), and event handlers
that wake the affected job's worker at once. No change handlers: kopf never patches our objects, and no finalizer
is ever added (see worker.py)."""

from __future__ import annotations

import copy
import logging
from typing import Any

import kopf
from ftjob import contract
from ftjob.operator.planning.node_health import NodeView
from ftjob.operator.reconcile.job_registry import JobRegistry
from ftjob.operator.state.job_state import PodView

REGISTRY = kopf.OperatorRegistry()
MANAGED = {contract.LABEL_MANAGED_BY: contract.MANAGED_BY}
JOB = (contract.API_GROUP, contract.API_VERSION, contract.PLURAL)
PREFIX = contract.API_GROUP  # kopf's own annotations live under ftjob.dev/, not kopf.zalando.org/


@kopf.on.startup(registry=REGISTRY)
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=PREFIX, key="last-handled-configuration"
    )
    settings.persistence.finalizer = f"{PREFIX}/finalizer"
    # A silent watch stream must not hide events for long: reconnect every few minutes, fail fast on dead TCP.
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.watching.connect_timeout = 10
    settings.posting.enabled = False  # we post our own Events; kopf's per-log-line Events would flood pods
    # No namespace/CRD scanning: nothing to list cluster-wide (least privilege). app.py checks the CRD is served.
    settings.scanning.disabled = True
    settings.networking.request_timeout = 30
    settings.execution.max_workers = 8


@kopf.on.login(registry=REGISTRY)
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    return kopf.login_via_client(**kwargs)


# Every handler is async: kopf runs sync handlers on a thread pool, and waking a worker (asyncio.Event.set) is only
# safe on the event loop; the pure index functions are cheap enough to run inline too.
@kopf.index("pods", labels=MANAGED, registry=REGISTRY)
async def ftjob_pods(
    namespace: str, meta: Any, spec: Any, status: Any, labels: Any, **_: Any
) -> dict[tuple[str, str], PodView] | None:
    job = labels.get(contract.LABEL_JOB)
    if not job:
        return None
    return {(namespace, job): PodView.from_pod(_plain(meta), _plain(spec), _plain(status))}


@kopf.index("nodes", registry=REGISTRY)
async def ftjob_nodes(name: str, spec: Any, status: Any, **_: Any) -> dict[str, NodeView]:
    return {name: NodeView.from_node(_plain(spec), _plain(status))}


@kopf.on.event("pods", labels=MANAGED, registry=REGISTRY)
async def pod_event(namespace: str, labels: Any, memo: kopf.Memo, **_: Any) -> None:
    job = labels.get(contract.LABEL_JOB)
    if job:
        _jobs(memo).wake((namespace, job))


@kopf.on.event("nodes", registry=REGISTRY)
async def node_event(name: str, spec: Any, status: Any, memo: kopf.Memo, logger: logging.Logger, **_: Any) -> None:
    view = NodeView.from_node(_plain(spec), _plain(status))
    # what decides lost / degrading: readiness, cordon, taints, and condition types + statuses (not heartbeat times)
    facts = (view.ready, view.unschedulable, view.taints, tuple((t, s) for t, s, _ in view.conditions))
    seen: dict[str, Any] = memo.setdefault("node_ready_seen", {})
    if seen.get(name) != facts:
        if seen.get(name) is None or seen[name][0] != view.ready:
            logger.info("node %s ready=%s", name, view.ready)
        seen[name] = facts
        _jobs(memo).wake_all()


@kopf.on.event(*JOB, registry=REGISTRY)
async def job_event(
    event: dict[str, Any],
    body: Any,
    namespace: str,
    name: str,
    memo: kopf.Memo,
    ftjob_pods: kopf.Index[Any, Any],
    ftjob_nodes: kopf.Index[Any, Any],
    **_: Any,
) -> None:
    jobs = _jobs(memo)
    jobs.bind_indexes(ftjob_pods, ftjob_nodes)
    if event.get("type") == "DELETED" or body.get("metadata", {}).get("deletionTimestamp"):
        await jobs.remove((namespace, name))
        return
    await jobs.upsert((namespace, name), _plain(body))


def _jobs(memo: kopf.Memo) -> JobRegistry:
    return memo["jobs"]


def _plain(view: Any) -> dict[str, Any]:
    """A detached plain copy of a kopf body view (the worker keeps it beyond the handler call)."""
    return copy.deepcopy(dict(view)) if view is not None else {}
