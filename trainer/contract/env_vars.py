"""What every environment variable of the contract means, who sets it and what holds when it is unset.

The single source of the docs site's environment reference (docs/reference/env.md, generated from ``ENV_VARS``): each
entry names one ``ENV_*`` constant of ftjob.contract by its value, and ``undescribed()`` lists the constants that
have no entry yet (the docs build refuses to go on while it is not empty).
"""

from __future__ import annotations

from dataclasses import dataclass

from ftjob import contract

# Who sets a variable (EnvVar.set_by)
OPERATOR_WORKER = "operator, on every worker pod"
OPERATOR_LIGHTHOUSE = "operator, on the lighthouse pod"
OPERATOR_BOTH = "operator, on worker and lighthouse pods"
OPERATOR_RANKS = "operator, on worker pods of spec.ranksPerPod > 1"
LAUNCHER = "local launcher (ftjob-trainer launch)"
SUPERVISOR = "in-pod supervisor (ftjob-trainer supervise), per rank"
USER = "you (optional)"
TESTS = "tests only"


@dataclass(frozen=True)
class EnvVar:
    """One environment variable of the contract."""

    name: str  # the variable, e.g. FTJOB_TOKEN (an ENV_* constant's value)
    reader: str  # the side that reads it: "trainer", "lighthouse", "supervisor"
    meaning: str  # what it says, in one or two sentences of Markdown
    set_by: str  # who sets it (the constants above, or more words)
    default: str  # what holds when it is unset, in Markdown


ENV_VARS: tuple[EnvVar, ...] = (
    # --- worker pods: identity and the lighthouse -------------------------------------------------------------
    EnvVar(contract.ENV_JOB_NAME, "trainer", "The job's name (metadata.name).", OPERATOR_BOTH, "`local`"),
    EnvVar(contract.ENV_NAMESPACE, "trainer", "The job's namespace.", OPERATOR_BOTH, "`default`"),
    EnvVar(
        contract.ENV_LIGHTHOUSE_URL,
        "trainer",
        "Base URL of the job's lighthouse (`https://` when spec.tls is enabled).",
        OPERATOR_WORKER,
        f"`http://127.0.0.1:{contract.LIGHTHOUSE_PORT}`",
    ),
    EnvVar(
        contract.ENV_TOKEN,
        "trainer, lighthouse",
        "The job's worker bearer token: groups' quorum, heartbeat and watch calls; filled from the job's token Secret.",
        OPERATOR_BOTH,
        f"the file {contract.ENV_TOKEN_FILE} names",
    ),
    EnvVar(contract.ENV_TOKEN_FILE, "trainer, lighthouse", f"A file holding {contract.ENV_TOKEN}.", USER, "none"),
    EnvVar(
        contract.ENV_REPLICA_GROUP,
        "trainer",
        "This pod's replica group id (the group's index as a decimal string).",
        OPERATOR_WORKER,
        "`0`",
    ),
    EnvVar(
        contract.ENV_REPLICAS,
        "trainer, lighthouse",
        "Replica groups that contribute gradients (spec.replicas).",
        OPERATOR_BOTH,
        "`1` (trainer); the groups that join (lighthouse)",
    ),
    EnvVar(
        contract.ENV_MIN_REPLICAS,
        "trainer, lighthouse",
        "Live groups a quorum needs; below it no step commits (spec.minReplicas).",
        OPERATOR_BOTH,
        "`1`",
    ),
    EnvVar(
        contract.ENV_ADVERTISE_ADDR,
        "trainer",
        "The IP peers reach this pod on (status.podIP): recovery server and cross-group store.",
        OPERATOR_WORKER,
        "`127.0.0.1`",
    ),
    EnvVar(
        contract.ENV_GENERATION,
        "trainer",
        "This group's generation (the pod label ftjob.dev/generation): 0 for its first incarnation, one more per "
        "replacement.",
        OPERATOR_WORKER,
        "unknown (a process reports none)",
    ),
    # --- worker pods: timeouts, checkpoints, metrics ----------------------------------------------------------
    EnvVar(
        contract.ENV_CHECKPOINT_DIR,
        "trainer",
        "Where durable checkpoints for whole-job restarts go.",
        f"{USER}; {LAUNCHER}",
        "no durable checkpoints",
    ),
    EnvVar(
        contract.ENV_CHECKPOINT_EVERY,
        "trainer",
        f"A durable checkpoint every this many committed steps (needs {contract.ENV_CHECKPOINT_DIR}).",
        f"{USER}; {LAUNCHER}",
        "`0` (never)",
    ),
    EnvVar(
        contract.ENV_COLLECTIVE_TIMEOUT_S,
        "trainer",
        "Seconds one cross-group collective may take before the step is abandoned.",
        USER,
        "`5`",
    ),
    EnvVar(contract.ENV_QUORUM_TIMEOUT_S, "trainer", "Seconds one quorum request may wait.", USER, "`60`"),
    EnvVar(
        contract.ENV_LIGHTHOUSE_LOST_TIMEOUT_S,
        "trainer",
        "Seconds a group keeps its state and retries an unreachable lighthouse before giving up.",
        USER,
        "`600`",
    ),
    EnvVar(
        contract.ENV_METRICS_PORT,
        "trainer",
        "Port of the rank's Prometheus `/metrics` (ftjob.ft.rank_metrics); `0`: no server.",
        OPERATOR_WORKER + f" (`{contract.TRAINER_METRICS_PORT}`)",
        "no server",
    ),
    EnvVar(
        contract.ENV_METRICS_DISABLED,
        "trainer",
        "`1`: the trainer records no metrics at all (to measure what they cost).",
        USER,
        "metrics recorded",
    ),
    EnvVar(
        contract.ENV_GC_FREEZE,
        "trainer",
        "`0`: ftjob.ft leaves the garbage collector alone instead of freezing the objects alive at import "
        "(ftjob.ft.gc_freeze).",
        USER,
        "on",
    ),
    EnvVar(
        contract.ENV_RECOVERY_PORT,
        "trainer",
        "Port of the rank's recovery server, which a healing peer copies state from.",
        OPERATOR_WORKER + f" (`{contract.RECOVERY_PORT}`); {SUPERVISOR}",
        "an ephemeral port",
    ),
    EnvVar(
        contract.ENV_CROSS_GROUP_STORE_PORT,
        "trainer",
        "Port of the TCPStore a group's rank hosts for the cross-group process group.",
        OPERATOR_WORKER + f" (`{contract.CROSS_GROUP_STORE_PORT}`); {SUPERVISOR}",
        "an ephemeral port",
    ),
    # --- the local launcher -----------------------------------------------------------------------------------
    EnvVar(
        contract.ENV_RUN_DIR,
        "trainer",
        "Where each group's rank 0 appends its run records (ftjob.ft.records) for the launcher's report.",
        LAUNCHER,
        "no run records",
    ),
    EnvVar(
        contract.ENV_MIN_STEP_SECONDS,
        "trainer",
        "Pads every step to at least this many seconds: stands in for a bigger model.",
        LAUNCHER,
        "`0`",
    ),
    # --- integrity ----------------------------------------------------------------------------------------------
    EnvVar(
        contract.ENV_GUARD,
        "trainer",
        "`0`: no gradient guard before commits (spec.integrity.gradientGuard.enabled).",
        OPERATOR_WORKER,
        "on",
    ),
    EnvVar(
        contract.ENV_GUARD_NORM_RATIO,
        "trainer",
        "A group's gradient norm above this many times the other contributors' median is refused "
        "(spec.integrity.gradientGuard.normRatio).",
        OPERATOR_WORKER,
        "`100`",
    ),
    EnvVar(
        contract.ENV_GUARD_SKETCH,
        "trainer",
        "`1`: the guard also judges norms every group can check against the sum (random-projection sketches).",
        USER,
        "off",
    ),
    EnvVar(
        contract.ENV_DIGEST_EVERY,
        "trainer",
        "Every this many committed steps each group reports a digest of its state; `0`: never "
        "(spec.integrity.digestEverySteps).",
        OPERATOR_WORKER,
        "`100`",
    ),
    EnvVar(
        contract.ENV_FAULT_INJECTION,
        "trainer",
        "Injects a gradient fault, e.g. `group=1,kind=nan|scale|bitflip|lie|misreport,step=20[,count=3]` "
        "(ftjob.ft.integrity.fault_injection).",
        TESTS,
        "no fault",
    ),
    # --- TLS ----------------------------------------------------------------------------------------------------
    EnvVar(
        contract.ENV_TLS_CA_FILE,
        "trainer, lighthouse",
        "The job's CA certificate (PEM); when set, every lighthouse and recovery connection is TLS, verified "
        "against it.",
        OPERATOR_BOTH,
        "plain HTTP",
    ),
    EnvVar(
        contract.ENV_TLS_CERT_FILE,
        "trainer, lighthouse",
        "This process's certificate chain (PEM), for the servers it runs.",
        OPERATOR_BOTH,
        "plain HTTP",
    ),
    EnvVar(
        contract.ENV_TLS_KEY_FILE, "trainer, lighthouse", "The certificate's private key (PEM).", OPERATOR_BOTH, "none"
    ),
    # --- several ranks per pod ------------------------------------------------------------------------------------
    EnvVar(
        contract.ENV_RANKS_PER_POD,
        "supervisor",
        "Rank processes the in-pod supervisor starts (spec.ranksPerPod).",
        OPERATOR_RANKS,
        "`1`",
    ),
    EnvVar(
        contract.ENV_POD_RANK,
        "supervisor",
        f"This pod's index in its group; a rank's `RANK` is `POD_RANK x {contract.ENV_RANKS_PER_POD} + LOCAL_RANK`.",
        OPERATOR_WORKER,
        "`0`",
    ),
    # --- torch.distributed's own names ------------------------------------------------------------------------
    EnvVar(
        contract.ENV_RANK,
        "trainer",
        "The rank inside its replica group (torch.distributed).",
        f"{OPERATOR_WORKER} (one rank per pod); {SUPERVISOR}; {LAUNCHER}",
        "`0`",
    ),
    EnvVar(
        contract.ENV_WORLD_SIZE,
        "trainer, supervisor",
        "Ranks in one replica group: podsPerReplica x ranksPerPod (torch.distributed).",
        f"{OPERATOR_WORKER}; {SUPERVISOR}; {LAUNCHER}",
        "`1`",
    ),
    EnvVar(
        contract.ENV_LOCAL_RANK,
        "trainer",
        "The rank's index inside its pod: the GPU it drives.",
        f"{OPERATOR_WORKER}; {SUPERVISOR}; {LAUNCHER}",
        "`0`",
    ),
    EnvVar(contract.ENV_LOCAL_WORLD_SIZE, "trainer", "Ranks in this pod.", f"{OPERATOR_RANKS}; {SUPERVISOR}", "`1`"),
    EnvVar(
        contract.ENV_MASTER_ADDR,
        "trainer",
        "Where the group's rank 0 hosts the in-group rendezvous (torch.distributed).",
        f"{OPERATOR_WORKER}; {LAUNCHER}",
        "`127.0.0.1`",
    ),
    EnvVar(
        contract.ENV_MASTER_PORT,
        "trainer",
        "Port of the in-group rendezvous (torch.distributed).",
        OPERATOR_WORKER + f" (`{contract.GROUP_MASTER_PORT}`); {LAUNCHER}",
        f"`{contract.GROUP_MASTER_PORT}`",
    ),
    # --- the lighthouse (each has a flag of `ftjob-trainer lighthouse` that overrides it) ----------------------
    EnvVar(
        contract.ENV_LIGHTHOUSE_BIND,
        "lighthouse",
        "`HOST:PORT` the lighthouse listens on (port 0 picks a free one).",
        f"{OPERATOR_LIGHTHOUSE}; {LAUNCHER}",
        f"`0.0.0.0:{contract.LIGHTHOUSE_PORT}`",
    ),
    EnvVar(
        contract.ENV_JOIN_TIMEOUT_S,
        "lighthouse",
        "Seconds a quorum waits for a group the operator announced as starting (spec.lighthouse.joinTimeoutSeconds).",
        OPERATOR_LIGHTHOUSE,
        "`1`",
    ),
    EnvVar(
        contract.ENV_HEARTBEAT_TIMEOUT_S,
        "lighthouse",
        "Seconds without a heartbeat before a group is dropped from the quorum "
        "(spec.lighthouse.heartbeatTimeoutSeconds).",
        OPERATOR_LIGHTHOUSE,
        "`5`",
    ),
    EnvVar(
        contract.ENV_GROUPS,
        "lighthouse",
        "Group ids are `0..N-1` (replicas + spares); the lighthouse refuses any other.",
        OPERATOR_LIGHTHOUSE,
        "any id",
    ),
    EnvVar(
        contract.ENV_LIGHTHOUSE_STATE_FILE,
        "lighthouse",
        "A file that keeps the quorum id and the committed step across lighthouse restarts.",
        USER,
        "not persisted",
    ),
    EnvVar(
        contract.ENV_RESTORE_QUORUM_ID,
        "lighthouse",
        "A replacement lighthouse issues quorum ids above this one (the last the operator saw).",
        OPERATOR_LIGHTHOUSE,
        "`0`",
    ),
    EnvVar(
        contract.ENV_RESTORE_STEP,
        "lighthouse",
        f"For {contract.ENV_RESTORE_WINDOW_S} no quorum starts below this committed step: a surviving group holding "
        "it is waited for.",
        OPERATOR_LIGHTHOUSE,
        "`0`",
    ),
    EnvVar(
        contract.ENV_RESTORE_WINDOW_S,
        "lighthouse",
        f"How long a replacement lighthouse holds to {contract.ENV_RESTORE_STEP}.",
        OPERATOR_LIGHTHOUSE,
        "`120`",
    ),
    EnvVar(
        contract.ENV_GROUP_GENERATIONS,
        "lighthouse",
        "`0:1,1:2`: each group's oldest running generation; a process of an older generation is refused at once.",
        OPERATOR_LIGHTHOUSE,
        "none refused",
    ),
    EnvVar(
        contract.ENV_GUARD_MAX_OFFENCES,
        "lighthouse",
        f"A group the gradient guard refused this often within {contract.ENV_GUARD_WINDOW_S} is evicted "
        "(spec.integrity.gradientGuard.maxOffences).",
        OPERATOR_LIGHTHOUSE,
        "`3`",
    ),
    EnvVar(
        contract.ENV_GUARD_WINDOW_S,
        "lighthouse",
        "The window, in seconds, of the guard's offence count (spec.integrity.gradientGuard.windowSeconds).",
        OPERATOR_LIGHTHOUSE,
        "`600`",
    ),
    EnvVar(
        contract.ENV_STALL_FACTOR,
        "lighthouse",
        "A member whose progress has not moved for max(floor, factor x the median step time) while the others wait "
        "in the step's collective is evicted as stalled; `0` turns the rule off (spec.lighthouse.stallFactor).",
        OPERATOR_LIGHTHOUSE,
        "`3`",
    ),
    EnvVar(
        contract.ENV_STALL_FLOOR_S,
        "lighthouse",
        "The stall rule never evicts sooner than this many seconds (spec.lighthouse.stallFloorSeconds).",
        OPERATOR_LIGHTHOUSE,
        "`1`",
    ),
    EnvVar(
        contract.ENV_AUDIT_FILE,
        "lighthouse",
        "The audit trail's JSON lines also go to this file (they always go to stderr).",
        USER,
        "stderr only",
    ),
    EnvVar(
        contract.ENV_OPERATOR_TOKEN,
        "lighthouse",
        "The operator's bearer token, the only one the membership API accepts; never in a worker pod.",
        f"{OPERATOR_LIGHTHOUSE}; {LAUNCHER}",
        f"the file {contract.ENV_OPERATOR_TOKEN_FILE} names",
    ),
    EnvVar(
        contract.ENV_OPERATOR_TOKEN_FILE,
        "lighthouse",
        f"A file holding {contract.ENV_OPERATOR_TOKEN}.",
        USER,
        "none",
    ),
)


def contract_env_names() -> dict[str, str]:
    """Every ``ENV_*`` constant of ftjob.contract: constant name -> variable name."""
    return {name: value for name, value in vars(contract).items() if name.startswith("ENV_") and isinstance(value, str)}


def undescribed() -> list[str]:
    """The contract's variables with no entry in ENV_VARS, and entries naming no variable of the contract."""
    described = [v.name for v in ENV_VARS]
    known = set(contract_env_names().values())
    missing = sorted(known - set(described))
    unknown = sorted(set(described) - known)
    repeated = sorted({n for n in described if described.count(n) > 1})
    return [*missing, *(f"{n} (not in ftjob.contract)" for n in unknown), *(f"{n} (twice)" for n in repeated)]
