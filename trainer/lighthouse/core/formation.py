"""Who does what in a quorum being formed: the contributors (data shards), who heals from whom, who serves a
recovery, and each member's own part of the answer. Pure logic over the askers, sorted as the quorum ranks them."""

from __future__ import annotations

from ftjob.contract.lighthouse_api import RecoverySource
from ftjob.lighthouse.core.answers import Own
from ftjob.lighthouse.core.members import Member


def assign(askers: list[Member], max_step: int, prev_contributors: set[str], desired: int | None
           ) -> tuple[list[str], dict[str, Own], int]:  # fmt: skip
    """(contributors in rank order, each member's Own fields, how many heal); sets each member's healing and
    contributing flags. ``askers`` sorted by their sort_key."""
    up_to_date = [m for m in askers if m.step == max_step]
    reference, sync_healers = initial_sync(askers, up_to_date, max_step)
    # Contributors: keep last quorum's contributors first (stable sharding), spares fill in for lost ones. The askers
    # come sorted, so no sort: every up-to-date group, or the first ``desired`` of last quorum's then of the rest.
    contributors = [m.group for m in up_to_date]
    if desired is not None and desired < len(up_to_date):
        ranked = [g for g in contributors if g in prev_contributors] + [
            g for g in contributors if g not in prev_contributors
        ]
        chosen = set(ranked[:desired])
        contributors = [g for g in contributors if g in chosen]
    contributor_rank = {g: i for i, g in enumerate(contributors)}
    sources: dict[str, Member | None] = {}
    heals = 0
    for member in askers:
        source = None
        if member.step < max_step:  # behind: copy from an up-to-date group, spread over them
            source = up_to_date[heals % len(up_to_date)]
        elif member.group in sync_healers:  # fresh at step 0: copy the reference's state first
            source = reference
        heals += source is not None
        sources[member.group] = source
        member.healing = source is not None
        member.contributing = member.group in contributor_rank
    serving = {s.group for s in sources.values() if s is not None}
    own: dict[str, Own] = {}  # each member's own fields; the rest is shared (ftjob.lighthouse.core.answers)
    for replica_rank, member in enumerate(askers):
        source = sources[member.group]
        recover_from = None
        if source is not None:
            recover_from = RecoverySource(
                group=source.group, address=source.address, addresses=source.addresses, step=source.step
            )
        own[member.group] = Own(replica_rank, member.contributing, contributor_rank.get(member.group, -1),
                                recover_from, member.group in serving)  # fmt: skip
    return contributors, own, heals


def initial_sync(askers: list[Member], up_to_date: list[Member], max_step: int) -> tuple[Member | None, set[str]]:
    """At step 0, groups that started from scratch copy one reference group's state before training together, so
    no group trains from weights of its own. The reference is a group synced earlier, else the first asker."""
    if max_step != 0 or not any(m.fresh for m in askers):
        return None, set()
    synced = [m for m in up_to_date if not m.fresh]
    reference = synced[0] if synced else up_to_date[0]
    return reference, {m.group for m in askers if m.fresh and m is not reference}
