"""The job's Events: fetched (core/v1, else events.k8s.io/v1), normalised to one shape, classified and rendered."""

from __future__ import annotations

import datetime as dt
import json
import re
from dataclasses import dataclass
from typing import Any

from ftjob import contract

# Reasons the operator posts (operator/planning/plan.py, worker.py, migration.py, stuck.py, status.py). A Warning of any
# other reason counts as a failure too; these only colour the Normal ones and name the recoveries.
FAILURE_REASONS = frozenset(
    {
        "GroupRestart",
        "GroupRestarted",
        "GroupFailed",
        "GroupMigrating",
        "LighthouseRestart",
        "LighthouseEvicted",
        "LighthouseFailed",
        "HeartbeatLost",
        "PodCreationRefused",
        "Unschedulable",
        "BelowMinReplicas",
        "Failed",
    }
)
RECOVERY_REASONS = frozenset(
    {"GroupRecovered", "GroupRejoined", "GroupMigrated", "LighthouseRecovered", "Resumed", "Succeeded"}
)
FAILURE, RECOVERY, OTHER = "failure", "recovery", "other"
_GROUP_RE = re.compile(r"replica group (\d+)")


@dataclass(frozen=True)
class JobEvent:
    time: float | None  # unix seconds of the last occurrence
    type: str  # Normal | Warning
    reason: str
    message: str
    count: int = 1
    first_time: float | None = None

    @property
    def kind(self) -> str:
        """failure | recovery | other: how the timeline colours it."""
        if self.reason in RECOVERY_REASONS:
            return RECOVERY
        if self.reason in FAILURE_REASONS or self.type == "Warning":
            return FAILURE
        return OTHER

    @property
    def group(self) -> int | None:
        """The replica group the message names ("... replica group 1 ..."), if any."""
        m = _GROUP_RE.search(self.message)
        return int(m.group(1)) if m else None


def parse_time(value: Any) -> float | None:
    if value is None or value == "":
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, dt.datetime):
        return (value if value.tzinfo else value.replace(tzinfo=dt.UTC)).timestamp()
    try:
        return dt.datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def normalize(item: dict[str, Any]) -> JobEvent:
    """One core/v1 Event or events.k8s.io/v1 Event (both as the apiserver's JSON, camelCase) as a JobEvent."""
    series = item.get("series") or {}
    last = (
        parse_time(item.get("lastTimestamp"))
        or parse_time(series.get("lastObservedTime"))
        or parse_time(item.get("deprecatedLastTimestamp"))
        or parse_time(item.get("eventTime"))
        or parse_time(item.get("firstTimestamp"))
        or parse_time(item.get("deprecatedFirstTimestamp"))
        or parse_time((item.get("metadata") or {}).get("creationTimestamp"))
    )
    first = (
        parse_time(item.get("firstTimestamp"))
        or parse_time(item.get("deprecatedFirstTimestamp"))
        or parse_time(item.get("eventTime"))
        or last
    )
    count = item.get("count") or series.get("count") or item.get("deprecatedCount") or 1
    return JobEvent(
        time=last,
        type=str(item.get("type") or "Normal"),
        reason=str(item.get("reason") or ""),
        message=str(item.get("message") or item.get("note") or "").strip(),
        count=int(count),
        first_time=first,
    )


def from_list(items: list[dict[str, Any]]) -> list[JobEvent]:
    """Normalised and sorted oldest first (events without a time first)."""
    events = [normalize(i) for i in items if isinstance(i, dict)]
    return sorted(events, key=lambda e: (e.time is not None, e.time or 0.0))


def fetch(api_client: Any, namespace: str, job: str) -> list[JobEvent]:
    """The Events whose object is the job: core/v1 first; events.k8s.io/v1 when core/v1 is refused or missing."""
    from kubernetes import client
    from kubernetes.client.rest import ApiException

    core_selector = f"involvedObject.name={job},involvedObject.kind={contract.KIND}"
    try:
        resp = client.CoreV1Api(api_client).list_namespaced_event(
            namespace, field_selector=core_selector, _preload_content=False
        )
        return from_list(json.loads(resp.data).get("items") or [])
    except ApiException as e:
        if e.status not in (403, 404):
            raise
        first_error = e
    try:
        resp = client.EventsV1Api(api_client).list_namespaced_event(
            namespace, field_selector=f"regarding.name={job},regarding.kind={contract.KIND}", _preload_content=False
        )
        return from_list(json.loads(resp.data).get("items") or [])
    except ApiException:
        raise first_error from None


def age(seconds: float | None) -> str:
    """kubectl's style: 42s, 3m10s, 5h2m, 4d3h."""
    if seconds is None:
        return "-"
    s = max(0, int(seconds))
    if s < 120:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60}s" if s < 600 else f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60}m"
    return f"{s // 86400}d{(s % 86400) // 3600}h"


def render(events: list[JobEvent], now: float, only_failures: bool = False, width: int = 120) -> str:
    """A table like `kubectl get events`, oldest first."""
    rows = [e for e in events if not only_failures or e.kind == FAILURE]
    if not rows:
        return "no events" + (" of failures" if only_failures else "") + " (Events expire after an hour by default)"
    reason_w = max(len("REASON"), *(len(e.reason) for e in rows))
    lines = [f"{'AGE':<8} {'TYPE':<8} {'REASON':<{reason_w}} {'COUNT':>5}  MESSAGE"]
    for e in rows:
        msg = e.message.replace("\n", " ")
        room = max(20, width - 8 - 8 - reason_w - 5 - 5)
        if len(msg) > room:
            msg = msg[: room - 1] + "…"
        when = age(now - e.time) if e.time is not None else "-"
        lines.append(f"{when:<8} {e.type:<8} {e.reason:<{reason_w}} {e.count:>5}  {msg}")
    return "\n".join(lines)
