"""The job's .status: aggregated from the plan, the pods and the lighthouse, and read back into JobState.

status.replicaGroups[] doubles as the operator's durable memory (generation, restart times, back-off) so a
restarted or newly elected operator continues exactly where the last one stopped.
"""

from __future__ import annotations

from typing import Any

from ftjob import contract
from ftjob.operator.lighthouse.view import LighthouseView
from ftjob.operator.planning import plan as P
from ftjob.operator.planning.stuck import (
    LIGHTHOUSE,
    REASON_POD_CREATION_REFUSED,
    Blocker,
    group_blocker,
    job_blocker,
    pod_blocker,
)
from ftjob.operator.state import names
from ftjob.operator.state.job_spec import JobSpec
from ftjob.operator.state.job_state import (
    OUTCOME_FAILED,
    OUTCOME_SUCCEEDED,
    GroupState,
    JobState,
    PodView,
    format_time,
    parse_time,
)

CONDITION_TYPES = ("Created", "Running", "Degraded", "Recovering", "Suspended", "Succeeded", "Failed")


def state_from_status(status: dict[str, Any] | None) -> JobState:
    status = status or {}
    s = JobState()
    for g in status.get("replicaGroups") or []:
        idx = int(g["index"])
        s.groups[idx] = GroupState(
            index=idx,
            generation=int(g.get("generation", 0)),
            restarts=int(g.get("restarts", 0)),
            restart_times=[t for t in (parse_time(x) for x in g.get("restartTimes") or []) if t is not None],
            avoid_node=g.get("avoidNode"),
            avoid_required=bool(g.get("avoidNodeRequired", False)),
            not_before=parse_time(g.get("notBefore")) or 0.0,
            failed_at=parse_time(g.get("failedAt")),
            last_failure=g.get("lastFailure") or "",
            last_failure_reason=g.get("lastFailureReason") or "",
            generation_since=parse_time(g.get("generationSince")),
            all_pods_seen=bool(g.get("allPodsSeen", False)),
            migrating_from=None if g.get("migratingFrom") is None else int(g["migratingFrom"]),
            migrating_since=parse_time(g.get("migratingSince")),
        )
    s.retired_generations = {int(k): int(v) for k, v in (status.get("retiredGenerations") or {}).items()}
    lh = status.get("lighthouse") or {}
    s.lighthouse_generation = int(lh.get("generation", 0))
    s.lighthouse_seen = bool(lh.get("seen", False))
    s.total_restarts = int(status.get("totalRestarts", 0))
    s.restarts_by_reason = {str(k): int(v) for k, v in (status.get("restartsByReason") or {}).items()}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    s.suspended = (conditions.get("Suspended") or {}).get("status") == "True"
    for outcome in (OUTCOME_FAILED, OUTCOME_SUCCEEDED):
        c = conditions.get(outcome) or {}
        if c.get("status") == "True":
            s.outcome, s.outcome_reason, s.outcome_message = outcome, c.get("reason", ""), c.get("message", "")
            break
    s.start_time = parse_time(status.get("startTime"))
    s.completion_time = parse_time(status.get("completionTime"))
    s.completing_since = parse_time(status.get("completingSince"))
    return s


REASON_BELOW_MIN_REPLICAS = "BelowMinReplicas"
REASON_RESTORED = "Restored"  # the whole job went on from an older checkpoint (or step 0)
REASON_LIGHTHOUSE_NOT_RUNNING = "LighthouseNotRunning"


def lighthouse_down(
    job: str, state: JobState, pods: list[PodView], create_refused: dict[int, str] | None = None
) -> str | None:
    """Why the job's current lighthouse pod is not running (missing, refused, Pending, Terminating, ended), or None
    when it runs: without it no quorum forms, however many groups run."""
    name = names.lighthouse_pod(job, state.lighthouse_generation)
    pod = next((p for p in pods if p.role == contract.ROLE_LIGHTHOUSE and p.name == name), None)
    if pod is None:
        refused = (create_refused or {}).get(LIGHTHOUSE)
        if refused:
            return f"the apiserver refused to create lighthouse pod {name}: {refused}"
        return f"lighthouse pod {name} does not exist yet"
    if pod.deletion_time is not None:
        return f"lighthouse pod {name} is terminating"
    if pod.phase == "Running":
        return None
    if pod.terminal:
        how = f"exit code {pod.exit_code}" if pod.exit_code is not None else ""
        detail = ", ".join(x for x in (how, pod.exit_reason or pod.reason) if x)
        return f"lighthouse pod {name} {pod.phase.lower()}" + (f" ({detail})" if detail else "")
    blocker = pod_blocker(pod)
    return f"lighthouse pod {name} is {pod.phase}" + (f" ({blocker.line()})" if blocker else "")


def build_status(
    *,
    job: str,
    spec: JobSpec,
    state: JobState,
    phases: dict[int, str],
    pods: list[PodView],
    lighthouse: LighthouseView | None,
    previous: dict[str, Any] | None,
    generation: int | None,
    now: float,
    create_refused: dict[int, str] | None = None,
    goodput: dict[str, Any] | None = None,
    history: list[dict[str, Any]] | None = None,
    integrity: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`create_refused`: group -> the apiserver's message when it refused to create that group's pods.
    `goodput`, `history`: from progress.track; `integrity`: from integrity.status_integrity (None keeps what
    `previous` had)."""
    lh_groups = lighthouse.groups if lighthouse else {}
    blockers: dict[int, Blocker] = {}
    groups_out: list[dict[str, Any]] = []
    running = 0
    by_group: dict[int | None, list[PodView]] = {}
    for p in pods:
        if p.role == contract.ROLE_WORKER:
            by_group.setdefault(p.group, []).append(p)
    for idx in sorted(state.groups):
        g = state.groups[idx]
        mine = sorted((p for p in by_group.get(idx, ()) if p.generation == g.generation), key=lambda p: p.rank or 0)
        phase = phases.get(idx, P.PHASE_PENDING)
        if phase == P.PHASE_RUNNING:
            running += 1
        blocker = None
        if phase != P.PHASE_RUNNING and state.outcome is None and not state.suspended:
            blocker = group_blocker(mine, (create_refused or {}).get(idx, ""))
        if blocker is not None:
            blockers[idx] = blocker
        migrating = None
        if g.migrating_from is not None:
            waits = group_blocker(mine, (create_refused or {}).get(idx, ""))
            migrating = f"{g.last_failure}; generation {g.migrating_from} trains on until generation {g.generation} "
            migrating += f"takes over ({waits.line()})" if waits else "takes over"
        info = lh_groups.get(str(idx))
        contributing = info.contributing if info else None
        entry: dict[str, Any] = {
            "index": idx,
            "phase": phase,
            "generation": g.generation,
            "restarts": g.restarts,
            "pods": [p.name for p in mine],
            "node": next((p.node for p in mine if p.node), None),
            "step": info.step if info else None,
            "contributing": contributing,
            "spare": None if contributing is None else (not contributing and phase == P.PHASE_RUNNING),
            "finished": info.finished if info else None,
            "paramDigest": info.param_digest if info else None,
            "restartTimes": [format_time(t, precise=True) for t in g.restart_times],
            "avoidNode": g.avoid_node,
            "avoidNodeRequired": g.avoid_required,
            "notBefore": format_time(g.not_before, precise=True) if g.not_before else None,
            "failedAt": format_time(g.failed_at, precise=True),
            "lastFailure": g.last_failure or None,
            "lastFailureReason": g.last_failure_reason or None,
            "generationSince": format_time(g.generation_since, precise=True),
            "waiting": blocker.line() if blocker else None,
            "allPodsSeen": g.all_pods_seen,
            "migrating": migrating,
            "migratingFrom": g.migrating_from,
            "migratingSince": format_time(g.migrating_since, precise=True),
        }
        groups_out.append({k: v for k, v in entry.items() if v is not None})

    if state.outcome is None and not state.suspended:
        lighthouse_pods = [p for p in pods if p.role == contract.ROLE_LIGHTHOUSE and p.phase != "Running"]
        lh_blocker = group_blocker(lighthouse_pods, (create_refused or {}).get(LIGHTHOUSE, ""))
        if lh_blocker is not None:
            blockers[LIGHTHOUSE] = lh_blocker
    stuck = job_blocker(blockers)
    live = None  # groups the lighthouse hears from, once training has begun (before the first quorum: starting)
    if lighthouse is not None and lighthouse.quorum_id and not lighthouse.finished_groups:
        live = len(lighthouse.groups)
    lh_down = lighthouse_down(job, state, pods, create_refused)
    conditions = _conditions(spec, state, phases, running, previous, generation, now, stuck, live, lh_down)
    summary = next((c["type"] for c in reversed(conditions) if c["status"] == "True" and c["type"] != "Created"), None)
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "phase": summary or "Created",
        "conditions": conditions,
        "replicas": min(running, spec.replicas),
        "readyReplicas": running,
        "ready": f"{running}/{spec.total_groups}",
        "selector": f"{contract.LABEL_JOB}={job},{contract.LABEL_ROLE}={contract.ROLE_WORKER}",
        "replicaGroups": groups_out,
        "retiredGenerations": {str(k): v for k, v in state.retired_generations.items()},
        "lighthouse": {"generation": state.lighthouse_generation, "seen": state.lighthouse_seen},
        "totalRestarts": state.total_restarts,
        "restartsByReason": dict(state.restarts_by_reason),
        "startTime": format_time(state.start_time),
        "completionTime": format_time(state.completion_time),
        "completingSince": format_time(state.completing_since),
    }
    for key, value in (("goodput", goodput), ("history", history), ("integrity", integrity)):
        value = value if value is not None else (previous or {}).get(key)
        if value:
            status[key] = value
    if stuck is not None:
        status["reason"] = stuck.reason  # why it is stuck, in one word (a printer column of `kubectl get ftj`)
    restored = _restored(lighthouse, previous, now)
    if restored:
        status["restored"] = restored
    if lighthouse is not None and lighthouse.quorum_id is not None:
        seen = {"id": lighthouse.quorum_id, "size": lighthouse.quorum_size, "step": lighthouse.step}
        status["quorum"] = monotonic_quorum(seen, previous, step_from=restored.get("quorumId"))
    elif previous and previous.get("quorum"):
        status["quorum"] = previous["quorum"]  # keep the last known quorum (e.g. after the lighthouse stopped)
    return status


def _restored(lighthouse: LighthouseView | None, previous: dict[str, Any] | None, now: float) -> dict[str, Any]:
    """`.status.restored`: the lighthouse's newest restore below the committed step, kept once seen (a replacement
    lighthouse knows nothing of its predecessor's)."""
    before = dict((previous or {}).get("restored") or {})
    event = lighthouse.last_restore if lighthouse is not None else None
    if event is None or event.quorum_id <= int(before.get("quorumId") or 0):
        return before
    return {"quorumId": event.quorum_id, "fromStep": event.from_step, "toStep": event.to_step,
            "time": format_time(now)}  # fmt: skip


def status_events(before: dict[str, Any] | None, status: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Warning Events a status change calls for: newly stuck (a refused creation already got its own, with the API's
    words), newly paused below minReplicas."""
    out = []
    stuck = status.get("reason")
    if stuck and stuck != (before or {}).get("reason") and stuck != REASON_POD_CREATION_REFUSED:
        out.append(("Warning", stuck, next(c for c in status["conditions"] if c["type"] == "Degraded")["message"]))
    running = next(c for c in status["conditions"] if c["type"] == "Running")
    was = next((c for c in (before or {}).get("conditions", []) if c["type"] == "Running"), {})
    if running["reason"] == REASON_BELOW_MIN_REPLICAS and was.get("reason") != REASON_BELOW_MIN_REPLICAS:
        out.append(("Warning", REASON_BELOW_MIN_REPLICAS, running["message"]))
    restored = status.get("restored") or {}
    if restored and restored.get("quorumId") != ((before or {}).get("restored") or {}).get("quorumId"):
        out.append(("Warning", REASON_RESTORED, restored_message(restored)))
    return out


def restored_message(restored: dict[str, Any]) -> str:
    """What a restore means for the user: where training went on from, and how much work is trained again."""
    frm, to = int(restored["fromStep"]), int(restored["toStep"])
    where = f"from a checkpoint of step {to}" if to > 0 else "from step 0: no group brought back a checkpoint"
    return (f"every replica group holding committed step {frm} was lost; training resumed {where} "
            f"({frm - to} committed steps are trained again)")  # fmt: skip


def monotonic_quorum(seen: dict[str, Any], previous: dict[str, Any] | None, step_from: int | None = None
                     ) -> dict[str, Any]:  # fmt: skip
    """The quorum as reported: id and committed step never go below what status said before (a replacement
    lighthouse starts lower and catches up from the groups' own reports within seconds). The one exception is a
    restore (the whole job went on from an older checkpoint at quorum ``step_from``): from that quorum on, the step
    is the lighthouse's again, so that a later replacement lighthouse is not told to wait for a step nobody holds."""
    before = (previous or {}).get("quorum") or {}
    restoring = step_from is not None and isinstance(seen.get("id"), int) and seen["id"] >= step_from
    restoring = restoring and step_from != ((previous or {}).get("restored") or {}).get("quorumId")
    out = dict(seen)
    for key in ("id", "step"):
        if key == "step" and restoring:
            continue
        if isinstance(before.get(key), int) and (out.get(key) is None or before[key] > out[key]):
            out[key] = before[key]
    return out


def _conditions(
    spec: JobSpec,
    state: JobState,
    phases: dict[int, str],
    running: int,
    previous: dict[str, Any] | None,
    generation: int | None,
    now: float,
    stuck: Blocker | None = None,
    live: int | None = None,
    lighthouse_down: str | None = None,
) -> list[dict[str, Any]]:
    """`live`: the groups the lighthouse hears from (None before training began); `lighthouse_down`: why the
    lighthouse pod is not running (None while it runs)."""
    active = state.outcome is None and not state.suspended
    down = sorted(i for i, p in phases.items() if p != P.PHASE_RUNNING)
    recovering = sorted(i for i, g in state.groups.items() if g.failed_at is not None and active)
    if state.outcome is not None:  # finished: say so, not "not running" (nothing is meant to run any more)
        ended = f"JobEnded{state.outcome}"
        running_c = (False, ended, f"the job {state.outcome.lower()}: no replica group runs any more")
        degraded_c = (False, ended, f"the job {state.outcome.lower()}")
    elif state.suspended:
        running_c = (False, "JobSuspended", "spec.suspend is true: no replica group runs")
        degraded_c = (False, "JobSuspended", "spec.suspend is true")
    else:
        running_c = (
            running >= spec.min_replicas,
            "QuorumPossible" if running >= spec.min_replicas else "NotEnoughGroups",
            f"{running} of {spec.total_groups} replica groups running (minReplicas={spec.min_replicas})",
        )
        degraded_c = (
            running < spec.replicas,
            "GroupsDown" if running < spec.replicas else "AllGroupsUp",
            f"replica groups not running: {down}" if down else "every replica group is running",
        )
        if stuck is not None:  # the underlying reason, in the words of whoever refuses (scheduler, kubelet, API)
            degraded_c = (True, stuck.reason, stuck.message)
        if live is not None and live < spec.min_replicas:  # pods may run, but the groups are hung or cut off
            running_c = (
                False,
                REASON_BELOW_MIN_REPLICAS,
                f"training paused: the lighthouse hears from {live} replica groups, fewer than minReplicas="
                f"{spec.min_replicas}; no step commits until enough groups are back",
            )
        if lighthouse_down is not None:  # groups may run, but only the lighthouse forms a quorum
            running_c = (
                False,
                REASON_LIGHTHOUSE_NOT_RUNNING,
                f"no quorum is possible: {lighthouse_down}; {running} of {spec.total_groups} replica groups "
                f"running (minReplicas={spec.min_replicas})",
            )
        if not running_c[0] and not degraded_c[0]:  # paused while every pod runs: the job is degraded, say why
            degraded_c = (True, running_c[1], running_c[2])
    want: dict[str, tuple[bool, str, str]] = {
        "Created": (True, "ResourcesCreated", "the lighthouse, Services and worker pods were created"),
        "Running": running_c,
        "Degraded": degraded_c,
        "Recovering": _recovering(state, recovering),
        "Suspended": (
            state.suspended and state.outcome is None,
            "JobSuspended" if state.suspended else "JobNotSuspended",
            "spec.suspend is true" if state.suspended else "spec.suspend is false",
        ),
        "Succeeded": (
            state.outcome == OUTCOME_SUCCEEDED,
            state.outcome_reason if state.outcome == OUTCOME_SUCCEEDED else "NotFinished",
            state.outcome_message if state.outcome == OUTCOME_SUCCEEDED else "training has not finished",
        ),
        "Failed": (
            state.outcome == OUTCOME_FAILED,
            state.outcome_reason if state.outcome == OUTCOME_FAILED else "NotFailed",
            state.outcome_message if state.outcome == OUTCOME_FAILED else "the job has not failed",
        ),
    }
    old = {c.get("type"): c for c in (previous or {}).get("conditions") or []}
    out = []
    for ctype in CONDITION_TYPES:
        ok, reason, message = want[ctype]
        value = "True" if ok else "False"
        prior = old.get(ctype)
        changed = prior is None or prior.get("status") != value
        out.append(
            {
                "type": ctype,
                "status": value,
                "reason": reason,
                "message": message,
                "lastTransitionTime": format_time(now) if changed else prior.get("lastTransitionTime"),
                "observedGeneration": generation,
            }
        )
    return out


def _recovering(state: JobState, recovering: list[int]) -> tuple[bool, str, str]:
    """The Recovering condition: its reason is that of the newest failure being repaired (ExitCode, GradientGuard,
    ...; ReplacingGroups when a status from before this field left it unknown), its message says what was seen."""
    if not recovering:
        return False, "NoRecovery", "no replica group is being replaced"
    newest = state.groups[max(recovering, key=lambda i: state.groups[i].failed_at or 0.0)]
    message = f"replica groups being replaced: {recovering}"
    if newest.last_failure:
        message += f"; group {newest.index}: {newest.last_failure}"
    return True, newest.last_failure_reason or "ReplacingGroups", message
