"""What the operator remembers of one job (round-tripped through .status) and what it observes of its pods.

Plain data with no Kubernetes client, so the planner built on it is unit-testable.
"""

from __future__ import annotations

import copy
import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from ftjob import contract

OUTCOME_SUCCEEDED = "Succeeded"
OUTCOME_FAILED = "Failed"


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
