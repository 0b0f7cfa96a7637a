#!/usr/bin/env python3
"""Node agent benchmark: how fast a burst of pods starts, and how fast a process exit reaches the API.

Usage (cluster up, KUBECONFIG set):  python hack/nodeagent/bench_pods.py --pods 200
Creates <pods> `sleep` pods in a fresh namespace and waits until all run, then 5 single pods one at a time, then one
pod that exits at a recorded time, and prints: burst start-up (total and per pod), single-pod create -> Running
latency, and process exit -> Failed-in-API latency. Deletes the namespace at the end.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
import uuid
from pathlib import Path

from kubernetes import client, config, watch


def _pod(name: str, command: list[str], **extra: object) -> dict:
    spec = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 1,
        "containers": [{"name": "main", "image": "busybox", "command": command, **extra}],
    }
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"bench": "1"}}, "spec": spec}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pods", type=int, default=100)
    ap.add_argument("--timeout", type=float, default=600)
    args = ap.parse_args()
    config.load_kube_config()
    core = client.CoreV1Api()
    ns = f"bench-nodeagent-{uuid.uuid4().hex[:5]}"
    core.create_namespace({"metadata": {"name": ns}})
    try:
        running: dict[str, float] = {}
        done = threading.Event()

        def watch_pods() -> None:
            for event in watch.Watch().stream(core.list_namespaced_pod, ns, timeout_seconds=int(args.timeout)):
                p = event["object"]
                if p.status.phase == "Running" and p.metadata.name not in running:
                    running[p.metadata.name] = time.monotonic()
                    if len(running) % max(1, args.pods // 10) == 0:
                        print(f"[bench] {len(running)}/{args.pods} running", flush=True)
                if len(running) >= args.pods:
                    done.set()
                    return

        watcher = threading.Thread(target=watch_pods, daemon=True)
        watcher.start()
        t0 = time.monotonic()
        for i in range(args.pods):
            core.create_namespaced_pod(ns, _pod(f"sleep-{i}", ["sleep", "100000"]))
        created = time.monotonic() - t0
        if not done.wait(args.timeout):
            print(f"[bench] only {len(running)}/{args.pods} pods running after {args.timeout:.0f}s")
            return 1
        total = max(running.values()) - t0
        print(
            f"[bench] created {args.pods} pods in {created:.1f}s; all Running after {total:.1f}s "
            f"({total / args.pods * 1000:.0f} ms/pod)"
        )

        # Single-pod start latency (what a replacement pod costs): create -> Running in the API, one at a time.
        starts = []
        for i in range(5):
            t = time.monotonic()
            core.create_namespaced_pod(ns, _pod(f"single-{i}", ["sleep", "100000"]))
            for event in watch.Watch().stream(
                core.list_namespaced_pod, ns, field_selector=f"metadata.name=single-{i}", timeout_seconds=60
            ):
                if event["object"].status.phase == "Running":
                    starts.append(time.monotonic() - t)
                    break
        starts.sort()
        print(
            f"[bench] one pod create -> Running: median {starts[len(starts) // 2] * 1000:.0f} ms, "
            f"max {starts[-1] * 1000:.0f} ms (5 pods, one at a time, {args.pods} already running)"
        )

        # Exit latency: the pod records the wall time it exits at; we record when the API says Failed.
        with tempfile.TemporaryDirectory() as tmp:
            script = "import time,sys; time.sleep(1); open('/out/t','w').write(repr(time.time())); sys.exit(3)"
            pod = _pod("exiter", ["python", "-c", script], volumeMounts=[{"name": "out", "mountPath": "/out"}])
            pod["spec"]["volumes"] = [{"name": "out", "hostPath": {"path": tmp}}]
            core.create_namespaced_pod(ns, pod)
            for event in watch.Watch().stream(
                core.list_namespaced_pod, ns, field_selector="metadata.name=exiter", timeout_seconds=120
            ):
                if event["object"].status.phase == "Failed":
                    seen = time.time()
                    break
            exited = float((Path(tmp) / "t").read_text())
            print(f"[bench] process exit -> pod Failed in the API: {(seen - exited) * 1000:.0f} ms")
    finally:
        core.delete_namespace(ns)
        print(f"[bench] deleting namespace {ns}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
