"""Bringing the whole cluster up, down, and reporting its health: the order of the parts and what each leaves."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

from clusterlib import cgroups, controlplane, dns, faults, images, mounts, netsetup, nodes, pki, procs, runtime
from clusterlib.settings import Settings, load


def prepare(repo: Path) -> None:
    """What a cluster needs before it starts: Debian packages and binaries (minutes on a fresh machine)."""
    subprocess.run([str(repo / "hack/lib/host-packages.sh")], check=True)
    subprocess.run([str(repo / "hack/lib/build-binaries.sh"), "all"], check=True)


def record_images(s: Settings, built: dict[str, images.Image]) -> None:
    path = s.root / "images.json"
    path.write_text(json.dumps({name: img.as_dict() for name, img in built.items()}, indent=2) + "\n")


def reclaim_abandoned(s: Settings, t0: float) -> None:
    """Take down a clashing cluster whose control plane no longer runs: what a killed session or a reboot leaves
    (its netns, bridge, mounts and state outlive its processes). One whose control plane runs is left alone."""
    for root in mounts.clashing_clusters(s):
        other = load(root)
        if other is None or controlplane.running(other):
            continue
        print(
            f"[cluster {time.monotonic() - t0:5.1f}s] the cluster in {root} was abandoned (its control plane is "
            "not running) and uses the same names: taking it down first",
            flush=True,
        )
        down(other, t0)


def up(s: Settings, t0: float) -> None:
    reclaim_abandoned(s, t0)
    mounts.refuse_clashing_cluster(s)
    s.save()
    built = images.build_all(s, t0)
    record_images(s, built)
    netsetup.ensure_host(s)
    mounts.acquire_host_paths(s)
    pki.ensure(s)
    controlplane.ensure(s, t0)
    dns.ensure(s, controlplane.child_env(s), t0)
    nodes.ensure(s, t0, built)
    nodes.wait_ready(s, t0)


def refresh_images(s: Settings, t0: float) -> dict[str, str]:
    """Rebuild whatever image the checkout changed and import it into every node."""
    built = images.build_all(s, t0)
    record_images(s, built)
    nodes.import_images(s, built, t0)
    return {name: img.dev_ref for name, img in built.items()}


def _stop_nodes(s: Settings, say) -> None:
    """Kubelets first (so none restarts a container), then every pod process by cgroup, then containerd and what
    is left in the nodes' network namespaces (shims)."""
    for component in ("kubelet", "kube-proxy", "gpu-plugin"):
        tracked = [t for n in range(1, s.nodes + 1) if (t := procs.read(runtime.pid_file(s, n, component)))]
        if tracked:
            say(f"stopping {len(tracked)} x {component}")
            procs.stop(tracked, grace_s=10)
    for n in range(1, s.nodes + 1):
        faults.kill_all(faults.pod_pids(s, n))
    tracked = [t for n in range(1, s.nodes + 1) if (t := procs.read(runtime.pid_file(s, n, "containerd")))]
    if tracked:
        say(f"stopping {len(tracked)} x containerd")
        procs.stop(tracked, grace_s=5)


def down(s: Settings, t0: float) -> None:
    def say(msg: str) -> None:
        print(f"[down {time.monotonic() - t0:4.1f}s] {msg}", flush=True)

    _stop_nodes(s, say)
    for name, tracked in [("coredns", procs.read(dns.pid_file(s)))] + [
        (c, procs.read(controlplane.pid_file(s, c))) for c in reversed(controlplane.COMPONENTS)
    ]:
        if tracked is not None:
            say(f"stopping {name} (pid {tracked.pid})")
            procs.stop([tracked], grace_s=10)
    deadline, node_prefix = time.monotonic() + 15, f"{s.netns_prefix}-node-"
    while True:
        leftovers = {ns: p for ns in netsetup.cluster_netns(s) if (p := netsetup.netns_pids(ns))}
        leftovers.update({f"cgroup {r}": p for r in cgroups.leftover_roots(node_prefix) if (p := cgroups.pids(r))})
        if not leftovers:
            break
        if time.monotonic() > deadline:
            raise SystemExit(f"error: processes survive SIGKILL: {leftovers}")
        say(f"killing leftovers in {leftovers}")
        procs.kill_now([p for pids in leftovers.values() for p in pids])
        time.sleep(0.1)
    for n in range(1, s.nodes + 1):
        mounts.remove_node_ns(s, n)
    mounts.remove_ns_dir(s)
    busy = [d for r in cgroups.leftover_roots(node_prefix) for d in cgroups.remove(r)]
    netsetup.teardown(s)
    kept = mounts.release_host_paths(s)
    if s.root.exists() and _mounts_below(s.root):
        raise SystemExit(f"error: mounts are still active below {s.root}: {_mounts_below(s.root)}; not deleting it")
    shutil.rmtree(s.root, ignore_errors=True)
    left = netsetup.cluster_netns(s) + netsetup.cluster_links(s) + busy
    if left or s.root.exists():
        raise SystemExit(f"error: down left {left or s.root} behind")
    if kept:
        say(f"kept host folders that are no longer empty: {kept}")


def _mounts_below(root: Path) -> list[str]:
    prefix = str(root.resolve()) + "/"
    with open("/proc/self/mounts") as f:
        return [line.split()[1] for line in f if line.split()[1].startswith(prefix)]


def status(s: Settings) -> int:
    """Print each component's health; 0 all healthy, 1 partly, 2 nothing runs."""
    ok = True
    print(f"cluster in {s.root}: {s.nodes} nodes x {s.gpus_per_node} GPUs, API {s.api_url}")
    for component in controlplane.COMPONENTS:
        tracked = procs.read(controlplane.pid_file(s, component))
        good = controlplane.healthy(s, component)
        ok &= good
        pid = tracked.pid if tracked else "-"
        print(f"  {component:24} pid {pid!s:>8}  {'healthy' if good else 'NOT HEALTHY'}")
    tracked = procs.read(dns.pid_file(s))
    good = tracked is not None and dns.ready(s)
    ok &= good
    print(f"  {'coredns':24} pid {tracked.pid if tracked else '-'!s:>8}  {'ready' if good else 'NOT READY'}")
    ready = nodes.node_ready(s)
    for n in range(1, s.nodes + 1):
        problems = netsetup.check_node(s, n)
        for component in runtime.COMPONENTS:
            if component == "gpu-plugin" and s.gpus_per_node == 0:
                continue
            if procs.read(runtime.pid_file(s, n, component)) is None:
                problems.append(f"{component} not running")
        node_ok = not problems and ready.get(s.node_name(n)) == "True"
        ok &= node_ok
        pids = " ".join(f"{t.name.split()[0]}={t.pid}" for t in runtime.running(s, n)) or "no processes"
        net = "; ".join(problems) or f"ok ({s.node_ip(n)})"
        print(f"  {s.node_name(n):24} Ready={ready.get(s.node_name(n), 'absent')}  {net}  [{pids}]")
    if not controlplane.running(s):
        return 2  # nothing runs: a caller that starts it owns it
    return 0 if ok else 1
