"""Integrity (spec.integrity): a replica group the lighthouse evicted itself, for repeated gradient-guard offences
or a state digest that differs from the majority's, becomes a failure with its own reason; and the job's integrity
counters in .status. Pure: no client, no clock.

The lighthouse drops such a group at once (its history: "evicted: gradient_guard: ..." / "evicted: divergent: ...")
and the evicted trainer exits non-zero by itself. The operator replaces the group as soon as it sees either: the
eviction (then the pod's exit is an old generation's, never counted again) or the pod's exit (then the eviction in
the lighthouse's history names the reason instead of ExitCode). A drop that names its generation (the trainer sends
FTJOB_GENERATION) counts only against that generation: a replaced process's late eviction is no failure of its
replacement.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

from ftjob.contract.lighthouse_api import IntegrityStatus
from ftjob.operator.planning.failures import REASON_GRADIENT_GUARD, REASON_REPLICA_DIVERGENCE, REASON_STALLED, Failure
from ftjob.operator.state.job_spec import ACTION_RESTART_GROUP
from ftjob.operator.state.job_state import GroupState, JobState, PodView

EVICTED = "evicted: "
# the lighthouse's eviction reasons (ftjob.lighthouse) -> the operator's failure reasons
# (a "stalled" group, ftjob.lighthouse.core.stall, is replaced the same way, but it is no integrity verdict: its node is
# avoided only as any failed group's is, and it is not counted as an integrity eviction)
VERDICTS = {"gradient_guard": REASON_GRADIENT_GUARD, "divergent": REASON_REPLICA_DIVERGENCE, "stalled": REASON_STALLED}
INTEGRITY_REASONS = frozenset({REASON_GRADIENT_GUARD, REASON_REPLICA_DIVERGENCE})
COUNTERS = ("guardOffences", "guardEvictions", "divergences", "digestsCompared")


class Drop(NamedTuple):
    """A group's latest eviction by the lighthouse: when (in a LighthouseView, seconds before its answer; in
    Observed, wall time), the lighthouse's reason, and the generation of the incarnation it dropped (None: that
    trainer did not say which)."""

    at: float
    reason: str
    generation: int | None = None


def integrity_reason(drop_reason: str) -> str | None:
    """GradientGuard / ReplicaDivergence for a lighthouse history drop reason of an integrity eviction, else None."""
    if not drop_reason.startswith(EVICTED):
        return None
    why = drop_reason[len(EVICTED) :]
    return next((reason for verdict, reason in VERDICTS.items() if why.split(":", 1)[0].strip() == verdict), None)


def eviction_of_generation(g: GroupState, current: list[PodView], drop: Drop | None) -> str | None:
    """The lighthouse's reason when `drop` (the group's latest integrity eviction) concerns the group's current
    generation: the drop names it, or (a trainer that does not say) it happened after this generation began. An
    earlier generation's eviction stays in the lighthouse's history long after that generation was replaced (perhaps
    for another reason first), and a replaced process may even be evicted after its replacement began."""
    if drop is None or not current:
        return None
    if drop.generation is not None:
        return drop.reason if drop.generation == g.generation else None
    if g.migrating_from is not None:
        return None  # (while migrating, an eviction may be the old generation's, which leaves anyway)
    began = g.generation_since
    if began is None:  # a status written before this field existed: the pods' creation (apiserver clock, seconds)
        created = [p.created for p in current if p.created is not None]
        began = max(created) if len(created) == len(current) else None
    if began is None or drop.at <= began:
        return None
    return drop.reason


def integrity_failure(group: int, why: str, current: list[PodView], seen: Failure | None) -> Failure:
    """The group's failure as what the lighthouse saw; it replaces `seen` (the evicted trainer's own exit, or its
    silence): that was only the consequence. The node is avoided strictly: the numbers came from its hardware."""
    reason = integrity_reason(why) or REASON_GRADIENT_GUARD
    pod = next((p for p in sorted(current, key=lambda p: p.rank or 0) if p.node), current[0])
    message = f"the lighthouse evicted replica group {group}: {why.removeprefix(EVICTED)}"
    if pod.node:
        message += f" (its rank-{pod.rank or 0} pod ran on node {pod.node})"
    node_lost = seen.node_lost if seen is not None else False
    return Failure(reason, message, pod.name, pod.node, None, ACTION_RESTART_GROUP, node_lost,
                   avoid_strictly=reason in INTEGRITY_REASONS, evicted_by_lighthouse=True)  # fmt: skip


def failed_pods(pods: list[PodView], state: JobState) -> set[str]:
    """Failed pods of the groups' current generations (an evicted trainer's exit is one)."""
    return {
        p.name
        for p in pods
        if p.phase == "Failed" and p.group in state.groups and p.generation == state.groups[p.group].generation
    }


def integrity_drops(drops: Mapping[str, Drop], view_at: float) -> dict[int, Drop]:
    """group -> its latest integrity eviction at wall time, from a lighthouse view's drops (seconds before the
    answer) and the time the answer was read."""
    return {int(g): d._replace(at=view_at - d.at) for g, d in drops.items() if g.isdigit()}


def status_integrity(
    previous: Mapping[str, Any] | None, counts: IntegrityStatus | None, lighthouse_generation: int | None,
    audit_seq: int,
) -> dict[str, Any] | None:  # fmt: skip
    """`.status.integrity`: the lighthouse's counters summed over the job's life. A replacement lighthouse counts
    from zero, so the totals of the ones before are kept (`earlier`, the operator's memory). `auditSeq` is the
    newest audit record of lighthouse `lighthouseGeneration` mirrored as an Event."""
    previous = dict(previous or {})
    if counts is None or lighthouse_generation is None:
        if not previous:
            return None
        return {**previous, "auditSeq": audit_seq} if previous.get("auditSeq") != audit_seq else previous
    earlier = {k: int(v) for k, v in (previous.get("earlier") or {}).items() if k in COUNTERS}
    if previous and previous.get("lighthouseGeneration") != lighthouse_generation:
        earlier = {k: int(previous.get(k) or 0) for k in COUNTERS}  # the lighthouse before: its last totals
    now = {
        "guardOffences": sum(counts.guard_offences.values()),
        "guardEvictions": sum(counts.guard_evictions.values()),
        "divergences": sum(counts.divergences.values()),
        "digestsCompared": counts.digests_compared,
    }
    out: dict[str, Any] = {k: earlier.get(k, 0) + now[k] for k in COUNTERS}
    last = counts.last_compared_step if counts.last_compared_step is not None else previous.get("lastComparedStep")
    if last is not None:
        out["lastComparedStep"] = last
    out.update(lighthouseGeneration=lighthouse_generation, auditSeq=audit_seq, earlier=earlier)
    return out
