"""The lighthouse's view of one replica group (Member), a formed quorum (Formed), the refusals its core raises, and
the order groups sort in. Pure data: no I/O, no clock."""

from __future__ import annotations

from dataclasses import dataclass, field

from ftjob.lighthouse.core.answers import Answers


class QuorumError(Exception):
    """A request the lighthouse refuses; ``status`` is the HTTP status the server answers with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class BadRequest(QuorumError):
    def __init__(self, message: str) -> None:
        super().__init__(400, message)


class Outdated(QuorumError):
    """410 for a process of a generation the operator replaced (its pod is gone or going): it never joins again."""

    def __init__(self, message: str) -> None:
        super().__init__(410, message)


@dataclass
class Member:
    """One live replica group as the lighthouse knows it."""

    group: str
    incarnation: str
    last_seen: float
    generation: int | None = None  # the group's generation this process said it belongs to (None: it did not)
    step: int = 0
    address: str = ""
    store_address: str = ""
    addresses: list[str] = field(default_factory=list)  # per rank: recovery servers
    store_addresses: list[str] = field(default_factory=list)  # per rank: TCPStore hosts
    world_size: int = 1
    asking: bool = False
    commit_failures: int = 0
    finished: bool = False
    param_digest: str | None = None
    healing: bool = False
    contributing: bool = False
    fresh: bool = False  # started from scratch, state not yet synced with the job's
    progress: int = 0  # the group's progress counter, and since when it holds this value (ftjob.lighthouse.core.stall)
    progress_at: float = 0.0
    waiting: bool = False  # blocked in the step's cross-group collective
    sort_key: tuple[int, int, str] = (0, 0, "")  # group_sort_key(group), computed once (forming sorts 12,500 groups)

    def __post_init__(self) -> None:
        self.sort_key = group_sort_key(self.group)


@dataclass(frozen=True)
class Formed:
    """A quorum just issued: ``responses`` maps each member group to its answer."""

    quorum_id: int
    max_step: int
    groups: tuple[str, ...]
    changed: bool
    heals: int
    responses: Answers  # group -> QuorumResponse; .encoded(group): its JSON, the shared part encoded once


def group_sort_key(group: str) -> tuple[int, int, str]:
    """Numeric group ids sort as numbers ("2" < "10"), anything else after them by text."""
    return (0, int(group), "") if group.isdigit() else (1, 0, group)
