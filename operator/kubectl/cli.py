"""`kubectl-ftjob` (so `kubectl ftjob ...` works once it is on PATH): status, timeline and events of one job.

    kubectl ftjob status JOB [-n NS]              groups, quorum, step, goodput, last failures: one screen
    kubectl ftjob timeline JOB -o timeline.png    committed step per group over time, failures/recoveries marked
    kubectl ftjob events JOB [--failures]         the job's Events, oldest first

--kubeconfig, --context and -n/--namespace work as with kubectl (before or after the subcommand); the namespace
defaults to the kubeconfig context's, else "default".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ftjob import contract
from ftjob.operator.kubectl import events as ev
from ftjob.operator.kubectl import status_view

SA_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


class PluginError(Exception):
    """A one-line error for the user; the plugin exits 1 with it."""


def _common(p: argparse.ArgumentParser, suppress: bool) -> None:
    d: dict[str, Any] = {"default": argparse.SUPPRESS} if suppress else {"default": None}
    p.add_argument("-n", "--namespace", help="the job's namespace (default: the kubeconfig context's)", **d)
    p.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG or ~/.kube/config)", **d)
    p.add_argument("--context", help="kubeconfig context (default: the current one)", **d)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr", **d)


def parser() -> argparse.ArgumentParser:
    """The ``kubectl ftjob`` argument parser."""
    p = argparse.ArgumentParser(
        prog="kubectl ftjob",
        description="Look at a FaultTolerantTrainingJob: status, timeline, events.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n\n", 1)[1],
    )
    _common(p, suppress=False)
    sub = p.add_subparsers(dest="command", required=True, metavar="{status,timeline,events}")
    s = sub.add_parser("status", help="groups, quorum, step, goodput and the last failures in one screen")
    s.add_argument("job")
    s.add_argument("-o", "--output", choices=("text", "json"), default="text", help="json: the raw job object")
    t = sub.add_parser("timeline", help="PNG: committed step per group over time, failures and recoveries marked")
    t.add_argument("job")
    t.add_argument("-o", "--output", required=True, type=Path, help="the PNG to write")
    t.add_argument("--no-events", action="store_true", help="draw without the job's Events")
    e = sub.add_parser("events", help="the job's Events, oldest first")
    e.add_argument("job")
    e.add_argument("--failures", action="store_true", help="only failures (Warnings and failure reasons)")
    for sp in (s, t, e):
        _common(sp, suppress=True)
    return p


def default_namespace(kubeconfig: str | None, context: str | None) -> str:
    """The namespace of the kubeconfig context (like kubectl), in a pod its own, else "default"."""
    from kubernetes import config

    try:
        contexts, active = config.list_kube_config_contexts(config_file=kubeconfig)
    except Exception:  # no kubeconfig: in-cluster
        try:
            return Path(SA_NAMESPACE).read_text().strip() or "default"
        except OSError:
            return "default"
    chosen = next((c for c in contexts if c.get("name") == context), None) if context else active
    return ((chosen or {}).get("context") or {}).get("namespace") or "default"


def api_client(kubeconfig: str | None, context: str | None) -> Any:
    """A Kubernetes API client from the kubeconfig (and context), else the in-cluster config inside a pod;
    PluginError when neither loads."""
    from kubernetes import client, config

    try:
        return config.new_client_from_config(config_file=kubeconfig, context=context)
    except Exception as e:
        if kubeconfig is None and context is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            cfg = client.Configuration()
            config.load_incluster_config(client_configuration=cfg)
            return client.ApiClient(cfg)
        raise PluginError(f"cannot load the kubeconfig: {e}") from None


class Cluster:
    """The two reads the plugin makes."""

    def __init__(self, api: Any) -> None:
        self.api = api

    def job(self, namespace: str, name: str) -> dict[str, Any]:
        """The job's object as the apiserver's JSON; PluginError for a missing job or an unreachable apiserver."""
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        try:
            resp = client.CustomObjectsApi(self.api).get_namespaced_custom_object(
                contract.API_GROUP,
                contract.API_VERSION,
                namespace,
                contract.PLURAL,
                name,
                _preload_content=False,
            )
        except ApiException as e:
            if e.status == 404:
                raise PluginError(
                    f'faulttoleranttrainingjob "{name}" not found in namespace "{namespace}"'
                    " (is the CRD installed? `kubectl get ftj -A` lists the jobs)"
                ) from None
            raise PluginError(f"cannot read job {namespace}/{name}: {e.status} {e.reason}") from None
        except Exception as e:  # unreachable apiserver, TLS, ...
            raise PluginError(f"cannot reach the apiserver: {e}") from None
        return json.loads(resp.data)

    def events(self, namespace: str, name: str) -> list[ev.JobEvent]:
        """The job's Events; none (with a warning) when they cannot be listed."""
        try:
            return ev.fetch(self.api, namespace, name)
        except Exception as e:  # Events are a courtesy: show the rest without them
            print(f"warning: cannot list the Events of {name}: {getattr(e, 'reason', e)}", file=sys.stderr)
            return []


def run(args: argparse.Namespace, cluster: Cluster, namespace: str, out: Callable[[str], None] = print) -> int:
    """Runs the parsed ``status``, ``timeline`` or ``events`` command against ``cluster``, writing through ``out``;
    returns the exit code."""
    progress: Callable[[str], None] = (
        (lambda _m: None) if args.quiet else (lambda m: print(f"kubectl-ftjob: {m}", file=sys.stderr, flush=True))
    )
    now = time.time()
    if args.command == "status":
        job = cluster.job(namespace, args.job)
        if args.output == "json":
            out(json.dumps(job, indent=2))
            return 0
        out(status_view.render(job, cluster.events(namespace, args.job), now))
        return 0
    if args.command == "events":
        cluster.job(namespace, args.job)  # a clear error for a job that does not exist
        out(ev.render(cluster.events(namespace, args.job), now, only_failures=args.failures))
        return 0
    from ftjob.operator.kubectl import timeline

    progress(f"reading job {namespace}/{args.job}")
    job = cluster.job(namespace, args.job)
    events: list[ev.JobEvent] = []
    if not args.no_events:
        progress("listing its Events")
        events = cluster.events(namespace, args.job)
    try:
        n = timeline.plot(job, events, args.output, progress)
    except timeline.TimelineError as e:
        raise PluginError(str(e)) from None
    progress(f"wrote {args.output} ({n} samples, {len(events)} events)")
    return 0


def main(argv: Sequence[str] | None = None, cluster: Cluster | None = None) -> int:
    """The ``kubectl ftjob`` command; returns the exit code (1: an error it explained)."""
    args = parser().parse_args(argv)
    try:
        if cluster is None:
            cluster = Cluster(api_client(args.kubeconfig, args.context))
        namespace = args.namespace or default_namespace(args.kubeconfig, args.context)
        return run(args, cluster, namespace)
    except PluginError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
