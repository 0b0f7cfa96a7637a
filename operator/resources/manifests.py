"""Manifests (plain dicts) of everything the operator creates for a job. Pure: the same inputs give the same object.

Owner references are added by the caller (kopf.adopt) so these stay testable without a job body.
"""

from __future__ import annotations

import copy
import math
import secrets
from collections.abc import Mapping
from typing import Any

from ftjob import contract
from ftjob.contract import pki
from ftjob.operator.state import names
from ftjob.operator.state.job_spec import JobSpec
from ftjob.operator.state.job_state import GroupState
from kubernetes.utils import parse_quantity

HOSTNAME_LABEL = "kubernetes.io/hostname"
# Defaults a template may override. gloo otherwise binds to whatever the process hostname resolves to, which can be
# loopback inside a pod (then peers in other pods cannot connect); the pod network interface is eth0. NCCL's
# bootstrap picks its interface the same way, so it is pinned to eth0 too. TORCH_NCCL_ASYNC_ERROR_HANDLING=2
# (CleanUpOnly): NCCL's watchdog aborts the communicator of a failed or timed-out collective and the error raises in
# the rank, which ftjob turns into a failed step; torch's default (3) and 1 would also kill the process, so a
# surviving group would die with its peer, and 0 can leave a rank hanging in the collective for ever.
DEFAULT_ENV = (
    {"name": "GLOO_SOCKET_IFNAME", "value": "eth0"},
    {"name": "NCCL_SOCKET_IFNAME", "value": "eth0"},
    {"name": "TORCH_NCCL_ASYNC_ERROR_HANDLING", "value": "2"},
)
THREADS_ENV = "OMP_NUM_THREADS"


def cpu_threads_env(container: dict[str, Any], processes: int = 1) -> list[dict[str, str]]:
    """A default for the container's CPU threads (the caller drops it where the container sets its own): its CPU
    limit, else its request, in whole cores shared out between the ``processes`` ranks it runs (at least 1).

    torch (OpenMP) otherwise starts one thread per core of the node, whatever the container's CPU share: on a node
    shared by several ranks they spin against each other and against a replacement pod's start-up, which then takes
    longer to contribute again.
    None when the container may set it through ``envFrom`` (which an explicit entry would override), asks for no CPU,
    or gives a quantity the API server will refuse anyway."""
    if container.get("envFrom"):
        return []
    resources = container.get("resources") or {}
    cpu = (resources.get("limits") or {}).get("cpu") or (resources.get("requests") or {}).get("cpu")
    if cpu is None:
        return []
    try:
        cores = parse_quantity(cpu)
    except ValueError:
        return []
    return [{"name": THREADS_ENV, "value": str(max(1, math.floor(cores / processes)))}]


def common_labels(job: str, role: str) -> dict[str, str]:
    return {contract.LABEL_JOB: job, contract.LABEL_ROLE: role, contract.LABEL_MANAGED_BY: contract.MANAGED_BY}


def token_secret(job: str, namespace: str) -> dict[str, Any]:
    """The job's worker token (a new random one on every call: the caller creates the Secret once)."""
    return _random_token_secret(names.token_secret(job), namespace, common_labels(job, "token"))


def operator_token_secret(job: str, namespace: str) -> dict[str, Any]:
    """The operator's token for the job's lighthouse: a second random token, so that no worker pod -- each holds the
    worker token -- can call the membership API (ftjob.lighthouse.api.auth); only the lighthouse pod mounts it."""
    return _random_token_secret(names.operator_token_secret(job), namespace, common_labels(job, "operator-token"))


def _random_token_secret(name: str, namespace: str, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "type": "Opaque",
        "stringData": {contract.TOKEN_SECRET_KEY: secrets.token_urlsafe(32)},
    }


def tls_secret(job: str, namespace: str) -> dict[str, Any]:
    """A fresh per-job CA and its lighthouse and worker certificates (new keys on every call: the caller creates
    the Secret once and reads it back, so a retry never replaces what pods already mounted)."""
    files = pki.issue_job(job, namespace, names.lighthouse_dns_names(job, namespace))
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": names.tls_secret(job), "namespace": namespace, "labels": common_labels(job, "tls")},
        "type": "Opaque",
        "stringData": {key: data.decode() for key, data in files.items()},
    }


TLS_VOLUME = "ftjob-tls"
TLS_DIR = "/etc/ftjob/tls"


def _tls_files(job: str, cert: str, key: str) -> tuple[dict[str, Any], dict[str, Any], list[dict[str, str]]]:
    """The volume with the job's CA and one certificate pair of the TLS Secret (never ca.key), its read-only mount
    and the env that points the process at the files."""
    items = [{"key": f, "path": f} for f in (pki.CA_CERT, cert, key)]
    volume = {"name": TLS_VOLUME, "secret": {"secretName": names.tls_secret(job), "items": items}}
    mount = {"name": TLS_VOLUME, "mountPath": TLS_DIR, "readOnly": True}
    env = [
        {"name": contract.ENV_TLS_CA_FILE, "value": f"{TLS_DIR}/{pki.CA_CERT}"},
        {"name": contract.ENV_TLS_CERT_FILE, "value": f"{TLS_DIR}/{cert}"},
        {"name": contract.ENV_TLS_KEY_FILE, "value": f"{TLS_DIR}/{key}"},
    ]
    return volume, mount, env


def headless_service(name: str, namespace: str, labels: dict[str, str], selector: dict[str, str], port: int):
    """No kube-proxy in the local cluster and none needed: headless, not-ready pods published (they rendezvous
    before they are Ready), port == targetPort."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector,
            "ports": [{"name": "main", "port": port, "targetPort": port, "protocol": "TCP"}],
        },
    }


def lighthouse_service(job: str, namespace: str) -> dict[str, Any]:
    labels = common_labels(job, contract.ROLE_LIGHTHOUSE)
    selector = {contract.LABEL_JOB: job, contract.LABEL_ROLE: contract.ROLE_LIGHTHOUSE}
    return headless_service(names.lighthouse_service(job), namespace, labels, selector, contract.LIGHTHOUSE_PORT)


def group_service(job: str, namespace: str, group: int) -> dict[str, Any]:
    labels = {**common_labels(job, contract.ROLE_WORKER), contract.LABEL_GROUP: str(group)}
    selector = {contract.LABEL_JOB: job, contract.LABEL_ROLE: contract.ROLE_WORKER, contract.LABEL_GROUP: str(group)}
    return headless_service(names.group_service(job, group), namespace, labels, selector, contract.GROUP_MASTER_PORT)


def lighthouse_url(job: str, namespace: str, tls: bool = True) -> str:
    scheme = "https" if tls else "http"
    return f"{scheme}://{names.cluster_dns(names.lighthouse_service(job), namespace)}:{contract.LIGHTHOUSE_PORT}"


def _token_env(job: str) -> dict[str, Any]:
    ref = {"name": names.token_secret(job), "key": contract.TOKEN_SECRET_KEY}
    return {"name": contract.ENV_TOKEN, "valueFrom": {"secretKeyRef": ref}}


def _operator_token_env(job: str) -> dict[str, Any]:
    """The lighthouse pod's only: never on a worker pod, whose code could then act as the operator."""
    ref = {"name": names.operator_token_secret(job), "key": contract.TOKEN_SECRET_KEY}
    return {"name": contract.ENV_OPERATOR_TOKEN, "valueFrom": {"secretKeyRef": ref}}


def _pod_ip_env(name: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}


def quantities_as_strings(resources: dict[str, Any]) -> dict[str, Any]:
    """`nvidia.com/gpu: 8` in YAML is an int; the apiserver takes it, the Python client's typed API does not: a
    quantity is always sent as its string."""
    out = copy.deepcopy(resources)
    for key in ("limits", "requests"):
        if isinstance(out.get(key), dict):
            out[key] = {name: str(v) if isinstance(v, int | float) else v for name, v in out[key].items()}
    return out


def worker_pod(job: str, namespace: str, spec: JobSpec, group: GroupState, rank: int) -> dict[str, Any]:
    """One rank of one generation of a replica group: the user's template plus identity, DNS, env and placement."""
    template = spec.template
    name = names.pod_name(job, group.index, group.generation, rank)
    subdomain = names.group_service(job, group.index)
    labels = {
        **(template.get("metadata") or {}).get("labels", {}),
        **common_labels(job, contract.ROLE_WORKER),
        contract.LABEL_GROUP: str(group.index),
        contract.LABEL_RANK: str(rank),
        contract.LABEL_GENERATION: str(group.generation),
    }
    annotations = dict((template.get("metadata") or {}).get("annotations", {}))
    pod_spec = copy.deepcopy(template.get("spec") or {})
    pod_spec["hostname"] = name
    pod_spec["subdomain"] = subdomain
    pod_spec["restartPolicy"] = "Never"  # a group restarts as a whole, never one rank in place
    # Ready only while the lighthouse lists this generation in its quorum (operator/reconcile/readiness.py): what the
    # job's PodDisruptionBudget counts. A template's own gates stay (all must hold).
    gates = [g for g in pod_spec.get("readinessGates") or [] if g.get("conditionType") != contract.CONDITION_IN_QUORUM]
    pod_spec["readinessGates"] = [*gates, {"conditionType": contract.CONDITION_IN_QUORUM}]
    if spec.pods_per_replica == 1:
        master = _pod_ip_env(contract.ENV_MASTER_ADDR)  # a single rank meets itself: no DNS needed
    else:
        rank0 = names.pod_name(job, group.index, group.generation, 0)
        master = {"name": contract.ENV_MASTER_ADDR, "value": names.cluster_dns(f"{rank0}.{subdomain}", namespace)}
    env = [
        {"name": contract.ENV_JOB_NAME, "value": job},
        {"name": contract.ENV_NAMESPACE, "value": namespace},
        {"name": contract.ENV_LIGHTHOUSE_URL, "value": lighthouse_url(job, namespace, spec.tls.enabled)},
        _token_env(job),
        {"name": contract.ENV_REPLICA_GROUP, "value": str(group.index)},
        {"name": contract.ENV_REPLICAS, "value": str(spec.replicas)},
        {"name": contract.ENV_MIN_REPLICAS, "value": str(spec.min_replicas)},
        _pod_ip_env(contract.ENV_ADVERTISE_ADDR),
        # a pod has its own network namespace: the contract's fixed ports (NetworkPolicy can name them)
        {"name": contract.ENV_RECOVERY_PORT, "value": str(contract.RECOVERY_PORT)},
        {"name": contract.ENV_CROSS_GROUP_STORE_PORT, "value": str(contract.CROSS_GROUP_STORE_PORT)},
        {"name": contract.ENV_METRICS_PORT, "value": str(contract.TRAINER_METRICS_PORT)},
        *_rank_env(spec, rank),
        master,
        {"name": contract.ENV_MASTER_PORT, "value": str(contract.GROUP_MASTER_PORT)},
        *integrity_env(spec, group),
    ]
    if spec.tls.enabled:
        tls_volume, tls_mount, tls_env = _tls_files(job, pki.WORKER_CERT, pki.WORKER_KEY)
        env += tls_env
        pod_spec["volumes"] = [v for v in pod_spec.get("volumes") or [] if v.get("name") != TLS_VOLUME] + [tls_volume]
    ours = {e["name"] for e in env}
    if spec.ranks_per_pod > 1:  # the supervisor sets these per rank: a template's value would only mislead
        ours |= {contract.ENV_RANK, contract.ENV_LOCAL_RANK}
        _supervise(pod_spec.get("containers") or [])
    for i, container in enumerate(pod_spec.get("containers") or []):
        user_env = [e for e in container.get("env") or [] if e.get("name") not in ours]
        user_names = {e.get("name") for e in user_env}
        processes = spec.ranks_per_pod if i == 0 else 1  # the first container runs every rank of the pod
        threads = cpu_threads_env(container, processes)
        defaults = [d for d in (*DEFAULT_ENV, *threads) if d["name"] not in user_names]
        container["env"] = user_env + defaults + env  # ours win: the contract must hold whatever the template says
        if spec.tls.enabled:  # every container gets the env, so every one gets the files it names
            mounts = container.get("volumeMounts") or []
            container["volumeMounts"] = [m for m in mounts if m.get("mountPath") != TLS_DIR] + [tls_mount]
    _add_metrics_ports(pod_spec.get("containers") or [], spec.ranks_per_pod)
    for container in (pod_spec.get("initContainers") or []) + (pod_spec.get("containers") or []):
        if container.get("resources"):
            container["resources"] = quantities_as_strings(container["resources"])
    if group.avoid_node:
        pod_spec["affinity"] = _avoid_node(pod_spec.get("affinity"), group.avoid_node, group.avoid_required)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels, "annotations": annotations},
        "spec": pod_spec,
    }


def pod_disruption_budget(job: str, namespace: str, spec: JobSpec) -> dict[str, Any]:
    """The job's PodDisruptionBudget over its worker pods, every generation (operator/reconcile/readiness.py):
    minAvailable is every group's pods, and a pod counts as available only while it is Ready, i.e. in the lighthouse's
    quorum. So the Eviction API (`kubectl drain`) never takes a pod out of the quorum: it waits until the group's
    replacement, which the operator starts elsewhere when the drain cordons the node (spec.nodeHealth), has taken over
    -- the old generation then leaves the quorum, is no longer Ready and may go. With minReplicas groups as the minimum
    instead, a drain could evict groups down to minReplicas at once and replace them only afterwards
    (break-before-make); every group guards both promises. A pod out of any quorum (starting, healing, its group
    stopped) never holds a drain up: unhealthyPodEvictionPolicy AlwaysAllow (Kubernetes >= 1.27; older API servers drop
    the field and let such pods go only while every group is in the quorum).

    Without a migration off cordoned nodes (spec.nodeHealth migrate or cordoned false) nothing would ever move a group
    off a draining node and the drain would wait forever: minAvailable is 0 then (the budget allows every eviction,
    and an evicted group is replaced as any deleted one)."""
    migrates = spec.node_health.migrate and spec.node_health.cordoned
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": {
            "name": names.disruption_budget(job),
            "namespace": namespace,
            "labels": common_labels(job, "disruption-budget"),
        },
        "spec": {
            "minAvailable": spec.total_groups * spec.pods_per_replica if migrates else 0,
            "selector": {"matchLabels": {contract.LABEL_JOB: job, contract.LABEL_ROLE: contract.ROLE_WORKER}},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def integrity_env(spec: JobSpec, group: GroupState) -> list[dict[str, str]]:
    """spec.integrity for the trainer: the gradient guard, the digest period, and which incarnation this is (fault
    injection in tests applies to generation 0 only)."""
    integrity = spec.integrity
    return [
        {"name": contract.ENV_GUARD, "value": "1" if integrity.guard_enabled else "0"},
        {"name": contract.ENV_GUARD_NORM_RATIO, "value": f"{integrity.norm_ratio:g}"},
        {"name": contract.ENV_DIGEST_EVERY, "value": str(integrity.digest_every_steps)},
        {"name": contract.ENV_GENERATION, "value": str(group.generation)},
    ]


def _rank_env(spec: JobSpec, pod_rank: int) -> list[dict[str, str]]:
    """torch.distributed's names for the group's rendezvous and the pod's place in the group. With one rank per pod
    the pod is the rank (RANK, LOCAL_RANK set here); with several the in-pod supervisor sets RANK = POD_RANK x
    RANKS_PER_POD + LOCAL_RANK and LOCAL_RANK for each rank process it starts."""
    ranks = spec.ranks_per_pod
    env = [{"name": contract.ENV_RANK, "value": str(pod_rank)}] if ranks == 1 else []
    env.append({"name": contract.ENV_WORLD_SIZE, "value": str(spec.ranks_per_group)})
    if ranks == 1:
        env.append({"name": contract.ENV_LOCAL_RANK, "value": "0"})
    return [
        *env,
        {"name": contract.ENV_LOCAL_WORLD_SIZE, "value": str(ranks)},
        {"name": contract.ENV_RANKS_PER_POD, "value": str(ranks)},
        {"name": contract.ENV_POD_RANK, "value": str(pod_rank)},
    ]


SUPERVISE = ("ftjob-trainer", "supervise")  # the in-pod supervisor of a pod with several ranks (ranksPerPod)


def _supervise(containers: list[dict[str, Any]]) -> None:
    """Run the first (the training) container's command under the in-pod supervisor, which starts one process of
    it per local rank. Its args stay where they are: Kubernetes appends them to the command, after the supervisor's
    `--`. A command that already starts the supervisor is left alone (wrapped twice it would start N x N ranks)."""
    command = list((containers[0] if containers else {}).get("command") or [])
    if not command:  # JobSpec refuses this; an image's ENTRYPOINT is not in the pod spec to be wrapped
        raise ValueError("spec.ranksPerPod > 1 needs spec.template.spec.containers[0].command")
    if tuple(command[: len(SUPERVISE)]) != SUPERVISE:
        containers[0]["command"] = [*SUPERVISE, "--", *command]


def _add_metrics_ports(containers: list[dict[str, Any]], ranks_per_pod: int) -> None:
    """Every local rank's /metrics port, on the first (the training) container: `metrics` for local rank 0 and
    `metrics-<k>` for local rank k, named for the chart's PodMonitor. Each rank process has its own registry and
    port, so each is scraped on its own (a dead rank's series goes stale instead of hiding in a pod-wide sum). Port
    names and numbers are unique per pod: one the template already declares keeps its own."""
    if not containers:
        return
    declared = [p for c in containers for p in c.get("ports") or []]
    names_taken = {p.get("name") for p in declared}
    numbers_taken = {p.get("containerPort") for p in declared}
    ports = []
    for k in range(ranks_per_pod):
        name = "metrics" if k == 0 else f"metrics-{k}"
        number = contract.rank_port(contract.TRAINER_METRICS_PORT, k)
        if name not in names_taken and number not in numbers_taken:
            ports.append({"name": name, "containerPort": number})
    if ports:
        containers[0]["ports"] = [*(containers[0].get("ports") or []), *ports]


def _avoid_node(affinity: dict[str, Any] | None, node: str, required: bool) -> dict[str, Any]:
    """Add 'not on `node`' to the template's affinity: ANDed into every required term, or a preferred term."""
    affinity = copy.deepcopy(affinity or {})
    node_aff = affinity.setdefault("nodeAffinity", {})
    expr = {"key": HOSTNAME_LABEL, "operator": "NotIn", "values": [node]}
    if required:
        req = node_aff.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
        terms = req.setdefault("nodeSelectorTerms", [])
        if not terms:
            terms.append({})
        for term in terms:
            term.setdefault("matchExpressions", []).append(expr)
    else:
        preferred = node_aff.setdefault("preferredDuringSchedulingIgnoredDuringExecution", [])
        preferred.append({"weight": 100, "preference": {"matchExpressions": [expr]}})
    return affinity


# requests == limits: Guaranteed QoS, so the job's single coordinator is the last thing the kubelet evicts under
# memory pressure (a BestEffort or Burstable lighthouse goes first and stalls every group of the job)
LIGHTHOUSE_DEFAULT_RESOURCES: dict[str, dict[str, str]] = {
    "requests": {"cpu": "500m", "memory": "512Mi"},
    "limits": {"cpu": "500m", "memory": "512Mi"},
}
# A fixed non-root identity: the lighthouse runs the workers' image by default, which may run as root, and
# runAsNonRoot alone would then make the kubelet refuse to start it. 65532 is the trainer image's own user.
LIGHTHOUSE_UID = 65532
LIGHTHOUSE_SCRATCH_VOLUME = "tmp"
LIGHTHOUSE_SCRATCH_DIR = "/tmp"


def _lighthouse_security(pod_spec: dict[str, Any], container: dict[str, Any]) -> None:
    """What Pod Security Admission's `restricted` profile demands, so every namespace admits the lighthouse; the
    root filesystem is read-only, and an emptyDir at /tmp (also HOME) is the one writable place, for Python and
    libraries and for a state or audit file a custom command may ask for."""
    pod_spec["automountServiceAccountToken"] = False  # the lighthouse never calls the Kubernetes API
    pod_spec["securityContext"] = {
        "runAsNonRoot": True,
        "runAsUser": LIGHTHOUSE_UID,
        "runAsGroup": LIGHTHOUSE_UID,
        "fsGroup": LIGHTHOUSE_UID,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    container["securityContext"] = {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "readOnlyRootFilesystem": True,
        "runAsNonRoot": True,
    }
    pod_spec.setdefault("volumes", []).append({"name": LIGHTHOUSE_SCRATCH_VOLUME, "emptyDir": {}})
    mount = {"name": LIGHTHOUSE_SCRATCH_VOLUME, "mountPath": LIGHTHOUSE_SCRATCH_DIR}
    container["volumeMounts"] = [*(container.get("volumeMounts") or []), mount]
    if not any(e.get("name") == "HOME" for e in container["env"]):
        container["env"].append({"name": "HOME", "value": LIGHTHOUSE_SCRATCH_DIR})


def _lighthouse_placement(spec: JobSpec) -> dict[str, Any]:
    """The lighthouse's pod-spec placement fields. imagePullSecrets and priorityClassName default to the worker
    template's: the lighthouse runs the workers' image by default (a private registry would otherwise leave it in
    ImagePullBackOff) and must not be preempted before the job it coordinates. nodeSelector, tolerations and
    affinity are never copied: workers usually target tainted GPU nodes, and the lighthouse needs a CPU only and
    should outlive the loss of a GPU node."""
    lh = spec.lighthouse
    template = spec.template.get("spec") or {}
    out: dict[str, Any] = {}
    if lh.node_selector:
        out["nodeSelector"] = dict(lh.node_selector)
    if lh.tolerations:
        out["tolerations"] = copy.deepcopy(list(lh.tolerations))
    if lh.affinity:
        out["affinity"] = copy.deepcopy(lh.affinity)
    priority = template.get("priorityClassName") if lh.priority_class_name is None else lh.priority_class_name
    if priority:  # an explicit "" opts out of the template's class
        out["priorityClassName"] = priority
    pull = template.get("imagePullSecrets") if lh.image_pull_secrets is None else list(lh.image_pull_secrets)
    if pull:
        out["imagePullSecrets"] = copy.deepcopy(pull)
    return out


def lighthouse_pod(
    job: str,
    namespace: str,
    spec: JobSpec,
    generation: int,
    restore_quorum_id: int = 0,
    restore_step: int = 0,
    restore_window_s: float | None = None,
    group_generations: Mapping[int, int] | None = None,
) -> dict[str, Any]:
    """The lighthouse pod. A replacement (the previous one was lost) starts from the last quorum id and committed
    step the operator saw, so ids keep increasing and no quorum restarts below a step the groups committed, and
    knows each group's running generation (`group_generations`) from its start, so a process of a replaced one is
    refused even before the operator can call it. It passes Pod Security Admission `restricted` and is Guaranteed
    QoS unless spec.lighthouse.resources says otherwise."""
    lh = spec.lighthouse
    containers = (spec.template.get("spec") or {}).get("containers") or [{}]
    image = lh.image or containers[0].get("image", "ftjob-trainer")
    env = [
        {"name": contract.ENV_LIGHTHOUSE_BIND, "value": f"0.0.0.0:{contract.LIGHTHOUSE_PORT}"},
        {"name": contract.ENV_JOIN_TIMEOUT_S, "value": f"{lh.join_timeout_s:g}"},
        {"name": contract.ENV_HEARTBEAT_TIMEOUT_S, "value": f"{lh.heartbeat_timeout_s:g}"},
        {"name": contract.ENV_STALL_FACTOR, "value": f"{lh.stall_factor:g}"},
        {"name": contract.ENV_STALL_FLOOR_S, "value": f"{lh.stall_floor_s:g}"},
        {"name": contract.ENV_MIN_REPLICAS, "value": str(spec.min_replicas)},
        {"name": contract.ENV_REPLICAS, "value": str(spec.replicas)},
        {"name": contract.ENV_GROUPS, "value": str(spec.total_groups)},
        {"name": contract.ENV_JOB_NAME, "value": job},
        {"name": contract.ENV_NAMESPACE, "value": namespace},
        _token_env(job),
        _operator_token_env(job),
        # the eviction rule of the gradient guard (the lighthouse tallies the offences the trainers report)
        {"name": contract.ENV_GUARD_MAX_OFFENCES, "value": str(spec.integrity.max_offences)},
        {"name": contract.ENV_GUARD_WINDOW_S, "value": f"{spec.integrity.window_s:g}"},
    ]
    if restore_quorum_id or restore_step:
        env += [
            {"name": contract.ENV_RESTORE_QUORUM_ID, "value": str(restore_quorum_id)},
            {"name": contract.ENV_RESTORE_STEP, "value": str(restore_step)},
        ]
        if restore_window_s is not None:
            env.append({"name": contract.ENV_RESTORE_WINDOW_S, "value": f"{restore_window_s:g}"})
    if group_generations:
        env.append({"name": contract.ENV_GROUP_GENERATIONS, "value": contract.format_generations(group_generations)})
    volumes: list[dict[str, Any]] = []
    if spec.tls.enabled:  # it serves TLS only, with the lighthouse pair (the CA for symmetry: never the CA's key)
        tls_volume, tls_mount, tls_env = _tls_files(job, pki.LIGHTHOUSE_CERT, pki.LIGHTHOUSE_KEY)
        env += tls_env
        volumes.append(tls_volume)
    name = names.lighthouse_pod(job, generation)
    container: dict[str, Any] = {
        "name": "lighthouse",
        "image": image,
        "command": list(lh.command),
        "env": env,
        # the port's name says its protocol (service meshes and the chart's PodMonitor go by it)
        "ports": [{"name": "https" if spec.tls.enabled else "http", "containerPort": contract.LIGHTHOUSE_PORT}],
    }
    if spec.tls.enabled:
        container["volumeMounts"] = [tls_mount]
    resources = lh.resources or LIGHTHOUSE_DEFAULT_RESOURCES  # the user's exactly, when given
    container["resources"] = quantities_as_strings(resources)
    labels = {**common_labels(job, contract.ROLE_LIGHTHOUSE), contract.LABEL_GENERATION: str(generation)}
    pod_spec: dict[str, Any] = {
        "hostname": name,
        "subdomain": names.lighthouse_service(job),
        "restartPolicy": "Never",
        "containers": [container],
        **_lighthouse_placement(spec),
    }
    if volumes:
        pod_spec["volumes"] = volumes
    _lighthouse_security(pod_spec, container)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": pod_spec,
    }
