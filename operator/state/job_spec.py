"""The spec of one FaultTolerantTrainingJob as the operator reads it: every field parsed and checked, defaults applied.

Plain data with no Kubernetes client, so the planner built on it is unit-testable.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from ftjob import contract
from ftjob.operator.planning.node_health import NodeHealthPolicy

ACTION_RESTART_GROUP = "RestartGroup"
ACTION_FAIL_JOB = "FailJob"
ACTION_IGNORE = "Ignore"


# --- spec ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExitCodeRule:
    """`failurePolicy.rules[]`: when a container exits with one of these codes (or not, for NotIn), do `action`."""

    action: str
    operator: str  # "In" | "NotIn"
    values: frozenset[int]
    container_name: str | None = None

    def matches(self, container: str, exit_code: int) -> bool:
        if self.container_name and self.container_name != container:
            return False
        return (exit_code in self.values) == (self.operator == "In")


@dataclass(frozen=True)
class FailurePolicy:
    max_restarts_per_group: int = 3
    restart_window_s: float = 600.0
    max_total_restarts: int = 20
    backoff_base_s: float = 1.0
    backoff_max_s: float = 60.0
    rules: tuple[ExitCodeRule, ...] = ()
    unschedulable_timeout_s: float | None = None  # opt-in: fail the job when pods cannot be scheduled this long

    def action_for_exit(self, container: str, exit_code: int) -> str:
        """The first matching rule's action; RestartGroup when no rule matches."""
        for rule in self.rules:
            if rule.matches(container, exit_code):
                return rule.action
        return ACTION_RESTART_GROUP


@dataclass(frozen=True)
class LighthouseSpec:
    """`spec.lighthouse`. Of the placement fields, None means unset: imagePullSecrets and priorityClassName then
    come from the worker template (builders.lighthouse_pod), nodeSelector, tolerations and affinity stay empty."""

    image: str | None = None
    command: tuple[str, ...] = ("ftjob-trainer", "lighthouse")
    resources: dict[str, Any] = field(default_factory=dict)  # empty: builders.LIGHTHOUSE_DEFAULT_RESOURCES
    join_timeout_s: float = 1.0
    heartbeat_timeout_s: float = 5.0
    stall_factor: float = 3.0  # progress-based stall rule (ftjob.lighthouse.core.stall)
    stall_floor_s: float = 1.0
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: tuple[dict[str, Any], ...] = ()
    affinity: dict[str, Any] = field(default_factory=dict)
    priority_class_name: str | None = None
    image_pull_secrets: tuple[dict[str, str], ...] | None = None

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> LighthouseSpec:
        """Parse with the CRD's defaults; a value of the wrong type (an older CRD let it in) raises ValueError naming
        the field, rather than a pod the apiserver refuses in words that never mention the job's spec."""
        raw = raw or {}
        where = "spec.lighthouse"
        resources = raw.get("resources") or {}
        if not isinstance(resources, dict):
            raise ValueError(f"{where}.resources must be an object, got {resources!r}")
        node_selector = raw.get("nodeSelector") or {}
        if not isinstance(node_selector, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in node_selector.items()
        ):
            raise ValueError(f"{where}.nodeSelector must map strings to strings, got {node_selector!r}")
        tolerations = raw.get("tolerations") or []
        if not isinstance(tolerations, list) or not all(isinstance(t, dict) for t in tolerations):
            raise ValueError(f"{where}.tolerations must be a list of objects, got {tolerations!r}")
        affinity = raw.get("affinity") or {}
        if not isinstance(affinity, dict):
            raise ValueError(f"{where}.affinity must be an object, got {affinity!r}")
        priority = raw.get("priorityClassName")
        if priority is not None and not isinstance(priority, str):
            raise ValueError(f"{where}.priorityClassName must be a string, got {priority!r}")
        pull = raw.get("imagePullSecrets")
        if pull is not None and (
            not isinstance(pull, list) or not all(isinstance(s, dict) and isinstance(s.get("name"), str) for s in pull)
        ):
            raise ValueError(f"{where}.imagePullSecrets must be a list of {{name: <secret>}}, got {pull!r}")
        return cls(
            image=raw.get("image"),
            command=tuple(raw.get("command") or ("ftjob-trainer", "lighthouse")),
            resources=copy.deepcopy(resources),
            join_timeout_s=float(raw.get("joinTimeoutSeconds", 1)),
            heartbeat_timeout_s=float(raw.get("heartbeatTimeoutSeconds", 5)),
            stall_factor=float(raw.get("stallFactor", 3)),
            stall_floor_s=float(raw.get("stallFloorSeconds", 1)),
            node_selector=dict(node_selector),
            tolerations=tuple(copy.deepcopy(tolerations)),
            affinity=copy.deepcopy(affinity),
            priority_class_name=priority,
            image_pull_secrets=None if pull is None else tuple({"name": s["name"]} for s in pull),
        )


@dataclass(frozen=True)
class IntegritySpec:
    """`spec.integrity`: the gradient guard (trainer: refuse a step; lighthouse: evict after maxOffences within
    windowSeconds) and the replicas' state-digest check every digestEverySteps committed steps (0: off)."""

    guard_enabled: bool = True
    norm_ratio: float = 100.0
    max_offences: int = 3
    window_s: float = 600.0
    digest_every_steps: int = 100

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> IntegritySpec:
        """Parse with the CRD's defaults; a bad value (an older CRD let it in) raises ValueError naming the field."""
        raw = raw or {}
        guard = raw.get("gradientGuard") or {}
        where = "spec.integrity.gradientGuard"
        enabled = guard.get("enabled", True)
        if not isinstance(enabled, bool):
            raise ValueError(f"{where}.enabled must be true or false, got {enabled!r}")
        return cls(
            guard_enabled=enabled,
            norm_ratio=_number(guard, "normRatio", 100.0, where, above=1.0, why="1 or less refuses healthy groups"),
            max_offences=int(_number(guard, "maxOffences", 3, where, at_least=1, integer=True)),
            window_s=_number(guard, "windowSeconds", 600, where, at_least=1),
            digest_every_steps=int(_number(raw, "digestEverySteps", 100, "spec.integrity", at_least=0, integer=True)),
        )


def _number(raw: dict[str, Any], key: str, default: float, where: str, *, above: float | None = None,
            at_least: float | None = None, integer: bool = False, why: str = "") -> float:  # fmt: skip
    value = raw.get(key, default)
    kind = "an integer" if integer else "a number"
    kind += f" > {above:g}" if above is not None else f" >= {at_least:g}" if at_least is not None else ""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and (not integer or float(value).is_integer())
    ok = ok and (above is None or value > above) and (at_least is None or value >= at_least)
    if not ok:
        raise ValueError(f"{where}.{key} must be {kind}, got {value!r}" + (f" ({why})" if why else ""))
    return float(value)


@dataclass(frozen=True)
class TlsSpec:
    """`spec.tls`: the lighthouse API and the recovery servers serve TLS with certificates from a per-job CA (the
    Secret `<job>-tls`). `enabled: false` is plain HTTP, for local development only."""

    enabled: bool = True

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> TlsSpec:
        enabled = (raw or {}).get("enabled", True)
        if not isinstance(enabled, bool):
            raise ValueError(f"spec.tls.enabled must be true or false, got {enabled!r}")
        return cls(enabled=enabled)


@dataclass(frozen=True)
class JobSpec:
    replicas: int
    min_replicas: int
    pods_per_replica: int
    spare_replicas: int
    template: dict[str, Any]
    failure_policy: FailurePolicy
    lighthouse: LighthouseSpec
    suspend: bool = False
    ttl_seconds_after_finished: int | None = None
    node_health: NodeHealthPolicy = field(default_factory=NodeHealthPolicy)
    integrity: IntegritySpec = field(default_factory=IntegritySpec)
    tls: TlsSpec = field(default_factory=TlsSpec)
    ranks_per_pod: int = 1  # rank processes in each pod (one per GPU), started by `ftjob-trainer supervise`

    @property
    def total_groups(self) -> int:
        """Contributing groups plus warm spares: the groups that get pods."""
        return self.replicas + self.spare_replicas

    @property
    def ranks_per_group(self) -> int:
        """The ranks of one replica group: its torch.distributed WORLD_SIZE (podsPerReplica x ranksPerPod)."""
        return self.pods_per_replica * self.ranks_per_pod

    @classmethod
    def from_dict(cls, spec: dict[str, Any]) -> JobSpec:
        """Parse `.spec` with the CRD's defaults (the apiserver applies them too; this keeps unit tests honest)."""
        fp = spec.get("failurePolicy") or {}
        backoff = fp.get("backoff") or {}
        rules = tuple(
            ExitCodeRule(
                action=r["action"],
                operator=(r.get("onExitCodes") or {}).get("operator", "In"),
                values=frozenset(int(v) for v in (r.get("onExitCodes") or {}).get("values", [])),
                container_name=(r.get("onExitCodes") or {}).get("containerName"),
            )
            for r in fp.get("rules") or []
        )
        ttl = spec.get("ttlSecondsAfterFinished")
        return cls(
            replicas=int(spec.get("replicas", 1)),
            min_replicas=int(spec.get("minReplicas", 1)),
            pods_per_replica=int(spec.get("podsPerReplica", 1)),
            spare_replicas=int(spec.get("spareReplicas", 0)),
            template=copy.deepcopy(spec.get("template") or {}),
            failure_policy=FailurePolicy(
                max_restarts_per_group=int(fp.get("maxRestartsPerGroup", 3)),
                restart_window_s=float(fp.get("restartWindowSeconds", 600)),
                max_total_restarts=int(fp.get("maxTotalRestarts", 20)),
                backoff_base_s=float(backoff.get("baseSeconds", 1)),
                backoff_max_s=float(backoff.get("maxSeconds", 60)),
                rules=rules,
                unschedulable_timeout_s=None
                if fp.get("unschedulableTimeoutSeconds") is None
                else float(fp["unschedulableTimeoutSeconds"]),
            ),
            lighthouse=LighthouseSpec.from_dict(spec.get("lighthouse")),
            suspend=bool(spec.get("suspend", False)),
            ttl_seconds_after_finished=None if ttl is None else int(ttl),
            node_health=NodeHealthPolicy.from_dict(spec.get("nodeHealth")),
            integrity=IntegritySpec.from_dict(spec.get("integrity")),
            tls=TlsSpec.from_dict(spec.get("tls")),
            ranks_per_pod=_ranks_per_pod(spec),
        )


def _ranks_per_pod(spec: dict[str, Any]) -> int:
    """spec.ranksPerPod, checked as the CRD does (an older CRD let any value in): at most
    contract.MAX_RANKS_PER_POD, the local ranks the per-rank ports (contract.rank_port) are laid out for; above 1
    the first container must name its command, which the operator runs under the in-pod supervisor (an image's
    ENTRYPOINT is not in the pod spec, so there is nothing to wrap)."""
    value = spec.get("ranksPerPod", 1)
    ok = isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= contract.MAX_RANKS_PER_POD
    if not ok:
        raise ValueError(f"spec.ranksPerPod must be an integer in 1..{contract.MAX_RANKS_PER_POD}, got {value!r}")
    containers = ((spec.get("template") or {}).get("spec") or {}).get("containers") or [{}]
    if value > 1 and not containers[0].get("command"):
        raise ValueError(
            "spec.ranksPerPod > 1 needs spec.template.spec.containers[0].command: the operator runs it under "
            "`ftjob-trainer supervise`, which cannot wrap an image's ENTRYPOINT"
        )
    return value
