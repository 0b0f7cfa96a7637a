"""Why a replica group cannot start: the scheduler's, the kubelet's or the apiserver's own words, for status and Events.

Pure functions over PodViews: a group that is down only because its pods are still starting has no blocker; one whose
pods cannot be scheduled, cannot pull their image, crash-loop, or could not even be created has one, and the job's
Degraded condition, the group's status entry, `kubectl get ftj` and an Event all say which and why.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ftjob.operator.state.job_state import PodView

# Reasons (also the Degraded condition's reason and the job-level status.reason)
REASON_UNSCHEDULABLE = "Unschedulable"
REASON_POD_CREATION_REFUSED = "PodCreationRefused"
# container waiting reasons that do not go away by themselves (ContainerCreating and PodInitializing do)
STUCK_WAITING_REASONS = (
    "ErrImagePull",
    "ImagePullBackOff",
    "InvalidImageName",
    "CrashLoopBackOff",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
)
# the most telling first: a pod that cannot be created hides every later problem
_PRIORITY = (REASON_POD_CREATION_REFUSED, REASON_UNSCHEDULABLE, *STUCK_WAITING_REASONS)


@dataclass(frozen=True)
class Blocker:
    reason: str
    message: str

    def line(self) -> str:
        return f"{self.reason}: {self.message}"


def pod_blocker(pod: PodView) -> Blocker | None:
    if pod.terminal or pod.deletion_time is not None:
        return None
    if pod.unschedulable:
        return Blocker(REASON_UNSCHEDULABLE, f"pod {pod.name}: {pod.unschedulable}")
    if pod.waiting_reason in STUCK_WAITING_REASONS:
        detail = f": {pod.waiting_message}" if pod.waiting_message else ""
        return Blocker(pod.waiting_reason, f"pod {pod.name} container {pod.waiting_container}{detail}")
    return None


def group_blocker(pods: Iterable[PodView], create_refused: str = "") -> Blocker | None:
    """The most telling blocker among one group's current pods (or the apiserver's refusal to create them)."""
    found = [b for p in pods if (b := pod_blocker(p)) is not None]
    if create_refused:
        found.append(Blocker(REASON_POD_CREATION_REFUSED, create_refused))
    if not found:
        return None
    return min(found, key=lambda b: _PRIORITY.index(b.reason))


LIGHTHOUSE = -1  # the key of the lighthouse's own blocker in the maps below


def job_blocker(blockers: dict[int, Blocker]) -> Blocker | None:
    """One line for the job: the most telling reason, the groups (or the lighthouse) it holds back, one message."""
    if not blockers:
        return None
    top = min(blockers.values(), key=lambda b: _PRIORITY.index(b.reason))
    held = sorted(i for i, b in blockers.items() if b.reason == top.reason)
    groups = [i for i in held if i != LIGHTHOUSE]
    who = [f"replica groups {groups}"] if groups else []
    who += ["the lighthouse"] if LIGHTHOUSE in held else []
    return Blocker(top.reason, f"{' and '.join(who)} cannot start: {blockers[held[0]].message}")


__all__ = [
    "LIGHTHOUSE",
    "REASON_POD_CREATION_REFUSED",
    "REASON_UNSCHEDULABLE",
    "STUCK_WAITING_REASONS",
    "Blocker",
    "group_blocker",
    "job_blocker",
    "pod_blocker",
]
