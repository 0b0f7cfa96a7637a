"""Taking over a pod's containers after an agent restart, from its pod.json record and its last API status."""

from __future__ import annotations

import signal

from .container import ContainerRunner
from .process import ContainerProcess
from .state import PodRecord


def adopt_containers(
    init_runners: list[ContainerRunner], runners: list[ContainerRunner], record: PodRecord, api_status: dict
) -> bool:
    """Re-attaches containers that outlived the agent; True when the pod had got past its init containers.

    A container whose process died meanwhile is reported lost and its restartPolicy decides (Never must not run it a
    second time). Init containers that were still running are killed: they rerun from the start, as after a kubelet
    restart, so init containers must be idempotent.
    """
    by_name = {c["name"]: c for c in (api_status.get("containerStatuses") or [])}
    adopted = False
    for r in runners:
        rec = record.containers.get(r.name)
        if rec is None:
            continue
        proc = ContainerProcess(rec.pid, rec.start_time, None)
        prev = by_name.get(r.name, {})
        started = (prev.get("state", {}).get("running") or {}).get("startedAt", "")
        restarts = max(rec.restart_count, prev.get("restartCount", 0))
        if proc.alive():
            r.adopt(proc, restarts, started)
        else:
            r.lost(restarts, started)
        adopted = True
    conditions = api_status.get("conditions") or []
    initialized = any(c.get("type") == "Initialized" and c.get("status") == "True" for c in conditions)
    if initialized or adopted:
        init_by_name = {c["name"]: c for c in (api_status.get("initContainerStatuses") or [])}
        done = {"terminated": {"exitCode": 0, "reason": "Completed"}}
        for r in init_runners:
            r.s.state = init_by_name.get(r.name, {}).get("state") or done
            r.final_exit = 0
        return True
    for r in init_runners:
        rec = record.containers.get(r.name)
        if rec is not None:
            proc = ContainerProcess(rec.pid, rec.start_time, None)
            if proc.alive():
                proc.signal_group(signal.SIGKILL)
    return False
