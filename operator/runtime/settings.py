"""The operator's command-line settings."""

from __future__ import annotations

import argparse
import os
import socket
import uuid
from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    """The operator's command-line settings, validated."""

    namespaces: tuple[str, ...]
    all_namespaces: bool
    metrics_port: int
    health_port: int
    leader_election: bool
    lease_name: str
    lease_namespace: str
    lease_duration_s: float
    identity: str
    kubeconfig: str | None
    verbose: bool
    cordon_after_failures: int | None = None
    cordon_window_s: float = 3600.0


def parser() -> argparse.ArgumentParser:
    """The ``ftjob-operator`` argument parser."""
    p = argparse.ArgumentParser(
        prog="ftjob-operator",
        description="Runs FaultTolerantTrainingJobs: a lighthouse and replica groups of pods per job, replacing "
        "a failed group while the others keep training.",
    )
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[], help="watch this namespace (repeatable)")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace (the default)")
    p.add_argument("--metrics-port", type=int, default=8080, help="Prometheus /metrics port (0: off)")
    p.add_argument("--health-port", type=int, default=8081, help="/healthz port (0: off)")
    p.add_argument("--leader-election", action=argparse.BooleanOptionalAction, default=True,
                   help="hold a coordination.k8s.io Lease so only one replica acts (default: on)")  # fmt: skip
    p.add_argument("--lease-name", default="ftjob-operator", help="name of the leader Lease")
    p.add_argument("--lease-namespace", default=None,
                   help="namespace of the leader Lease (default: $POD_NAMESPACE, else the first --namespace, "
                   "else 'default')")  # fmt: skip
    p.add_argument("--lease-duration", type=float, default=15.0,
                   help="seconds a leader may go without renewing before a standby takes over")  # fmt: skip
    p.add_argument("--identity", default=None, help="this replica's name in the Lease (default: host-pid-random)")
    p.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: in-cluster, else $KUBECONFIG)")
    p.add_argument("--verbose", "-v", action="store_true", help="debug logging")
    p.add_argument("--cordon-after-failures", type=int, default=None, metavar="K",
                   help="cordon a node after K replica-group failures on it within --cordon-window, across jobs, "
                   "with an Event on the node (default: never; needs RBAC to patch nodes)")  # fmt: skip
    p.add_argument("--cordon-window", type=float, default=3600.0, metavar="SECONDS",
                   help="the window of --cordon-after-failures")  # fmt: skip
    return p


def parse(argv: list[str] | None = None) -> Settings:
    """The settings from ``argv`` (the process's arguments when None); exits with a usage error for invalid ones."""
    p = parser()
    args = p.parse_args(argv)
    if args.lease_duration < 2:
        p.error("--lease-duration must be at least 2 seconds (renewals happen every duration/5)")
    for port, flag in ((args.metrics_port, "--metrics-port"), (args.health_port, "--health-port")):
        if not 0 <= port <= 65535:
            p.error(f"{flag} must be between 0 and 65535, got {port}")
    if args.cordon_after_failures is not None and args.cordon_after_failures < 1:
        p.error(f"--cordon-after-failures must be >= 1, got {args.cordon_after_failures}")
    if args.cordon_window <= 0:
        p.error(f"--cordon-window must be > 0, got {args.cordon_window}")
    lease_ns = args.lease_namespace or os.environ.get("POD_NAMESPACE") or (args.namespace or ["default"])[0]
    identity = args.identity or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    return Settings(
        namespaces=tuple(args.namespace),
        all_namespaces=args.all_namespaces or not args.namespace,
        metrics_port=args.metrics_port,
        health_port=args.health_port,
        leader_election=args.leader_election,
        lease_name=args.lease_name,
        lease_namespace=lease_ns,
        lease_duration_s=args.lease_duration,
        identity=identity,
        kubeconfig=args.kubeconfig,
        verbose=args.verbose,
        cordon_after_failures=args.cordon_after_failures,
        cordon_window_s=args.cordon_window,
    )
