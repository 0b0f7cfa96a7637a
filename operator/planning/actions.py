"""What the planner reads (Observed) and decides (Actions, Events, Result): plain data, no Kubernetes client."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from ftjob.operator.planning.integrity_evictions import Drop
from ftjob.operator.state.job_state import JobState, PodView


@dataclass
class Observed:
    pods: list[PodView]
    node_ready: Mapping[str, bool] | None  # None when nodes cannot be watched
    deleting: set[str]  # pods this operator already asked to delete
    now: float
    finished_groups: set[int] = field(default_factory=set)  # groups the lighthouse reports finished
    # groups whose pods run but which stopped heartbeating to the lighthouse (hung or cut off): group -> why
    silent_groups: dict[int, str] = field(default_factory=dict)
    degraded_nodes: Mapping[str, str] = field(default_factory=dict)  # node -> why it is degrading (nodeHealth)
    # group -> its latest eviction by the lighthouse for integrity or a stall (at: wall time), and its generation
    integrity_drops: Mapping[int, Drop] = field(default_factory=dict)


@dataclass
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


@dataclass
class Actions:
    evict: list[tuple[int, str]] = field(default_factory=list)  # (group, reason): told to the lighthouse first
    persist_first: bool = False
    delete_pods: list[tuple[str, bool]] = field(default_factory=list)  # (name, force)
    create_pods: list[tuple[int, int, int]] = field(default_factory=list)  # (group, rank, generation)
    create_lighthouse: int | None = None  # generation to create
    handover: list[tuple[int, str]] = field(default_factory=list)  # (group, why): told to the lighthouse first
    failed_nodes: list[str] = field(default_factory=list)  # the node of each group failure (cordon policy)
    group_services: list[int] = field(default_factory=list)  # must exist
    delete_group_services: list[int] = field(default_factory=list)
    starting: list[int] = field(default_factory=list)  # groups whose new pods were just created
    events: list[Event] = field(default_factory=list)
    restarts: list[str] = field(default_factory=list)  # reasons, for metrics
    recovered: list[float] = field(default_factory=list)  # failure -> replacement running, seconds
    requeue_after: float | None = None
    delete_job: bool = False

    def requeue(self, delay: float) -> None:
        delay = max(delay, 0.05)
        self.requeue_after = delay if self.requeue_after is None else min(self.requeue_after, delay)


@dataclass
class Result:
    state: JobState
    actions: Actions
    group_phases: dict[int, str]
