"""What the lighthouse's core shows: the last quorum's member list and the status API's answer."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ftjob.contract.lighthouse_api import MemberStatus, QuorumMember, StatusResponse
from ftjob.lighthouse.core.members import group_sort_key

if TYPE_CHECKING:
    from ftjob.lighthouse.core.quorum import QuorumCore


def members_view(core: QuorumCore) -> list[QuorumMember]:
    """The last quorum's member list (for requests that ask for it)."""
    out = []
    for group in core.prev:
        m = core.members.get(group)
        if m is not None:
            out.append(
                QuorumMember(
                    group=m.group,
                    step=m.step,
                    address=m.address,
                    store_address=m.store_address,
                    contributing=m.contributing,
                )
            )
    return out


def status(core: QuorumCore, now: float) -> StatusResponse:
    members = [
        MemberStatus(
            group=m.group,
            incarnation=m.incarnation,
            step=m.step,
            address=m.address,
            last_heartbeat_age_s=round(now - m.last_seen, 3),
            in_quorum=core.prev.get(m.group) == m.incarnation,
            asking=m.asking,
            healing=m.healing,
            contributing=m.contributing,
            finished=m.finished,
            param_digest=m.param_digest,
            generation=m.generation,
        )
        for m in sorted(core.members.values(), key=lambda m: group_sort_key(m.group))
    ]
    return StatusResponse(
        quorum_id=core.quorum_id,
        max_step=core.committed_step,
        abort_below=core.abort_below,
        min_replicas=core.min_replicas,
        desired_replicas=core.desired,
        quorum_groups=list(core.prev),
        members=members,
        starting=sorted(g for g, until in core.starting.items() if until > now),
        handing_over=sorted(core.handovers.pending(now), key=group_sort_key),
        blocked_reason=core.blocked_reason,
        history=list(core.history)[-50:],
        clock=now,
        last_restore=core.last_restore,
    )
