"""The operator's view of one job: its parsed spec, what it remembers (persisted in status) and what it observes.

Everything here is plain data with no Kubernetes client, so the planner built on it is unit-testable.
"""

from __future__ import annotations

import copy
import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from ftjob import contract
from ftjob.operator.node_health import NodeHealthPolicy

ACTION_RESTART_GROUP = "RestartGroup"
ACTION_FAIL_JOB = "FailJob"
ACTION_IGNORE = "Ignore"

OUTCOME_SUCCEEDED = "Succeeded"
OUTCOME_FAILED = "Failed"


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
    stall_factor: float = 3.0  # progress-based stall rule (ftjob.lighthouse.stall)
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


# --- what the operator remembers (round-trips through .status) ----------------------------------------------------
@dataclass
class GroupState:
    index: int
    generation: int = 0
    restarts: int = 0
    restart_times: list[float] = field(default_factory=list)  # epoch seconds of counted restarts, pruned to window
    avoid_node: str | None = None  # the node this generation must (or should) not land on
    avoid_required: bool = False  # hard anti-affinity (node lost) vs preferred (pod failed there)
    not_before: float = 0.0  # back-off: this generation's pods are not created before this time
    failed_at: float | None = None  # when the failure that started this generation was seen (recovery metric)
    last_failure: str = ""
    last_failure_reason: str = ""  # its reason (ExitCode, GradientGuard, ...): the Recovering condition's reason
    generation_since: float | None = None  # when this generation was planned: later lighthouse evictions are its own
    all_pods_seen: bool = False  # every pod of this generation was observed once: a missing one was deleted
    # make-before-break: the generation still training on a degrading node while this one starts elsewhere
    migrating_from: int | None = None
    migrating_since: float | None = None


@dataclass
class JobState:
    groups: dict[int, GroupState] = field(default_factory=dict)
    retired_generations: dict[int, int] = field(default_factory=dict)  # index -> last generation used (scale-down)
    lighthouse_generation: int = 0
    lighthouse_seen: bool = False
    total_restarts: int = 0
    restarts_by_reason: dict[str, int] = field(default_factory=dict)
    suspended: bool = False
    outcome: str | None = None  # OUTCOME_SUCCEEDED | OUTCOME_FAILED: terminal, never undone
    outcome_reason: str = ""
    outcome_message: str = ""
    start_time: float | None = None
    completion_time: float | None = None
    completing_since: float | None = None  # first group finished training: no more restarts

    def copy(self) -> JobState:
        return copy.deepcopy(self)


# --- what the operator observes (from kopf's indexes) -------------------------------------------------------------
@dataclass(frozen=True)
class PodView:
    name: str
    uid: str
    role: str
    group: int | None
    rank: int | None
    generation: int
    phase: str  # Pending | Running | Succeeded | Failed | Unknown
    ready: bool
    node: str | None
    ip: str | None
    deletion_time: float | None  # metadata.deletionTimestamp as epoch seconds (Terminating)
    reason: str  # status.reason, e.g. "Evicted"
    exit_code: int | None  # first non-zero terminated exit code (0 when all exited cleanly)
    exit_container: str | None
    exit_reason: str = ""  # that container's termination reason, e.g. "OOMKilled", "Error"
    waiting_reason: str = ""  # a container's waiting reason, e.g. "ImagePullBackOff", "CrashLoopBackOff"
    waiting_message: str = ""
    waiting_container: str = ""
    unschedulable: str = ""  # the scheduler's message while PodScheduled is False (reason Unschedulable)
    owner_uid: str | None = None  # the controlling job's uid: a recreated job never adopts its predecessor's pods
    created: float | None = None  # metadata.creationTimestamp (an unschedulable pod has waited since then)
    # the readiness gate's condition (contract.CONDITION_IN_QUORUM) as the operator last set it; None: never set
    in_quorum: bool | None = None

    @property
    def terminal(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    @classmethod
    def from_pod(cls, meta: dict[str, Any], spec: dict[str, Any], status: dict[str, Any]) -> PodView:
        labels = meta.get("labels") or {}
        exit_code: int | None = None
        exit_container: str | None = None
        exit_reason = ""
        for cs in status.get("containerStatuses") or []:
            term = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated")
            if term is None:
                continue
            code = int(term.get("exitCode", 0))
            if exit_code is None or (exit_code == 0 and code != 0):
                exit_code, exit_container, exit_reason = code, cs.get("name"), term.get("reason") or ""
        waiting = next(
            (
                (cs.get("name") or "", w)
                for cs in status.get("containerStatuses") or []
                if (w := (cs.get("state") or {}).get("waiting")) and w.get("reason")
            ),
            ("", {}),
        )
        conditions = status.get("conditions") or []
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
        unschedulable = next(
            (
                c.get("message") or "the scheduler found no node for it"
                for c in conditions
                if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable"
            ),
            "",
        )
        gate = next((c.get("status") for c in conditions if c.get("type") == contract.CONDITION_IN_QUORUM), None)
        deletion = meta.get("deletionTimestamp")
        owner = next((o.get("uid") for o in meta.get("ownerReferences") or [] if o.get("controller")), None)
        return cls(
            name=meta["name"],
            uid=meta.get("uid", ""),
            role=labels.get(contract.LABEL_ROLE, ""),
            group=_int_or_none(labels.get(contract.LABEL_GROUP)),
            rank=_int_or_none(labels.get(contract.LABEL_RANK)),
            generation=_int_or_none(labels.get(contract.LABEL_GENERATION)) or 0,
            phase=status.get("phase") or "Pending",
            ready=ready,
            node=spec.get("nodeName"),
            ip=status.get("podIP"),
            deletion_time=parse_time(deletion) if deletion else None,
            reason=status.get("reason") or "",
            exit_code=exit_code,
            exit_container=exit_container,
            exit_reason=exit_reason,
            waiting_reason=waiting[1].get("reason") or "",
            waiting_message=waiting[1].get("message") or "",
            waiting_container=waiting[0],
            unschedulable=unschedulable,
            owner_uid=owner,
            created=parse_time(meta["creationTimestamp"]) if meta.get("creationTimestamp") else None,
            in_quorum=None if gate is None else gate == "True",
        )


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


# --- time helpers (status uses RFC 3339, memory uses epoch seconds) -----------------------------------------------
def parse_time(value: str | None) -> float | None:
    if not value:
        return None
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def format_time(epoch: float | None, precise: bool = False) -> str | None:
    """RFC 3339; `precise` keeps microseconds (budget windows and back-off deadlines need sub-second times)."""
    if epoch is None:
        return None
    fmt = "%Y-%m-%dT%H:%M:%S.%fZ" if precise else "%Y-%m-%dT%H:%M:%SZ"
    return dt.datetime.fromtimestamp(epoch, tz=dt.UTC).strftime(fmt)
