"""The lighthouse HTTP/WebSocket API as typed messages: one pydantic model per request and per answer.

The server validates every body against its request model and answers 400 with ``describe(error)`` when it does not
fit; clients build requests from these models and read answers through them, never by string keys. Requests refuse
unknown fields (a typo fails loudly); answers ignore them (an older client keeps working against a newer server).
A POST body is declared ``Content-Type: application/json`` (else 415) and at most 4 MiB (else 413); no path but
/v1/watch takes query parameters (400).

  POST /v1/quorum               QuorumRequest -> QuorumResponse (long-polls; 504 ErrorResponse on timeout)
  POST /v1/heartbeat            HeartbeatRequest -> HeartbeatResponse (``leaving``: the group leaves the job for good)
  POST /v1/membership/...       the operator's: its own token only, the job's worker token gets 403 (lighthouse.auth)
  POST /v1/membership/evict     EvictRequest -> EvictResponse (drops groups at once, bans their incarnation)
  POST /v1/membership/starting  StartingRequest -> StartingResponse (joiners the quorum may wait for)
  POST /v1/membership/desired   DesiredRequest -> DesiredResponse (contributing groups; extra live ones are spares;
                                each group's generation: an older one's registration is refused with 410)
  POST /v1/membership/handover             HandoverRequest -> HandoverResponse (the next incarnation replaces, no abort)
  GET  /v1/status               StatusResponse
  GET  /v1/watch?WatchQuery     WebSocket, one per group (its rank 0; the other ranks hear through the group link,
                                ftjob.ft.links.group_link): WatchHeartbeat up, AbortSignal (+ heartbeat period) down;
                                rank 0 may long-poll its quorum on it too: WatchQuorum up, WatchQuorumAnswer down
  any refusal                   ErrorResponse with a 4xx/5xx status (every malformed request: 400, 401, 403, 404, 405,
                                413 or 415, never a dropped connection or a page)
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError, model_validator

# Every integer a client sends is bounded: JSON numbers have no size, and a step of 10**40 would be kept (and sent on
# to every group, the operator and its status) as the job's committed step. 2**63 - 1 is what every client holds.
INT64_MAX = 2**63 - 1
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]
# A replica group's id is its index in decimal ("0", "1", ...); the operator also bounds it (DesiredRequest.groups).
GroupId = Annotated[str, StringConstraints(pattern=r"^(0|[1-9][0-9]{0,6})$")]
Incarnation = Annotated[str, StringConstraints(min_length=1, max_length=128)]
Address = Annotated[str, StringConstraints(min_length=1, max_length=262)]  # "<ip or DNS name>:<port>"
Digest = Annotated[str, StringConstraints(min_length=1, max_length=128)]
# How many times the operator (or the local launcher) has replaced a group: FTJOB_GENERATION, the pod label's. An
# incarnation sends it with its registration, so the lighthouse and the operator know which process of a group a
# drop concerns, and a process whose pod was replaced cannot join again. None: a client that does not say.
Generation = Annotated[int, Field(ge=0, le=INT64_MAX)]
MAX_GROUPS = 10_000_000  # group ids the operator may declare (DesiredRequest.groups)
MAX_RANKS = 65536  # ranks in one group: bounds every per-rank list a client may send


class Request(BaseModel):
    """A message a client sends: strict types (no "3" for 3, no true for 1), unknown fields refused.

    Only the keys' strings are cached when parsing JSON: the values (addresses, incarnations) differ per group, so
    pydantic's default cache of every short string would cost the lighthouse a share of every quorum request's parse
    for entries that are never hit again."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, cache_strings="keys")


class Answer(BaseModel):
    """A message the server sends: strict types, unknown fields ignored."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)


def describe(error: ValidationError) -> str:
    """One line naming every field that does not fit and why, e.g. ``step: Input should be a valid integer``."""
    parts = []
    for e in error.errors(include_url=False):
        where = ".".join(str(p) for p in e["loc"]) or "body"
        got = "" if e["type"] in ("missing", "json_invalid") or not e["loc"] else f" (got {e['input']!r:.60})"
        parts.append(f"{where}: {e['msg']}{got}")
    return f"invalid {error.title}: " + "; ".join(parts)


# --- integrity: the gradient guard's verdicts and the replicas' state digests ------------------------------------
GuardKind = Literal["nonfinite", "norm_outlier", "norm_mismatch"]  # ftjob.ft.integrity.guard
Note = Annotated[str, StringConstraints(max_length=512)]


class GuardOffence(Request):
    """One group whose gradient the guard refused in a step (every member of the quorum computes the same verdict
    from the same all-reduced norms, so any of them can report it)."""

    group: GroupId
    kind: GuardKind
    norm: Annotated[float, Field(ge=0)] | None = None  # its gradient norm (None: not finite)
    median: Annotated[float, Field(ge=0)] | None = None  # the median of the other contributors' norms


class GuardVerdict(Request):
    """A step that failed the guard: nothing committed anywhere; the offenders are named.

    The lighthouse counts an offence (offender, quorum_id) once, when at least half (rounded up) of that quorum's
    groups reported it; FTJOB_GUARD_MAX_OFFENCES of one incarnation within FTJOB_GUARD_WINDOW_S evict it
    ("gradient_guard: ..."). Refused with 400 (the whole request): an offender named twice, ``quorum_id`` above the
    request's. Ignored and audited, the request served: a quorum the lighthouse does not know (it restarted since),
    a reporter or offender that was not in that quorum."""

    quorum_id: Annotated[int, Field(ge=0, le=INT64_MAX)]
    step: Count
    offenders: Annotated[list[GuardOffence], Field(min_length=1, max_length=MAX_RANKS)]


class StateDigest(Request):
    """A digest of a group's whole registered state (parameters, optimizer, data position) as committed at ``step``:
    replicas that commit through one quorum are bitwise identical, so a different digest is a fault.

    The lighthouse compares a step's digests once every group that committed it (and is still a member) sent one, or
    at the first quorum past that step; a strict majority (>= 2 alike, more than half) wins and each other group is
    evicted ("divergent: ..."); with none, nobody is. ``step`` above the request's own ``step`` is refused with 400."""

    step: Count
    digest: Digest


# --- quorum ---------------------------------------------------------------------------------------------------
class QuorumRequest(Request):
    """Rank 0 of a group asks for this step's quorum (its other ranks learn the answer inside the group)."""

    group: GroupId
    incarnation: Incarnation  # unique per process start: a restarted group is a new member
    step: Count  # the group's committed step
    generation: Generation | None = None  # the group's generation this process belongs to (FTJOB_GENERATION)
    quorum_id: Annotated[int, Field(ge=-1, le=INT64_MAX)]  # the last quorum id this group saw, -1 at start
    address: Address  # "<ip>:<port>" of rank 0's recovery server
    store_address: Address  # "<ip>:<port>" of rank 0's TCPStore for the cross-group process group
    commit_failures: Count = 0  # failed commits since the last quorum: forces a new quorum id
    world_size: Annotated[int, Field(ge=1, le=MAX_RANKS)] = 1  # ranks in the group
    timeout_s: Annotated[float, Field(gt=0, le=86400)] = 60.0  # long-poll bound
    addresses: list[Address] | None = None  # per rank (rank i pairs with rank i of a peer)
    store_addresses: list[Address] | None = None
    want_members: bool = False  # the member list in the answer (O(groups): off by default)
    heal_seconds: Annotated[float, Field(ge=0)] | None = None  # this group's last live recovery, for metrics
    fresh: bool = False  # started from scratch and not yet synced: at step 0 it copies a peer's state first
    guard_verdict: GuardVerdict | None = None  # the guard refused the last step: who and why (reported once)
    state_digest: StateDigest | None = None  # every FTJOB_DIGEST_EVERY committed steps
    # The group's progress counter (HeartbeatRequest.progress) when it asked: a quorum request stands in for a
    # heartbeat, and a group whose steps are shorter than the heartbeat period sends no other. 0: not reported.
    progress: Count = 0

    @model_validator(mode="after")
    def _one_address_per_rank(self) -> QuorumRequest:
        for name in ("addresses", "store_addresses"):
            value = getattr(self, name)
            if value is not None and len(value) != self.world_size:
                raise ValueError(f"{name} must list one address per rank ({self.world_size}), got {value}")
        return self

    def rank_addresses(self) -> list[str]:
        return list(self.addresses or [self.address])

    def rank_store_addresses(self) -> list[str]:
        return list(self.store_addresses or [self.store_address])


class RecoverySource(Answer):
    """The group a healing group copies its state from (rank i from ``addresses[i]``)."""

    group: str
    address: str
    addresses: list[str]
    step: int


class QuorumMember(Answer):
    group: str
    step: int
    address: str
    store_address: str
    contributing: bool


class QuorumResponse(Answer):
    """This step's quorum as one group sees it."""

    quorum_id: int
    max_step: int  # the step this quorum trains; groups behind it heal first
    replica_rank: int  # this group's place among the members (its rank in the cross-group process group)
    replica_world_size: int
    contributing: bool  # False: a spare or a healing group (sends zero gradients, is not counted)
    contributor_rank: int  # index among the contributors (data shard), -1 when not contributing
    num_contributors: int  # gradient divisor / number of data shards this step
    heal: bool
    recover_from: RecoverySource | None = None
    store_address: str  # where the cross-group process group meets (rank 0's store; per rank below)
    store_addresses: list[str]
    store_prefix: str
    serve_recovery: bool = False  # a healer copies from this group this step: publish a snapshot
    abort_below: int  # in-flight quorums with a lower id must abort their collectives
    members: list[QuorumMember] | None = None  # only with want_members


# --- heartbeats and the watch socket ----------------------------------------------------------------------------
class HeartbeatRequest(Request):
    group: GroupId
    incarnation: Incarnation
    step: Count
    generation: Generation | None = None  # as in QuorumRequest
    rank: Annotated[int, Field(ge=0, lt=MAX_RANKS)] = 0  # only rank 0's heartbeats count
    finished: bool = False  # this group trained its last step
    param_digest: Digest | None = None  # sha256 of its final parameters (with finished)
    progress: Count = 0  # bumped at every protocol point of the step (the group's slowest rank): a hang stops it
    waiting: bool = False  # every rank of the group is blocked in the step's cross-group collective
    # This group leaves the job for good at a step boundary (its processes were asked to terminate: SIGTERM). The
    # lighthouse drops it now and bans its incarnation; having committed the last quorum's step (``step`` above that
    # quorum's), it is no missing member of it, so the others' next quorum forms at once without it and nothing
    # aborts. One still in that step is lost as on a disconnect (the step in flight aborts).
    leaving: bool = False


class HeartbeatResponse(Answer):
    ok: bool
    quorum_id: int
    abort_below: int


class WatchQuery(BaseModel):
    """Query parameters of ``GET /v1/watch`` (strings on the wire, hence not strict)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    group: GroupId
    incarnation: Incarnation
    rank: Annotated[int, Field(ge=0, lt=MAX_RANKS)] = 0
    generation: Generation | None = None  # as in QuorumRequest


class WatchHeartbeat(Request):
    """One heartbeat text frame a rank sends on its watch socket."""

    step: Count
    finished: bool = False
    param_digest: Digest | None = None
    progress: Count = 0  # as in HeartbeatRequest
    waiting: bool = False


class AbortSignal(Answer):
    """Pushed on every watch socket when the in-flight quorum must abort (a member was dropped); also the socket's
    first frame, and pushed again whenever ``heartbeat_interval_s`` changes."""

    quorum_id: int
    abort_below: int
    # the heartbeat period the lighthouse asks for: it grows with the number of groups so that their total heartbeat
    # rate stays within what one lighthouse holds, and stays well below its heartbeat timeout. None: an older server
    heartbeat_interval_s: float | None = None


class WatchQuorum(Request):
    """A quorum request (rank 0) sent as a text frame on the group's watch socket instead of POST /v1/quorum: the
    same long-poll without a second connection per group. Answered by one WatchQuorumAnswer frame; a newer request
    supersedes a pending one (answered 409), as over HTTP. Its group and incarnation must be the socket's."""

    kind: Literal["quorum"]
    request: QuorumRequest


class WatchQuorumAnswer(Answer):
    """The answer to a WatchQuorum: ``quorum`` with status 200, else the status and error POST /v1/quorum would
    have answered (400, 403, 409, 410, 504, 503)."""

    kind: Literal["quorum"] = "quorum"
    status: int
    quorum: QuorumResponse | None = None
    error: str | None = None


# --- the operator's membership API ------------------------------------------------------------------------------
class EvictRequest(Request):
    groups: Annotated[list[GroupId], Field(max_length=MAX_RANKS)]
    reason: Annotated[str, StringConstraints(max_length=512)] = "operator"


class EvictResponse(Answer):
    evicted: list[str]
    abort_below: int


class HandoverRequest(Request):
    """Make-before-break: these groups' next incarnation (already starting elsewhere) replaces the current one, which
    goes on training until then. The in-flight quorum is not aborted when the new incarnation registers."""

    groups: Annotated[list[GroupId], Field(max_length=MAX_RANKS)]
    reason: Annotated[str, StringConstraints(max_length=512)] = "operator"


class HandoverResponse(Answer):
    handing_over: list[str]  # every group named: the mark holds until its new incarnation registers or it expires
    expires_in_s: float  # the mark lapses after this long if no new incarnation came (then a restart aborts again)


class StartingRequest(Request):
    groups: Annotated[list[GroupId], Field(max_length=MAX_RANKS)]


class StartingResponse(Answer):
    starting: list[str]


class DesiredRequest(Request):
    replicas: Annotated[int, Field(ge=1, le=MAX_GROUPS)]
    # every group index the operator created is below this (replicas + spares, following scaling); the lighthouse
    # then refuses any other group id with 403. None: no bound (a local run without an operator)
    groups: Annotated[int, Field(ge=1, le=MAX_GROUPS)] | None = None
    # group -> the oldest generation of it that still runs (while a group migrates, the one handing over): a process
    # of an older generation is gone or going (its pod was replaced), so the lighthouse refuses its registration
    # (410) and drops it if it is a member. Needs ``groups`` (every id below it). None: nothing declared
    generations: Annotated[dict[GroupId, Generation], Field(max_length=MAX_GROUPS)] | None = None

    @model_validator(mode="after")
    def _room_for_the_contributors(self) -> DesiredRequest:
        if self.groups is not None and self.groups < self.replicas:
            raise ValueError(f"groups ({self.groups}) must be >= replicas ({self.replicas})")
        if self.generations:
            if self.groups is None:
                raise ValueError("generations need groups (the bound every declared group id is below)")
            outside = sorted((g for g in self.generations if int(g) >= self.groups), key=int)
            if outside:
                raise ValueError(f"generations name group(s) {outside[:10]} outside 0..{self.groups - 1}")
        return self


class DesiredResponse(Answer):
    replicas: int
    groups: int | None = None


# --- status -----------------------------------------------------------------------------------------------------
class MemberStatus(Answer):
    group: str
    incarnation: str
    step: int
    address: str
    last_heartbeat_age_s: float
    in_quorum: bool
    asking: bool
    healing: bool
    contributing: bool
    finished: bool
    param_digest: str | None = None
    generation: int | None = None  # the generation the member said it belongs to (None: it did not say)


class DroppedEvent(Answer):
    event: Literal["dropped"] = "dropped"
    time: float
    group: str
    # "heartbeat_timeout", "disconnected", "restarted", "left" (HeartbeatRequest.leaving), "evicted: <why>" or
    # "handed_over: <why>"
    reason: str
    # the dropped incarnation's generation (None: it did not say): an old generation's drop is no failure of the
    # group's current one
    generation: int | None = None


class QuorumEvent(Answer):
    event: Literal["quorum"] = "quorum"
    time: float
    quorum_id: int
    groups: list[str]
    step: int


class RestoredEvent(Answer):
    """The job went on below its committed step: every incarnation that held it was gone (the whole job lost, or
    suspended and resumed), so the quorum ``quorum_id`` started from the best step the groups brought back (their
    checkpoint's, or 0 without one). ``from_step - to_step`` steps are trained again."""

    event: Literal["restored"] = "restored"
    time: float
    quorum_id: int
    from_step: int
    to_step: int


HistoryEvent = Annotated[DroppedEvent | QuorumEvent | RestoredEvent, Field(discriminator="event")]


AuditKind = Literal["join", "leave", "evict", "refused", "guard", "divergence"]


class AuditRecord(Answer):
    """One line of the lighthouse's audit trail (also written to its log as JSON): a membership change, a refused
    request, or a guard / divergence verdict. Refusals of one kind from one peer are folded to one line per 5 s
    whose outcome counts the rest ("refused 401 (x37 more from 10.0.0.9 in the last 5s)")."""

    seq: int  # increasing from 1 in this lighthouse's life
    time: float  # the lighthouse's clock (as history's)
    wall_time: float  # unix time
    kind: AuditKind
    group: str | None = None  # the group concerned, when one is
    actor: str  # who asked: "group 1 (incarnation ab12...) from 10.0.0.5", "operator from 10.0.0.2", ...
    reason: str  # why, in words
    outcome: str  # what the lighthouse did: "joined", "evicted", "refused 401", "step not committed", ...


class IntegrityStatus(Answer):
    """The gradient guard's and the digest check's counts (the lighthouse's life)."""

    guard_offences: dict[str, int] = {}  # per group: steps the guard refused it in
    guard_evictions: dict[str, int] = {}  # per group: evictions for repeated guard offences
    divergences: dict[str, int] = {}  # per group: times its digest differed from the majority's
    digests_compared: int = 0  # steps whose digests were compared
    last_compared_step: int | None = None  # the newest step whose digests were compared


class StatusResponse(Answer):
    quorum_id: int
    max_step: int  # the highest step any quorum started from: the job's committed step
    abort_below: int
    min_replicas: int
    desired_replicas: int | None = None
    quorum_groups: list[str]  # members of the last quorum
    members: list[MemberStatus]
    starting: list[str]
    handing_over: list[str] = []  # groups marked for a handover, new incarnation not seen yet
    blocked_reason: str
    history: list[HistoryEvent]
    # the lighthouse's clock (that of the history's times, not wall time) when it answered: an event happened
    # `clock - event.time` seconds before the answer. None from a lighthouse older than this field
    clock: float | None = None
    integrity: IntegrityStatus = IntegrityStatus()
    # the newest job-level audit records (guard, divergence, evictions; refusals folded one per kind and minute),
    # oldest first, at most 100; `seq` lets a poller pick up only the new ones
    audit: list[AuditRecord] = []
    last_restore: RestoredEvent | None = None  # the newest restore (kept after the history has moved past it)


class ErrorResponse(Answer):
    """Every refusal of an ftjob HTTP server (lighthouse, recovery): what is wrong and how to fix it. A refused request
    changes nothing."""

    error: str
