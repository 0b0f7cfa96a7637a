"""One asyncio task per job: wake on any event of the job or its pods, plan, act, write status.

Why not kopf.daemon: kopf daemons put a finalizer on the job, so deleting a job would hang while the operator is
down. This task needs none: owner references and the garbage collector remove the job's objects.

Order of effects in one reconcile (each step idempotent, so a crash anywhere is repaired by the next run):
  1. tell the lighthouse about evictions (the most time-critical signal; safe to repeat),
  2. persist status when a generation changed (before pods are touched: a restart is never forgotten),
  3. delete and create pods concurrently (deterministic names; 409/404 tolerated), ensure Services and the
     PodDisruptionBudget, set the worker pods' readiness-gate conditions from the lighthouse's view (readiness.py),
  4. announce starting groups and the desired contributor count to the lighthouse, post Events,
  5. write the aggregated status (coalesced).

What it says to and reads from the lighthouse is job_lighthouse.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Mapping
from typing import Any

import kopf
from ftjob import contract
from ftjob.contract import pki, tls
from ftjob.operator.lighthouse.audit_mirror import AuditMark, AuditMirror
from ftjob.operator.lighthouse.client import LighthouseClient
from ftjob.operator.lighthouse.link import LIGHTHOUSE_POLL_S, RETRY_S, JobLighthouse, declared_generations
from ftjob.operator.lighthouse.view import LighthouseView
from ftjob.operator.planning.integrity_evictions import INTEGRITY_REASONS, integrity_drops, status_integrity
from ftjob.operator.planning.node_health import NodeView, degraded_nodes
from ftjob.operator.planning.node_policy import NodePolicy
from ftjob.operator.planning.plan import SURVIVOR_PHASES, Actions, Observed, Result, plan
from ftjob.operator.planning.stuck import LIGHTHOUSE
from ftjob.operator.reconcile import progress, readiness
from ftjob.operator.reconcile.node_probe import NodeProbe
from ftjob.operator.resources import manifests as builders
from ftjob.operator.resources.kubeapi import KubeApi, api_message
from ftjob.operator.runtime import operator_metrics as metrics
from ftjob.operator.state import names
from ftjob.operator.state.job_spec import JobSpec
from ftjob.operator.state.job_state import JobState, PodView, format_time, parse_time
from ftjob.operator.state.status import build_status, state_from_status, status_events
from kubernetes.client.rest import ApiException

log = logging.getLogger("ftjob.operator.reconcile.job_reconciler")

RESYNC_S = 10.0  # reconcile at least this often even with no events (a level-based safety net)
STATUS_MIN_INTERVAL_S = 0.5
BUDGET_RETRY_S = 60.0  # a refused PodDisruptionBudget write is tried again this much later
BUDGET_REFRESH_S = 300.0  # an unchanged one is written again this often (someone may have deleted it)
ERROR_BACKOFF_S = 2.0


class JobWorker(JobLighthouse):
    def __init__(
        self,
        namespace: str,
        name: str,
        body: dict[str, Any],
        kube: KubeApi,
        lighthouse: LighthouseClient,
        pods: Mapping[Any, Any],
        nodes: Mapping[Any, Any] | None,
        on_phase: Any,
        node_policy: NodePolicy | None = None,
    ) -> None:
        self.namespace, self.name = namespace, name
        self.body = body
        self.kube, self.lighthouse = kube, lighthouse
        self.pod_index, self.node_index = pods, nodes
        self.on_phase = on_phase  # callback(key, phase | None): feeds the jobs-by-condition gauge
        self.node_policy = node_policy or NodePolicy(kube)
        self.node_probe = NodeProbe()
        self.not_answering: set[str] = set()  # nodes last found not answering (a Warning each time one joins)
        self.wake_event = asyncio.Event()
        self.state: JobState | None = None
        self.deleting: set[str] = set()
        # the operator's token for the job's lighthouse, set once the job's Secrets exist (and, with TLS, its CA was
        # read: lh_tls); the workers' token is created here but never read: the operator makes no group's calls
        self.operator_token: str | None = None
        self.lh_tls: ssl.SSLContext | None = None
        self.services_ok: set[str] = set()
        self.budget_applied: dict[str, Any] | None = None  # the PodDisruptionBudget spec last written (None: refused)
        self.budget_due = 0.0  # when to write it again unless its spec changes first (monotonic)
        self.gates_set: dict[str, bool] = {}  # pod -> readiness-gate condition last patched (the index may lag)
        self.gates_warned = False
        self.create_refused: dict[int, str] = {}  # group (or LIGHTHOUSE) -> why the apiserver refused its pod
        self.last_status: dict[str, Any] | None = (body.get("status") or None) and dict(body["status"])
        self.last_status_write = 0.0
        self.audit = AuditMirror(kube, AuditMark.from_status(self.last_status))  # audit records -> Events
        self._init_lighthouse()
        self.task: asyncio.Task[None] | None = None
        self.background: set[asyncio.Task[None]] = set()

    # --- lifecycle --------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name=f"ftjob:{self.namespace}/{self.name}")

    def update(self, body: dict[str, Any]) -> None:
        self.body = body
        self.wake()

    def wake(self) -> None:
        self.wake_event.set()

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
        self.on_phase((self.namespace, self.name), None)
        metrics.forget_job(self.namespace, self.name)

    async def _run(self) -> None:
        delay = 0.0
        while True:
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.wake_event.wait(), timeout=delay)
            self.wake_event.clear()
            started = time.monotonic()
            try:
                delay = await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                kind = f"api{e.status}" if isinstance(e, ApiException) else type(e).__name__
                metrics.RECONCILE_ERRORS.labels(kind).inc()
                log.exception("reconcile of %s/%s failed; retrying in %ss", self.namespace, self.name, ERROR_BACKOFF_S)
                delay = ERROR_BACKOFF_S
            finally:
                metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
            if delay < 0:
                return  # the job is gone

    # --- one reconcile ----------------------------------------------------------------------------------------------
    def _observe(self) -> list[PodView]:
        store = self.pod_index.get((self.namespace, self.name))
        uid = self.body["metadata"].get("uid")
        return [p for p in store or [] if p.owner_uid in (None, uid)]

    def _node_ready(self) -> dict[str, bool] | None:
        if not self.node_index:
            return None  # nodes not watchable (or none yet): never call a node lost on no evidence
        return {name: all(v.ready for v in store) for name, store in self.node_index.items()}

    def _nodes(self) -> dict[str, NodeView]:
        return {name: view for name, store in (self.node_index or {}).items() for view in list(store)[:1]}

    async def _nodes_not_answering(self, pods: list[PodView], node_ready: Mapping[str, bool]) -> set[str]:
        """Nodes still Ready in the API on which every group of this job has left the lighthouse and whose kubelet no
        longer accepts a connection: lost now, not only once the node-monitor grace period marks them NotReady. A
        node with one group of the job still in the lighthouse is never asked."""
        if self.state is None or not (gone := self.silence.gone(self.state)):
            self.not_answering = set()
            return set()
        groups_on: dict[str, set[int]] = {}
        for p in pods:
            group = self.state.groups.get(p.group) if p.group is not None else None
            if group is None or p.generation != group.generation or not p.node or p.phase in ("Succeeded", "Failed"):
                continue
            groups_on.setdefault(p.node, set()).add(group.index)
        suspects = [node for node, groups in groups_on.items() if node_ready.get(node) and groups <= gone]
        lost = await self.node_probe.not_answering(self._nodes(), suspects) if suspects else set()
        for node in sorted(lost - self.not_answering):
            groups = ", ".join(str(g) for g in sorted(groups_on[node]))
            self._event(
                "Warning",
                "NodeNotAnswering",
                f"node {node} does not answer and replica groups {groups} left the lighthouse: replacing them on "
                "other nodes now (Kubernetes still reports the node Ready)",
            )
        self.not_answering = lost
        return lost

    async def reconcile(self) -> float:
        """Returns the delay until the next reconcile (a wake-up comes sooner), or -1 when the job was deleted."""
        body = self.body
        spec = JobSpec.from_dict(body.get("spec") or {})
        if self.state is None:
            self.state = state_from_status(body.get("status"))
        pods = self._observe()
        present = {p.name for p in pods}
        self.deleting &= present
        now = time.time()
        await self._poll_lighthouse(pods, now, force=self._fresh_failure(pods))
        finished = self.lh_view.finished_groups if self.lh_view else set()
        silent = self._silent_groups(spec, now)
        degraded = degraded_nodes(spec.node_health, self._nodes())
        drops = integrity_drops(self.lh_view.integrity_drops, self.lh_view_at) if self.lh_view else {}
        node_ready = self._node_ready()
        if node_ready is not None and (lost := await self._nodes_not_answering(pods, node_ready)):
            node_ready = {**node_ready, **dict.fromkeys(lost, False)}  # lost now, as if NotReady
        obs = Observed(pods, node_ready, set(self.deleting), now, finished, silent, degraded, drops)
        result = plan(self.name, spec, self.state, obs)
        a = result.actions
        lh_base = self._lighthouse_base(pods, self.state)
        if result.state.outcome is not None and self.state.outcome is None:
            await self._poll_lighthouse(pods, now, force=True)  # final steps and digests, before it is stopped

        if a.evict:
            await self._evict(lh_base, a)
        if a.handover:
            await self._handover(lh_base, a.handover)
        for node in a.failed_nodes:
            await self.node_policy.group_failed(node, self.namespace, self.name)
        if self.operator_token is None and result.state.outcome is None:
            await self._ensure_token(spec)
        self.state = result.state
        if a.persist_first:
            await self._write_status(spec, result, pods, force=True)
        refusals_changed = await self._apply_pods(spec, result)
        await self._apply_services(spec, a)
        if result.state.outcome is None:
            await self._apply_budget(spec)
            await self._sync_readiness(pods, result.state, now)
        if a.starting:
            self.pending_starting.update(a.starting)
        retry = await self._tell_lighthouse(self._lighthouse_base(pods, result.state), spec, result)
        for ev in a.events:
            self._event(ev.type, ev.reason, ev.message)
            log.info("%s/%s %s: %s", self.namespace, self.name, ev.reason, ev.message)
        for reason in a.restarts:
            metrics.GROUP_RESTARTS.labels(reason).inc()
            if reason in INTEGRITY_REASONS:
                metrics.INTEGRITY_EVICTIONS.labels(reason).inc()
        for seconds in a.recovered:
            metrics.RECOVERY_SECONDS.observe(seconds)
        status_wait = await self._write_status(spec, result, pods, force=refusals_changed)
        if a.delete_job:
            log.info("%s/%s: ttlSecondsAfterFinished passed; deleting the job", self.namespace, self.name)
            await self.kube.delete_job(self.namespace, self.name)
            return -1
        waits = [RESYNC_S, status_wait]
        if a.requeue_after is not None:
            waits.append(a.requeue_after)
        if retry:
            waits.append(RETRY_S)
        if result.state.outcome is None:
            waits.append(LIGHTHOUSE_POLL_S)
        floor = ERROR_BACKOFF_S if self.create_refused else 0.0  # do not hammer an apiserver that refuses
        return max(floor, min(w for w in waits if w is not None))

    def _event(self, type_: str, reason: str, message: str) -> None:
        task = asyncio.create_task(self.kube.post_event(self.body, type_, reason, message))
        self.background.add(task)  # Events go out without delaying the reconcile
        task.add_done_callback(self.background.discard)

    # --- kubernetes -------------------------------------------------------------------------------------------------
    async def _ensure_token(self, spec: JobSpec) -> None:
        """The job's worker and operator token Secrets and, with TLS, its TLS Secret (each created once, before any pod
        mounts them) and the client context verifying its lighthouse; the operator's token is set only when all are
        ready."""
        await self.kube.create(self._owned(builders.token_secret(self.name, self.namespace)))
        await self.kube.create(self._owned(builders.operator_token_secret(self.name, self.namespace)))
        if spec.tls.enabled:
            await self.kube.create(self._owned(builders.tls_secret(self.name, self.namespace)))
            ca = await self.kube.read_secret_value(self.namespace, names.tls_secret(self.name), pki.CA_CERT)
            if ca is None:
                return
            self.lh_tls = tls.client_context(ca_data=ca)
        self.operator_token = await self.kube.read_secret_value(
            self.namespace, names.operator_token_secret(self.name), contract.TOKEN_SECRET_KEY
        )

    def _owned(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Controller owner reference to the job (blockOwnerDeletion): the garbage collector removes the children
        when the job goes; no finalizer needed. (kopf.adopt would also copy the job's labels; we only want this.)"""
        kopf.append_owner_reference(obj, owner=self.body, controller=True, block_owner_deletion=True)
        return obj

    async def _apply_pods(self, spec: JobSpec, result: Result) -> bool:
        """Deletes and creates pods; True when the refusals of pod creations (quota, admission, an invalid template)
        changed. A refusal is no crash: it becomes the group's status, the Degraded condition and an Event."""
        a, state = result.actions, result.state
        deletes = [self.kube.delete_pod(self.namespace, name, force) for name, force in a.delete_pods]
        self.deleting.update(name for name, _ in a.delete_pods)
        creates: list[tuple[int, Any]] = []
        for group, rank, generation in a.create_pods:
            g = state.groups[group]
            assert g.generation == generation
            pod = self._owned(builders.worker_pod(self.name, self.namespace, spec, g, rank))
            creates.append((group, self.kube.create(pod)))
        if a.create_lighthouse is not None:
            quorum_id, step = self._last_quorum()
            # No group kept the committed state: the new lighthouse must not wait for one, but it still learns the
            # step, so that going on below it is a restore that status, Events and goodput report.
            survivors = any(phase in SURVIVOR_PHASES for phase in result.group_phases.values())
            window = None if survivors else 0.0
            manifest = builders.lighthouse_pod(self.name, self.namespace, spec, a.create_lighthouse, quorum_id, step,
                                               window, declared_generations(state))  # fmt: skip
            creates.append((LIGHTHOUSE, self.kube.create(self._owned(manifest))))
        if not deletes and not creates:
            return False
        results = await asyncio.gather(*deletes, *(job for _, job in creates), return_exceptions=True)
        deleted, created = results[: len(deletes)], results[len(deletes) :]
        before = dict(self.create_refused)
        # a group scaled away is never created again: forget its refusal rather than keep reporting it
        self.create_refused = {g: m for g, m in before.items() if g == LIGHTHOUSE or g in state.groups}
        errors = [r for r in deleted if isinstance(r, BaseException)]
        for (group, _), r in zip(creates, created, strict=True):
            if isinstance(r, ApiException) and 400 <= r.status < 500 and r.status != 409:
                self.create_refused[group] = api_message(r)
            elif isinstance(r, ValueError):  # the client's own validation (pydantic's errors are ValueErrors)
                self.create_refused[group] = f"invalid pod: {r}"
            elif isinstance(r, BaseException):
                errors.append(r)
            else:
                self.create_refused.pop(group, None)
        for group, message in self.create_refused.items():
            if before.get(group) != message:
                who = "the lighthouse" if group == LIGHTHOUSE else f"replica group {group}"
                log.warning("%s/%s: the apiserver refused a pod of %s: %s", self.namespace, self.name, who, message)
                self._event("Warning", "PodCreationRefused", f"the apiserver refused a pod of {who}: {message}")
        if errors:
            self.deleting -= {n for (n, _), r in zip(a.delete_pods, deleted, strict=True) if isinstance(r, Exception)}
            raise errors[0]
        return self.create_refused != before

    def _last_quorum(self) -> tuple[int, int]:
        """The highest quorum id and committed step seen, from the last poll or the status written before (a
        restarted operator has only that), for a replacement lighthouse to start from."""
        seen = (self.last_status or self.body.get("status") or {}).get("quorum") or {}
        view = self.lh_view or LighthouseView()
        quorum_id = max(seen.get("id") or 0, view.quorum_id or 0)
        return quorum_id, max(seen.get("step") or 0, view.step or 0)

    async def _apply_services(self, spec: JobSpec, a: Actions) -> None:
        wanted = [builders.lighthouse_service(self.name, self.namespace)]
        wanted += [builders.group_service(self.name, self.namespace, i) for i in a.group_services]
        todo = [svc for svc in wanted if svc["metadata"]["name"] not in self.services_ok]
        if todo:
            await asyncio.gather(*(self.kube.create(self._owned(svc)) for svc in todo))
            self.services_ok.update(svc["metadata"]["name"] for svc in todo)
        for i in a.delete_group_services:
            name = names.group_service(self.name, i)
            await self.kube.delete_service(self.namespace, name)
            self.services_ok.discard(name)

    async def _apply_budget(self, spec: JobSpec) -> None:
        """The job's PodDisruptionBudget (created with the Services, owned by the job): written when its spec changes
        and every few minutes (level-based: one deleted by hand comes back). A refusal (e.g. RBAC without
        policy/poddisruptionbudgets) is logged and retried a minute later: the job trains on, only a drain is not held
        up for it."""
        budget = builders.pod_disruption_budget(self.name, self.namespace, spec)
        now = time.monotonic()
        if now < self.budget_due and (self.budget_applied is None or self.budget_applied == budget["spec"]):
            return
        try:
            await self.kube.apply_disruption_budget(self._owned(budget))
        except ApiException as e:
            self.budget_applied, self.budget_due = None, now + BUDGET_RETRY_S
            log.warning("%s/%s: no PodDisruptionBudget (%s): a drain may evict groups before their replacement took "
                        "over", self.namespace, self.name, api_message(e))  # fmt: skip
            return
        self.budget_applied, self.budget_due = budget["spec"], now + BUDGET_REFRESH_S

    async def _sync_readiness(self, pods: list[PodView], state: JobState, now: float) -> None:
        """Sets each worker pod's readiness-gate condition from the lighthouse's view (operator/reconcile/readiness.py):
        the pods leaving the quorum first, then those joining it, so the budget never counts two generations of a group.
        Only from a fresh view of the current lighthouse: without one nothing changes (a Ready pod stays Ready, and
        the budget keeps holding a drain until the lighthouse is back)."""
        view = self.lh_view
        fresh = view is not None and now - self.lh_view_at <= 3 * LIGHTHOUSE_POLL_S
        if not fresh or view is None or self.lh_view_generation != state.lighthouse_generation:
            return
        shown = {p.name: bool(p.in_quorum) for p in pods}
        self.gates_set = {n: v for n, v in self.gates_set.items() if n in shown and shown[n] != v}  # still lagging
        todo = [c for c in readiness.gate_changes(view, pods) if self.gates_set.get(c.pod) != c.in_quorum]
        stamp = format_time(now) or ""
        for joining in (False, True):
            batch = [c for c in todo if c.in_quorum == joining]
            results = await asyncio.gather(
                *(self.kube.set_pod_condition(self.namespace, c.pod, readiness.condition(c, stamp)) for c in batch),
                return_exceptions=True,
            )
            for change, r in zip(batch, results, strict=True):
                if isinstance(r, BaseException):
                    if not self.gates_warned:  # e.g. RBAC without pods/status patch: pods stay un-Ready, say so once
                        self.gates_warned = True
                        log.warning("%s/%s: cannot set pod %s's %s condition: %s", self.namespace, self.name,
                                    change.pod, contract.CONDITION_IN_QUORUM, r)  # fmt: skip
                    continue
                self.gates_set[change.pod] = change.in_quorum

    async def _write_status(self, spec: JobSpec, result: Result, pods: list[PodView], force: bool) -> float | None:
        """Write status if it changed; unless forced, at most every STATUS_MIN_INTERVAL_S (returns the wait)."""
        now = time.time()
        created = parse_time(self.body["metadata"].get("creationTimestamp")) or now
        prog = progress.track(self.last_status, self.lh_view, self.lh_view_at, spec, result.state,
                              result.group_phases, created, now)  # fmt: skip
        status = build_status(
            job=self.name,
            spec=spec,
            state=result.state,
            phases=result.group_phases,
            pods=pods,
            lighthouse=self.lh_view,
            previous=self.last_status,
            generation=self.body["metadata"].get("generation"),
            now=now,
            create_refused=dict(self.create_refused),
            goodput=prog.goodput,
            history=prog.history,
            integrity=status_integrity(
                (self.last_status or {}).get("integrity"),
                self.lh_view.integrity if self.lh_view else None,
                self.lh_view_generation,
                self.audit.mark.seq,
            ),
        )
        if status == self.last_status:
            return None
        wait = self.last_status_write + STATUS_MIN_INTERVAL_S - time.monotonic()
        if not force and wait > 0:
            return wait
        patch = dict(status)
        for key in self.last_status or {}:
            patch.setdefault(key, None)  # a merge patch removes fields we no longer report
        await self.kube.patch_status(self.namespace, self.name, patch)
        for type_, reason, message in status_events(self.last_status, status):
            self._event(type_, reason, message)
        self.last_status = status
        self.last_status_write = time.monotonic()
        metrics.set_job_progress(self.namespace, self.name, prog.goodput, prog.groups, prog.step, prog.quorum)
        self.on_phase((self.namespace, self.name), status["phase"])
        return None
