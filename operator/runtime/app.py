"""Runs the operator: metrics and health endpoints, leader election, then kopf with our registry.

Only the Lease holder runs kopf (and so acts). If leadership is lost the process exits non-zero: its in-memory view
is dropped and a supervisor restarts it as a standby, while the new leader rebuilds everything from the API.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import kopf
from ftjob import contract
from ftjob.operator.planning.node_policy import NodePolicy
from ftjob.operator.reconcile.handlers import REGISTRY
from ftjob.operator.reconcile.job_registry import JobRegistry
from ftjob.operator.resources.kubeapi import KubeApi, load_client
from ftjob.operator.runtime import health
from ftjob.operator.runtime import operator_metrics as metrics
from ftjob.operator.runtime.leader import LeaderElector, LeaseConfig
from ftjob.operator.runtime.settings import Settings

log = logging.getLogger("ftjob.operator")
EXIT_LOST_LEADERSHIP = 3


async def run(settings: Settings) -> int:
    """Runs the operator until SIGINT or SIGTERM: metrics and health servers, the leader Lease when enabled, then
    kopf's reconcile loop while leader. Returns the exit code (2: the CRD is not served)."""
    api = load_client(settings.kubeconfig)
    kube = KubeApi(api)
    elector: LeaderElector | None = None
    if settings.leader_election:
        d = settings.lease_duration_s
        cfg = LeaseConfig(settings.lease_name, settings.lease_namespace, settings.identity, d, d * 2 / 3, d / 5)
        elector = LeaderElector(api, cfg)
    metrics.serve(settings.metrics_port)
    health_runner = await health.serve(settings.health_port, lambda: elector.is_leader if elector else True)
    scope = "all namespaces" if settings.all_namespaces else ", ".join(settings.namespaces)
    log.info("ftjob-operator %s starting for %s", settings.identity, scope)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    code = 0
    jobs = JobRegistry(kube, NodePolicy(kube, settings.cordon_after_failures, settings.cordon_window_s))
    try:
        if not await kube.crd_served():
            log.error(
                "the apiserver does not serve %s/%s %s: install the CRD first "
                "(kubectl apply -f crds/ftjob.dev_faulttoleranttrainingjobs.yaml)",
                contract.API_GROUP, contract.API_VERSION, contract.PLURAL,
            )  # fmt: skip
            return 2
        if elector is not None:
            acquiring = asyncio.create_task(elector.acquire())
            stopping = asyncio.create_task(stop.wait())
            await asyncio.wait({acquiring, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if not acquiring.done():
                acquiring.cancel()
                return 0
        metrics.IS_LEADER.set(1)
        log.info("acting as leader: reconciling jobs")
        operator = asyncio.create_task(
            kopf.operator(
                registry=REGISTRY,
                clusterwide=settings.all_namespaces,
                namespaces=list(settings.namespaces),
                standalone=True,  # kopf peering freezes equal-priority peers; the Lease decides instead
                # our own name: kopf's default asks the passwd database, which has no entry for the image's uid
                identity=settings.identity,  # type: ignore[arg-type]  # kopf.Identity is a NewType of str
                memo=kopf.Memo(jobs=jobs, node_ready_seen={}),
                stop_flag=stop,
            )
        )
        waiters = {operator}
        keeper = asyncio.create_task(elector.keep()) if elector else None
        if keeper:
            waiters.add(keeper)
        done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        if keeper in done:
            code = EXIT_LOST_LEADERSHIP
            stop.set()
        try:
            await operator
        except Exception:
            log.exception("kopf stopped with an error")
            code = code or 1
        if keeper and not keeper.done():
            keeper.cancel()
    finally:
        metrics.IS_LEADER.set(0)
        await jobs.close()
        if elector is not None and elector.is_leader:
            await asyncio.to_thread(elector.release)
        if health_runner is not None:
            await health_runner.cleanup()
        kube.close()
    return code
