"""The few Kubernetes writes the operator makes, async and idempotent (create-if-absent, delete-if-present).

The official client is synchronous; calls run on a bounded thread pool so a 1,024-pod job is created with many
requests in flight. Responses of creates are not deserialised (`_preload_content=False`): that is most of the
client-side cost of a pod create and nothing here needs the returned object.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import json
import logging
import os
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ftjob import contract
from kubernetes import client, config
from kubernetes.client.rest import ApiException

log = logging.getLogger("ftjob.operator.kube")
T = TypeVar("T")
MAX_IN_FLIGHT = 32
REQUEST_TIMEOUT_S = 30


def load_client(kubeconfig: str | None = None) -> client.ApiClient:
    """In-cluster config inside a pod, else the kubeconfig (KUBECONFIG or the default path)."""
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("KUBECONFIG"):
        config.load_incluster_config()
        cfg = client.Configuration.get_default_copy()
    else:
        cfg = client.Configuration()
        config.load_kube_config(config_file=kubeconfig, client_configuration=cfg)
    cfg.connection_pool_maxsize = MAX_IN_FLIGHT
    return client.ApiClient(cfg)


def api_message(e: ApiException) -> str:
    """The apiserver's own sentence (its Status message), e.g. 'pods "x" is forbidden: exceeded quota: ...'."""
    try:
        message = json.loads(e.body or "{}").get("message")
    except (ValueError, AttributeError):
        message = None
    return f"{e.status} {e.reason}: {message or e.body or ''}".strip()


class KubeApi:
    def __init__(self, api: client.ApiClient) -> None:
        self.api = api
        self.core = client.CoreV1Api(api)
        self.policy = client.PolicyV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.pool = ThreadPoolExecutor(max_workers=MAX_IN_FLIGHT, thread_name_prefix="kube")

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        kwargs.setdefault("_request_timeout", REQUEST_TIMEOUT_S)  # a hung connection must not stall a reconcile
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))

    # --- create-if-absent -------------------------------------------------------------------------------------------
    async def create(self, obj: dict[str, Any]) -> bool:
        """Create a namespaced Pod/Service/Secret/PodDisruptionBudget; False when it already exists (a retry or
        another replica)."""
        ns, kind = obj["metadata"]["namespace"], obj["kind"]
        fn = {
            "Pod": self.core.create_namespaced_pod,
            "Service": self.core.create_namespaced_service,
            "Secret": self.core.create_namespaced_secret,
            "PodDisruptionBudget": self.policy.create_namespaced_pod_disruption_budget,
        }[kind]
        try:
            await self._call(fn, ns, obj, _preload_content=False)
            return True
        except ApiException as e:
            if e.status == 409:
                return False
            raise

    async def apply_disruption_budget(self, obj: dict[str, Any]) -> None:
        """Create the PodDisruptionBudget, or bring an existing one's spec to ``obj``'s (a scaled job, a changed
        nodeHealth, one made by an older operator)."""
        if await self.create(obj):
            return
        meta = obj["metadata"]
        await self._call(
            self.policy.patch_namespaced_pod_disruption_budget,
            meta["name"],
            meta["namespace"],
            {"spec": obj["spec"]},
            _preload_content=False,
        )

    async def set_pod_condition(self, namespace: str, name: str, condition: dict[str, Any]) -> bool:
        """Set one condition of a pod's status (a strategic merge: conditions merge by type, the others stay); the
        readiness gate's. False when the pod is gone."""
        try:
            await self._call(
                self.core.patch_namespaced_pod_status,
                name,
                namespace,
                {"status": {"conditions": [condition]}},
                _preload_content=False,
            )
            return True
        except ApiException as e:
            if e.status == 404:
                return False
            raise

    # --- delete-if-present ------------------------------------------------------------------------------------------
    async def delete_pod(self, namespace: str, name: str, force: bool) -> bool:
        """Force (grace 0) is for pods whose node will never confirm the deletion (NotReady/gone, stuck)."""
        body = client.V1DeleteOptions(grace_period_seconds=0 if force else None, propagation_policy="Background")
        try:
            await self._call(self.core.delete_namespaced_pod, name, namespace, body=body, _preload_content=False)
            return True
        except ApiException as e:
            if e.status == 404:
                return False
            raise

    async def delete_service(self, namespace: str, name: str) -> None:
        try:
            await self._call(self.core.delete_namespaced_service, name, namespace, _preload_content=False)
        except ApiException as e:
            if e.status != 404:
                raise

    async def delete_job(self, namespace: str, name: str) -> None:
        try:
            await self._call(
                self.custom.delete_namespaced_custom_object,
                contract.API_GROUP,
                contract.API_VERSION,
                namespace,
                contract.PLURAL,
                name,
                propagation_policy="Background",
            )
        except ApiException as e:
            if e.status != 404:
                raise

    async def crd_served(self) -> bool:
        """True when the apiserver serves our resource (API discovery needs no extra permission)."""
        try:
            resources = await self._call(self.custom.get_api_resources, contract.API_GROUP, contract.API_VERSION)
        except ApiException as e:
            if e.status == 404:
                return False
            raise
        return any(r.name == contract.PLURAL for r in resources.resources or [])

    # --- reads and status -------------------------------------------------------------------------------------------
    async def read_secret_value(self, namespace: str, name: str, key: str) -> str | None:
        import base64

        try:
            secret = await self._call(self.core.read_namespaced_secret, name, namespace)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        raw = (secret.data or {}).get(key)
        return base64.b64decode(raw).decode() if raw else None

    async def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Merge-patch .status (lists are replaced whole; a None value removes a field)."""
        await self._call(
            self.custom.patch_namespaced_custom_object_status,
            contract.API_GROUP,
            contract.API_VERSION,
            namespace,
            contract.PLURAL,
            name,
            {"status": status},
            _preload_content=False,
        )

    async def post_event(
        self, job: dict[str, Any], type_: str, reason: str, message: str, name: str | None = None
    ) -> bool:
        """A core/v1 Event on the job (what `kubectl describe ftj` shows). Best effort: never fails a reconcile.
        With a `name`, posting it again is a no-op (409). True when the Event exists now."""
        meta = job["metadata"]
        now = dt.datetime.now(dt.UTC)
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": name or f"{meta['name']}.{uuid.uuid4().hex[:12]}", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": f"{contract.API_GROUP}/{contract.API_VERSION}",
                "kind": contract.KIND,
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": contract.MANAGED_BY},
            "firstTimestamp": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "lastTimestamp": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "count": 1,
        }
        try:
            await self._call(self.core.create_namespaced_event, meta["namespace"], event, _preload_content=False)
        except ApiException as e:
            if name is not None and e.status == 409:
                return True  # posted before (a repeated mirror of the same record)
            log.warning("could not post event %s on %s: %s", reason, meta["name"], e)
            return False
        except Exception as e:  # an Event is a courtesy; the status carries the truth
            log.warning("could not post event %s on %s: %s", reason, meta["name"], e)
            return False
        return True

    async def cordon_node(self, name: str) -> bool:
        try:
            await self._call(self.core.patch_node, name, {"spec": {"unschedulable": True}})
            return True
        except Exception as e:  # RBAC without nodes/patch, or the node is gone: say so, keep reconciling
            log.warning("could not cordon node %s: %s", name, e)
            return False

    async def post_node_event(self, namespace: str, node: str, type_: str, reason: str, message: str) -> None:
        """An Event about a Node, in a namespace the operator may write Events in (the job's)."""
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{node}.{uuid.uuid4().hex[:12]}", "namespace": namespace},
            "involvedObject": {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node},
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": contract.MANAGED_BY},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        try:
            await self._call(self.core.create_namespaced_event, namespace, event, _preload_content=False)
        except Exception as e:
            log.warning("could not post event %s on node %s: %s", reason, node, e)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.api.close()
