"""Deterministic names of everything the operator creates for a job: the same inputs always give the same name,
so create-if-absent is idempotent and a restarted operator can never make a duplicate."""

from __future__ import annotations


def pod_name(job: str, group: int, generation: int, rank: int) -> str:
    """Worker pod: unique per (group, generation, rank); also its hostname under the group's Service."""
    return f"{job}-g{group}-{generation}-r{rank}"


def group_service(job: str, group: int) -> str:
    """Headless Service giving a group's pods DNS names for their in-group rendezvous (the pods' subdomain)."""
    return f"{job}-g{group}"


def disruption_budget(job: str) -> str:
    """The PodDisruptionBudget over the job's worker pods: a drain evicts none that holds the job's state."""
    return f"{job}-workers"


def lighthouse_pod(job: str, generation: int) -> str:
    return f"{job}-lighthouse-{generation}"


def lighthouse_service(job: str) -> str:
    return f"{job}-lighthouse"


def token_secret(job: str) -> str:
    """The job's worker token: mounted in every pod of the job, it authorises the replica groups' lighthouse calls."""
    return f"{job}-ftjob-token"


def operator_token_secret(job: str) -> str:
    """The operator's own token for the job's lighthouse (its membership API): mounted in the lighthouse pod only."""
    return f"{job}-ftjob-operator-token"


def tls_secret(job: str) -> str:
    """The job's CA and its lighthouse and worker certificates (ftjob.contract.pki)."""
    return f"{job}-tls"


def cluster_dns(name: str, namespace: str) -> str:
    return f"{name}.{namespace}.svc.cluster.local"


def lighthouse_dns_names(job: str, namespace: str) -> list[str]:
    """The names the lighthouse's certificate carries: its Service's, fully qualified first (the trainers' URL and
    the name the operator checks when it calls the lighthouse by pod IP)."""
    service = lighthouse_service(job)
    return [cluster_dns(service, namespace), f"{service}.{namespace}.svc", f"{service}.{namespace}", service]
