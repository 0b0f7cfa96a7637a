"""The operator <-> trainer contract, defined once: labels, env vars, ports, paths, and the typed wire messages.

The operator (ftjob.operator) imports this package to build pods and to call the lighthouse; the trainer side
(ftjob.ft, ftjob.lighthouse, ftjob.launch) imports it to read its configuration and to serve or call the lighthouse.
It never imports torch: the operator's image has none.

  this module          names: Kubernetes identity and labels, ports, env vars, HTTP paths, the token
  lighthouse_api       every request and answer of the lighthouse's HTTP/WebSocket API (pydantic models)
  recovery_api         the manifest a healing rank reads from a peer's recovery server

Lighthouse paths (every one except /healthz needs ``Authorization: Bearer <token>``; bodies in lighthouse_api):
  POST /v1/quorum, /v1/heartbeat, /v1/membership/{evict,starting,desired,handover}; GET /v1/status,
  /v1/watch (WebSocket), /metrics (Prometheus text), /healthz ("ok").
Two tokens, two roles (ftjob.lighthouse.api.auth): the job's worker token (FTJOB_TOKEN, in every worker pod) for the
groups' calls (quorum, heartbeat, watch), the operator's token (FTJOB_OPERATOR_TOKEN, in the lighthouse pod only) for
the membership API; either reads /v1/status and /metrics. The other role's token is refused with 403.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

# --- Kubernetes resource identity -------------------------------------------------------------------------------
API_GROUP = "ftjob.dev"
API_VERSION = "v1alpha1"
KIND = "FaultTolerantTrainingJob"
PLURAL = "faulttoleranttrainingjobs"

LABEL_JOB = "ftjob.dev/job"  # the job's name, on every object the operator makes for it
LABEL_ROLE = "ftjob.dev/role"  # ROLE_LIGHTHOUSE or ROLE_WORKER
LABEL_GROUP = "ftjob.dev/replica-group"  # "0", "1", ... (the group's index)
LABEL_RANK = "ftjob.dev/rank"  # the pod's index inside its group, "0".."podsPerReplica-1" (FTJOB_POD_RANK)
LABEL_GENERATION = "ftjob.dev/generation"  # how many times this group has been (re)created, "0", "1", ...
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "ftjob-operator"
ROLE_LIGHTHOUSE = "lighthouse"
ROLE_WORKER = "worker"
# The readiness gate of every worker pod: the operator sets this pod condition True while the lighthouse lists the
# pod's generation of its group as a member of the current quorum, so "Ready" means "holds the job's state and
# trains", which the job's PodDisruptionBudget counts (a drain never evicts below it).
CONDITION_IN_QUORUM = "ftjob.dev/in-quorum"
# A worker's exit status after SIGTERM (a pod deleted or evicted): it left the job at a step boundary. 128 + SIGTERM,
# as a death by the signal reads, and never 0: the operator takes a group whose pods all exit 0 as finished training.
EXIT_TERMINATED = 143

# --- Ports ------------------------------------------------------------------------------------------------------
LIGHTHOUSE_PORT = 29510  # lighthouse HTTP API
GROUP_MASTER_PORT = 29500  # torch.distributed rendezvous inside one group (MASTER_PORT)
RECOVERY_PORT = 29520  # per-rank state server a healing peer copies from
CROSS_GROUP_STORE_PORT = 29530  # TCPStore hosted by a group's rank for the cross-group process group
TRAINER_METRICS_PORT = (
    29540  # every worker rank's Prometheus /metrics (ftjob.ft.rank_metrics; container port "metrics")
)
# A pod running several ranks (spec.ranksPerPod) gives local rank k the per-rank ports base + k * RANK_PORT_STRIDE
# (rank_port): the three bases stay apart, and every port of the largest pod stays below Linux's ephemeral range.
RANK_PORT_STRIDE = 100
MAX_RANKS_PER_POD = 16


def rank_port(base: int, local_rank: int) -> int:
    """The port of local rank ``local_rank`` for a per-rank server whose pod-level port is ``base`` (0 stays 0: an
    ephemeral port)."""
    if not 0 <= local_rank < MAX_RANKS_PER_POD:
        raise ValueError(f"local rank must be in 0..{MAX_RANKS_PER_POD - 1}, got {local_rank}")
    return base + RANK_PORT_STRIDE * local_rank if base else 0


# --- Env vars the operator sets on worker pods and the trainer reads -------------------------------------------
ENV_JOB_NAME = "FTJOB_JOB_NAME"
ENV_NAMESPACE = "FTJOB_NAMESPACE"
ENV_LIGHTHOUSE_URL = "FTJOB_LIGHTHOUSE_URL"  # http://host:port of the lighthouse
ENV_TOKEN = "FTJOB_TOKEN"  # bearer token (the operator fills it from the job's Secret)
ENV_TOKEN_FILE = "FTJOB_TOKEN_FILE"  # alternative: a file holding the token
ENV_REPLICA_GROUP = "FTJOB_REPLICA_GROUP"  # this pod's group id (the index as a string)
ENV_REPLICAS = "FTJOB_REPLICAS"  # desired contributing groups
ENV_MIN_REPLICAS = "FTJOB_MIN_REPLICAS"  # below this nothing commits
ENV_ADVERTISE_ADDR = "FTJOB_ADVERTISE_ADDR"  # the IP peers use to reach this pod (status.podIP)
ENV_CHECKPOINT_DIR = "FTJOB_CHECKPOINT_DIR"  # durable checkpoints for whole-job restarts (optional)
ENV_COLLECTIVE_TIMEOUT_S = "FTJOB_COLLECTIVE_TIMEOUT_S"  # bound on one cross-group collective
ENV_QUORUM_TIMEOUT_S = "FTJOB_QUORUM_TIMEOUT_S"  # bound on one quorum request
ENV_LIGHTHOUSE_LOST_TIMEOUT_S = "FTJOB_LIGHTHOUSE_LOST_TIMEOUT_S"  # how long to keep retrying an unreachable lighthouse
ENV_CHECKPOINT_EVERY = "FTJOB_CHECKPOINT_EVERY"  # durable checkpoint every N committed steps (ftjob.ft; 0: never)
ENV_METRICS_PORT = "FTJOB_METRICS_PORT"  # trainer /metrics port (pods: TRAINER_METRICS_PORT; unset or 0: none)
ENV_METRICS_DISABLED = "FTJOB_METRICS_DISABLED"  # "1": the trainer records no metrics (to measure their cost)
ENV_GC_FREEZE = "FTJOB_GC_FREEZE"  # "0": ftjob.ft leaves the garbage collector alone (ftjob.ft.gc_freeze; default on)
# Set by the local launcher (ftjob-trainer launch) only
ENV_RUN_DIR = "FTJOB_RUN_DIR"  # where each group's rank 0 appends its run records (ftjob.ft.records)
ENV_RECOVERY_PORT = "FTJOB_RECOVERY_PORT"  # the recovery server's port (pods: RECOVERY_PORT; unset: ephemeral)
ENV_CROSS_GROUP_STORE_PORT = "FTJOB_STORE_PORT"  # the cross-group TCPStore's port (pods: CROSS_GROUP_STORE_PORT)
ENV_MIN_STEP_SECONDS = "FTJOB_MIN_STEP_SECONDS"  # pad every step to this long: stands in for a bigger model
# Integrity (ftjob.ft.integrity.guard, ftjob.ft.divergence; spec.integrity in the CRD)
ENV_GUARD = "FTJOB_GRADIENT_GUARD"  # "0": no gradient guard (default on)
ENV_GUARD_NORM_RATIO = "FTJOB_GUARD_NORM_RATIO"  # a group's grad norm above ratio x the others' median is refused
# "1": the guard judges norms every group can check against the sum (random-projection sketches; default off)
ENV_GUARD_SKETCH = "FTJOB_GUARD_SKETCH"
ENV_DIGEST_EVERY = "FTJOB_DIGEST_EVERY"  # report a state digest every N committed steps (0: never)
ENV_GENERATION = "FTJOB_GENERATION"  # this group's generation (the pod label): 0 for the first incarnation
# tests only: "group=1,kind=nan|scale|bitflip|lie|misreport,step=20[,count=3]" (ftjob.ft.integrity.fault_injection)
ENV_FAULT_INJECTION = "FTJOB_FAULT_INJECTION"
# TLS (ftjob.contract.tls): with a CA file set, every lighthouse / recovery connection is TLS, verified against it
ENV_TLS_CA_FILE = "FTJOB_TLS_CA_FILE"  # the job's CA certificate (PEM): clients verify servers with it
ENV_TLS_CERT_FILE = "FTJOB_TLS_CERT_FILE"  # this process's certificate chain (PEM), for the servers it runs
ENV_TLS_KEY_FILE = "FTJOB_TLS_KEY_FILE"  # its private key (PEM)
# Several ranks per pod (spec.ranksPerPod): the operator sets these on the pod, and the in-pod supervisor
# (`ftjob-trainer supervise`) starts that many rank processes with torch's names below set per rank.
ENV_RANKS_PER_POD = "FTJOB_RANKS_PER_POD"  # rank processes in this pod (default 1)
ENV_POD_RANK = "FTJOB_POD_RANK"  # this pod's index in its group; a rank's RANK = POD_RANK * RANKS_PER_POD + LOCAL_RANK
# torch.distributed's own names, for the ranks inside one group (WORLD_SIZE = podsPerReplica * ranksPerPod)
ENV_RANK = "RANK"
ENV_WORLD_SIZE = "WORLD_SIZE"
ENV_LOCAL_RANK = "LOCAL_RANK"
ENV_LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
ENV_MASTER_ADDR = "MASTER_ADDR"
ENV_MASTER_PORT = "MASTER_PORT"

# --- Env vars the lighthouse reads (flags override) -------------------------------------------------------------
ENV_LIGHTHOUSE_BIND = "FTJOB_LIGHTHOUSE_BIND"  # host:port to listen on
ENV_JOIN_TIMEOUT_S = "FTJOB_JOIN_TIMEOUT_S"
ENV_HEARTBEAT_TIMEOUT_S = "FTJOB_HEARTBEAT_TIMEOUT_S"
ENV_GROUPS = "FTJOB_GROUPS"  # group ids are 0..N-1 (replicas + spares); the lighthouse refuses any other
ENV_LIGHTHOUSE_STATE_FILE = "FTJOB_LIGHTHOUSE_STATE_FILE"  # optional: persisted quorum id and committed step
# A replacement lighthouse pod starts from what the operator last saw: quorum ids go on above it, and for
# FTJOB_RESTORE_WINDOW_S no quorum starts below the committed step (a surviving group holding it is waited for).
ENV_RESTORE_QUORUM_ID = "FTJOB_RESTORE_QUORUM_ID"
ENV_RESTORE_STEP = "FTJOB_RESTORE_STEP"
ENV_RESTORE_WINDOW_S = "FTJOB_RESTORE_WINDOW_S"
# "0:1,1:2": each group's oldest running generation (DesiredRequest.generations), known before the operator can call
# a replacement lighthouse: a process of a replaced generation that outlived its pod's deletion is refused at once
ENV_GROUP_GENERATIONS = "FTJOB_GROUP_GENERATIONS"
ENV_GUARD_MAX_OFFENCES = "FTJOB_GUARD_MAX_OFFENCES"  # a group refused by the guard this often ...
ENV_GUARD_WINDOW_S = "FTJOB_GUARD_WINDOW_S"  # ... within this many seconds is evicted (its node then avoided)
# Progress-based stall detection (lighthouse side): a member whose progress has not moved for
# max(FLOOR, FACTOR x the median step time) while every other member of the quorum waits in the step's collective
# is evicted as "stalled" (well before the heartbeat timeout). FACTOR 0 turns the rule off.
ENV_STALL_FACTOR = "FTJOB_STALL_FACTOR"
ENV_STALL_FLOOR_S = "FTJOB_STALL_FLOOR_S"
ENV_AUDIT_FILE = "FTJOB_AUDIT_FILE"  # optional: the audit trail's JSON lines also go to this file (always to stderr)
# The operator's own bearer token (its Secret <job>-ftjob-operator-token, never mounted in a worker pod): the only one
# the membership API accepts, so code running in a worker pod cannot change the job's membership
# (ftjob.lighthouse.api.auth)
ENV_OPERATOR_TOKEN = "FTJOB_OPERATOR_TOKEN"
ENV_OPERATOR_TOKEN_FILE = "FTJOB_OPERATOR_TOKEN_FILE"  # alternative: a file holding it

# --- Lighthouse API paths ---------------------------------------------------------------------------------------
PATH_QUORUM = "/v1/quorum"
PATH_HEARTBEAT = "/v1/heartbeat"
PATH_EVICT = "/v1/membership/evict"
PATH_STARTING = "/v1/membership/starting"
PATH_DESIRED = "/v1/membership/desired"
PATH_HANDOVER = "/v1/membership/handover"  # make-before-break: the groups' next incarnation takes over, no abort
PATH_STATUS = "/v1/status"
PATH_METRICS = "/metrics"
PATH_HEALTH = "/healthz"
PATH_WATCH = "/v1/watch"  # WebSocket: heartbeats up, abort signals down; closing it drops the group
# Per-rank recovery server (ftjob.ft.recovery.transport): a healing rank i copies model/optimizer state from rank i of a
# peer
PATH_RECOVERY = "/v1/recovery"  # GET {PATH_RECOVERY}/{step}/manifest (JSON), {PATH_RECOVERY}/{step}/chunk/{i} (bytes)

# Secret key holding a token, in the job's worker token Secret and in its operator token Secret alike
TOKEN_SECRET_KEY = "token"


def read_token(environ: os._Environ[str] | dict[str, str] | None = None) -> str:
    """The job's bearer token from FTJOB_TOKEN or the file FTJOB_TOKEN_FILE names; '' when neither is set."""
    return _token_from(ENV_TOKEN, ENV_TOKEN_FILE, environ)


def read_operator_token(environ: os._Environ[str] | dict[str, str] | None = None) -> str:
    """The operator's bearer token from FTJOB_OPERATOR_TOKEN or the file FTJOB_OPERATOR_TOKEN_FILE names; ''."""
    return _token_from(ENV_OPERATOR_TOKEN, ENV_OPERATOR_TOKEN_FILE, environ)


def read_generation(environ: Mapping[str, str] | None = None) -> int | None:
    """This process's group generation (FTJOB_GENERATION), None when unset; ValueError for anything but an integer
    >= 0 (a typo must not hide which generation a process is)."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_GENERATION, "").strip()
    if not raw:
        return None
    if not (raw.isascii() and raw.isdigit()):
        raise ValueError(f"env {ENV_GENERATION}={raw!r}: expected an integer >= 0")
    return int(raw)


def format_generations(generations: Mapping[int, int]) -> str:
    """FTJOB_GROUP_GENERATIONS' value: "0:1,1:2" (group:generation, by group)."""
    return ",".join(f"{g}:{gen}" for g, gen in sorted(generations.items()))


def parse_generations(text: str) -> dict[str, int]:
    """FTJOB_GROUP_GENERATIONS' value as group id -> generation; ValueError naming what does not fit."""
    out: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        group, sep, gen = item.partition(":")
        group, gen = group.strip(), gen.strip()
        if not sep or not all(x.isascii() and x.isdigit() for x in (group, gen)):
            raise ValueError(f"{item!r} is not GROUP:GENERATION (e.g. 0:1,1:2)")
        out[str(int(group))] = int(gen)
    return out


def _token_from(name: str, file_name: str, environ: os._Environ[str] | dict[str, str] | None) -> str:
    env = os.environ if environ is None else environ
    if env.get(name):
        return env[name].strip()
    path = env.get(file_name)
    if path:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    return ""


def switched_off(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the on-by-default switch ``name`` (FTJOB_GRADIENT_GUARD, FTJOB_GC_FREEZE) is set to 0/false/off/no."""
    env = os.environ if environ is None else environ
    return env.get(name, "").strip().lower() in ("0", "false", "off", "no")


@dataclass(frozen=True)
class WorkerEnv:
    """What a worker pod learns from its environment (see the ENV_* names above)."""

    job_name: str
    namespace: str
    lighthouse_url: str
    token: str
    replica_group: str
    replicas: int
    min_replicas: int
    advertise_addr: str
    rank: int
    world_size: int
    master_addr: str
    master_port: int
    recovery_port: int = 0  # 0: ephemeral (several groups on one host, as the local launcher runs them)
    store_port: int = 0
    metrics_port: int = 0  # 0: no metrics server

    @classmethod
    def from_environ(cls, environ: dict[str, str] | None = None) -> WorkerEnv:
        env = dict(os.environ if environ is None else environ)
        return cls(
            job_name=env.get(ENV_JOB_NAME, "local"),
            namespace=env.get(ENV_NAMESPACE, "default"),
            lighthouse_url=env.get(ENV_LIGHTHOUSE_URL, f"http://127.0.0.1:{LIGHTHOUSE_PORT}"),
            token=read_token(env),
            replica_group=env.get(ENV_REPLICA_GROUP, "0"),
            replicas=int(env.get(ENV_REPLICAS, "1")),
            min_replicas=int(env.get(ENV_MIN_REPLICAS, "1")),
            advertise_addr=env.get(ENV_ADVERTISE_ADDR, "127.0.0.1"),
            rank=int(env.get(ENV_RANK, "0")),
            world_size=int(env.get(ENV_WORLD_SIZE, "1")),
            master_addr=env.get(ENV_MASTER_ADDR, "127.0.0.1"),
            master_port=int(env.get(ENV_MASTER_PORT, str(GROUP_MASTER_PORT))),
            recovery_port=int(env.get(ENV_RECOVERY_PORT) or 0),
            store_port=int(env.get(ENV_CROSS_GROUP_STORE_PORT) or 0),
            metrics_port=int(env.get(ENV_METRICS_PORT) or 0),
        )
