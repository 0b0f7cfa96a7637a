"""The worker pods' readiness gate (contract.CONDITION_IN_QUORUM) and the job's PodDisruptionBudget built on it.

A worker pod is Ready only while the lighthouse lists its generation of its group as a member of the current quorum
(contributing, spare or healing): then it holds the job's state. The budget's minAvailable is every group's pods
(builders.pod_disruption_budget), so the Eviction API (what `kubectl drain` uses) never evicts a Ready worker pod:
it evicts a pod only once that pod is out of the quorum -- the old generation of a group the operator migrated off the
draining node (cordoned: spec.nodeHealth), after its replacement registered -- or one that is not in a quorum at all
(``unhealthyPodEvictionPolicy: AlwaysAllow``). Pure: the lighthouse's view and the observed pods in, the conditions
to set out.

Which generation the lighthouse lists is told by the member's address: the IP of rank 0's pod of that generation
(each trainer advertises its pod IP, FTJOB_ADVERTISE_ADDR); a live pod's IP is its own.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ftjob import contract
from ftjob.operator.lighthouse.view import LighthouseView
from ftjob.operator.state.job_state import PodView

REASON_IN_QUORUM = "InQuorum"
REASON_NOT_IN_QUORUM = "NotInQuorum"


@dataclass(frozen=True)
class GateChange:
    """One worker pod whose readiness-gate condition must change."""

    pod: str
    in_quorum: bool
    message: str


def address_host(address: str) -> str:
    """The host of "<ip>:<port>" ("[<ipv6>]:<port>" too)."""
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host.strip("[]")


def members_in_quorum(view: LighthouseView) -> dict[str, str]:
    """group -> the host its member in the current quorum advertises (members not in it, or finished, are left out)."""
    return {
        group: address_host(m.address)
        for group, m in view.groups.items()
        if m.in_quorum and not m.finished and m.address
    }


def in_quorum(view: LighthouseView, pods: Iterable[PodView]) -> dict[str, bool]:
    """Every live worker pod (not terminal) -> whether its generation of its group is in the current quorum: that
    generation's rank-0 pod has the IP of the group's quorum member. All pods of a generation share the answer."""
    workers = [p for p in pods if p.role == contract.ROLE_WORKER and p.group is not None and not p.terminal]
    members = members_in_quorum(view)
    rank0 = {(p.group, p.generation): p.ip for p in workers if p.rank == 0 and p.ip}
    out = {}
    for p in workers:
        ip = rank0.get((p.group, p.generation))
        out[p.name] = ip is not None and members.get(str(p.group)) == ip
    return out


def gate_changes(view: LighthouseView, pods: Iterable[PodView]) -> list[GateChange]:
    """The conditions to patch: pods whose condition differs from ``in_quorum`` (a pod that never had it reads
    False already). Pods leaving the quorum come first: patched in order, the budget never counts two generations of
    a group at once."""
    pods = list(pods)
    wanted = in_quorum(view, pods)
    changes = []
    for p in pods:
        want = wanted.get(p.name)
        if want is None or want == bool(p.in_quorum):
            continue
        group = f"replica group {p.group} generation {p.generation}"
        message = f"{group} is in the lighthouse's quorum" if want else f"{group} is not in the lighthouse's quorum"
        changes.append(GateChange(p.name, want, message))
    return sorted(changes, key=lambda c: (c.in_quorum, c.pod))


def condition(change: GateChange, now: str) -> dict[str, str]:
    """The pod condition for a status patch (``now``: RFC 3339)."""
    return {
        "type": contract.CONDITION_IN_QUORUM,
        "status": "True" if change.in_quorum else "False",
        "reason": REASON_IN_QUORUM if change.in_quorum else REASON_NOT_IN_QUORUM,
        "message": change.message,
        "lastTransitionTime": now,
    }
