"""The nodes: each a network namespace running a real node (hack/clusterlib/runtime.py), with the cluster's images
imported into its containerd, registered Ready with the API server."""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from clusterlib import controlplane, images, netsetup, procs, runtime, transfer
from clusterlib.logs import Logged
from clusterlib.settings import Settings


def _node_images(s: Settings, n: int) -> set[str]:
    proc = subprocess.run(runtime.ctr(s, n, "images", "ls", "-q"), capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"error: cannot list the images of {s.node_name(n)}: {proc.stderr.strip()}")
    return set(proc.stdout.split())


def import_images(s: Settings, built: dict[str, images.Image], t0: float) -> None:
    """Import into every node's containerd each image it lacks (by exact tag), sending only missing layers, the
    nodes in parallel; then point the stable aliases (`:dev`, and the release names the examples use) at them."""
    log = Logged(Path(s.cache_dir) / "logs" / "images.log", "images", t0)
    have = {n: _node_images(s, n) for n in range(1, s.nodes + 1)}
    missing = {n: [img for img in built.values() if img.ref not in have[n]] for n in have}
    descs = {img.ref: transfer.export(s, log, img) for imgs in missing.values() for img in imgs}

    def import_into(n: int) -> None:
        blobs = transfer.node_blobs(s, n) if missing[n] else set()
        for img in missing[n]:
            t = time.monotonic()
            sent = transfer.import_into(s, n, log, img, descs[img.ref], blobs)
            log.say(f"imported {img.ref} into {s.node_name(n)}: {sent / 2**20:.0f} MiB in {time.monotonic() - t:.1f}s")
        for img in built.values():
            for alias in img.aliases:
                if alias not in have[n] or img in missing[n]:
                    log.run(runtime.ctr(s, n, "images", "tag", "--force", img.ref, alias))

    with ThreadPoolExecutor(max_workers=s.nodes) as pool:
        list(pool.map(import_into, have))  # list(): re-raises the first failure
    transfer.prune(s, keep=[img.ref for img in built.values()])
    current = {ref for img in built.values() for ref in (img.ref, *img.aliases)}
    for n, refs in have.items():  # images of earlier builds: running containers keep their snapshots
        stale = [r for r in refs if r.startswith(f"{images.REGISTRY}/") and r not in current]
        if stale:
            log.run(runtime.ctr(s, n, "images", "rm", "--sync", *stale))


def ensure(s: Settings, t0: float, built: dict[str, images.Image]) -> None:
    """Build each node's network, start its containerd, import the images, then start the rest of the node."""
    env = controlplane.child_env(s)
    env["PATH"] = f"{env['PATH']}:/usr/sbin:/sbin"  # runc, iptables, conntrack

    def say(msg: str) -> None:
        print(f"[cluster {time.monotonic() - t0:5.1f}s] {msg}", flush=True)

    for n in range(1, s.nodes + 1):
        netsetup.ensure_node(s, n)
        problems = netsetup.check_node(s, n)
        if problems:
            raise SystemExit(f"error: network of {s.node_name(n)} is broken: {'; '.join(problems)}")
        runtime.write_configs(s, n, built["pause"].dev_ref)
        runtime.start_missing(s, n, env, say, ("containerd",))
    import_images(s, built, t0)
    for n in range(1, s.nodes + 1):
        runtime.start_missing(s, n, env, say, runtime.COMPONENTS)


def api_get(s: Settings, path: str) -> dict:
    with urllib.request.urlopen(s.api_url + path, timeout=5, context=controlplane.admin_ssl(s)) as resp:
        return json.loads(resp.read())


def node_ready(s: Settings) -> dict[str, str]:
    """Each Node object's Ready condition status ("True"/"False"/"Unknown"); {} if the API cannot be read."""
    try:
        items = api_get(s, "/api/v1/nodes")["items"]
    except (urllib.error.URLError, OSError, ValueError, KeyError):
        return {}
    ready = {}
    for node in items:
        conditions = {c["type"]: c["status"] for c in node.get("status", {}).get("conditions", [])}
        ready[node["metadata"]["name"]] = conditions.get("Ready", "Unknown")
    return ready


def gpus_advertised(s: Settings) -> dict[str, str]:
    try:
        items = api_get(s, "/api/v1/nodes")["items"]
    except (urllib.error.URLError, OSError, ValueError, KeyError):
        return {}
    return {x["metadata"]["name"]: x.get("status", {}).get("allocatable", {}).get("nvidia.com/gpu", "0") for x in items}


def default_service_account_exists(s: Settings) -> bool:
    """Pods can only be created once the serviceaccount controller has made `default` in their namespace."""
    try:
        api_get(s, "/api/v1/namespaces/default/serviceaccounts/default")
        return True
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_ready(s: Settings, t0: float, timeout_s: float = 180) -> None:
    """Wait until every node is Ready with its GPUs advertised and the `default` namespace can take pods."""
    want = [s.node_name(n) for n in range(1, s.nodes + 1)]
    deadline, last_note = time.monotonic() + timeout_s, 0.0
    while True:
        ready, gpus = node_ready(s), gpus_advertised(s)
        missing = [x for x in want if ready.get(x) != "True" or gpus.get(x, "0") != str(s.gpus_per_node)]
        if not missing and default_service_account_exists(s):
            print(f"[cluster {time.monotonic() - t0:5.1f}s] all {len(want)} nodes Ready", flush=True)
            return
        for n in range(1, s.nodes + 1):
            for component in runtime.COMPONENTS:
                if component == "gpu-plugin" and s.gpus_per_node == 0:
                    continue
                if procs.read(runtime.pid_file(s, n, component)) is None:
                    tail = procs.log_tail(runtime.log_file(s, n, component))
                    raise SystemExit(f"error: {component} of {s.node_name(n)} exited; last log lines:\n{tail}")
        if time.monotonic() > deadline:
            raise SystemExit(f"error: nodes not Ready after {timeout_s:.0f}s: {missing}; see {s.root / 'logs'}")
        if time.monotonic() - last_note > 5:
            last_note = time.monotonic()
            state = ", ".join(f"{x}={ready.get(x, 'absent')} gpus={gpus.get(x, '-')}" for x in want)
            print(f"[cluster {time.monotonic() - t0:5.1f}s] waiting for nodes: {state}", flush=True)
        time.sleep(0.3)


def running_components(s: Settings) -> list[procs.Tracked]:
    return [t for n in range(1, s.nodes + 1) for t in runtime.running(s, n)]
