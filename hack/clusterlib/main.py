"""hack/cluster: bring a local Kubernetes control plane with netns nodes up and down, and inject faults into it.

Run through the `hack/cluster` wrapper, which picks the project's Python environment.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # makes `clusterlib` importable as a package

from clusterlib import controlplane, faults, netsetup, nodes, pki, procs, settings
from clusterlib.settings import Settings

REPO = Path(__file__).resolve().parents[2]
VENV = Path(sys.prefix)


@contextlib.contextmanager
def cluster_lock() -> Iterator[None]:
    """One `up`/`down`/`kill-node` at a time per state dir (tests and people may call them at once)."""
    lock_path = settings.default_state_dir().with_name(settings.default_state_dir().name + ".lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def env_lines(s: Settings) -> str:
    return f"export KUBECONFIG={s.kubeconfig}\nexport PATH={s.bin_dir}:{s.venv}/bin:$PATH"


def current(args: argparse.Namespace | None = None) -> Settings:
    """The recorded settings of this state dir, else fresh ones from the environment and flags."""
    return settings.load() or settings.from_env(REPO, VENV, getattr(args, "nodes", None), getattr(args, "gpus", None))


def cmd_up(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    subprocess.run([str(REPO / "hack/lib/build-binaries.sh"), "all"], check=True)
    with cluster_lock():
        s = settings.load()
        fresh = settings.from_env(REPO, VENV, args.nodes, args.gpus)
        if s is not None and controlplane.running(s):
            if (args.nodes, args.gpus) != (args.nodes and s.nodes, args.gpus and s.gpus_per_node):
                raise SystemExit(
                    f"error: a cluster with {s.nodes} nodes x {s.gpus_per_node} GPUs is already up in {s.state_dir}; "
                    "run `hack/cluster down` first to change its shape"
                )
        else:
            s = fresh
        s.save()
        netsetup.ensure_host(s)
        pki.ensure(s)
        controlplane.ensure(s, t0)
        nodes.ensure(s, t0)
        nodes.wait_ready(s, t0)
    shape = f"{s.nodes} nodes x {s.gpus_per_node} GPUs"
    print(f"[cluster {time.monotonic() - t0:5.1f}s] cluster up: {shape}, state in {s.root}")
    print(env_lines(s))
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    with cluster_lock():
        s = current(args)
        agents = nodes.running_agents(s)
        print(f"[down {time.monotonic() - t0:4.1f}s] stopping {len(agents)} node agents", flush=True)
        procs.stop(agents, grace_s=10)
        for component in reversed(controlplane.COMPONENTS):
            tracked = procs.read(controlplane.pid_file(s, component))
            if tracked is not None:
                print(f"[down {time.monotonic() - t0:4.1f}s] stopping {component} (pid {tracked.pid})", flush=True)
                procs.stop([tracked], grace_s=10)
        deadline = time.monotonic() + 15
        while leftovers := {ns: p for ns in netsetup.cluster_netns(s) if (p := netsetup.netns_pids(ns))}:
            if time.monotonic() > deadline:
                raise SystemExit(f"error: processes survive SIGKILL in {leftovers}")
            print(f"[down {time.monotonic() - t0:4.1f}s] killing leftovers in {leftovers}", flush=True)
            procs.kill_now([p for pids in leftovers.values() for p in pids])
            time.sleep(0.1)
        netsetup.teardown(s)
        shutil.rmtree(s.root, ignore_errors=True)
        left = netsetup.cluster_netns(s) + netsetup.cluster_links(s)
        if left or s.root.exists():
            raise SystemExit(f"error: down left {left or s.root} behind")
    print(f"[down {time.monotonic() - t0:4.1f}s] cluster down: no process, netns, link or state left")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    s = settings.load()
    if s is None:
        print(f"no cluster in {settings.default_state_dir()}")
        return 2
    ok = True
    print(f"cluster in {s.root}: {s.nodes} nodes x {s.gpus_per_node} GPUs, API {s.api_url}")
    for component in controlplane.COMPONENTS:
        tracked = procs.read(controlplane.pid_file(s, component))
        good = controlplane.healthy(s, component)
        ok &= good
        pid = tracked.pid if tracked else "-"
        print(f"  {component:24} pid {pid!s:>8}  {'healthy' if good else 'NOT HEALTHY'}")
    ready = nodes.node_ready(s)
    for n in range(1, s.nodes + 1):
        tracked = procs.read(nodes.agent_pid_file(s, n))
        problems = netsetup.check_node(s, n)
        node_ok = tracked is not None and not problems and ready.get(s.node_name(n)) == "True"
        ok &= node_ok
        pid = tracked.pid if tracked else "-"
        net = "; ".join(problems) or f"net ok ({s.node_ip(n)})"
        print(f"  {s.node_name(n):24} pid {pid!s:>8}  Ready={ready.get(s.node_name(n), 'absent')}  {net}")
    if not controlplane.running(s):
        return 2  # nothing runs: a caller that starts it owns it
    return 0 if ok else 1


def cmd_env(args: argparse.Namespace) -> int:
    print(env_lines(current(args)))
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    s = current(args)
    logs = sorted((s.root / "logs").glob("*.log"))
    if args.name:
        logs = [p for p in logs if args.name in p.stem]
        if not logs:
            raise SystemExit(f"error: no log matches {args.name!r}; logs are in {s.root / 'logs'}")
    for path in logs:
        lines = path.read_text(errors="replace").splitlines()[-args.lines :]
        print(f"==> {path} <==")
        print("\n".join(lines))
    return 0


def cmd_fault(args: argparse.Namespace) -> int:
    s = settings.load()
    if s is None:
        raise SystemExit(f"error: no cluster in {settings.default_state_dir()}; run `hack/cluster up` first")
    if args.command == "kill-node":
        with cluster_lock():
            faults.kill_node(s, args.target)
    elif args.command in ("cut-node", "heal-node"):
        faults.cut_node(s, args.target, up=args.command == "heal-node")
    else:
        faults.cut_pod(s, args.target, up=args.command == "heal-pod")
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hack/cluster", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start (or complete) the cluster and wait for Ready nodes")
    up.add_argument("--nodes", type=int, help="node count (default FTJOB_NODES or 2)")
    up.add_argument("--gpus", type=int, help="GPUs per node (default FTJOB_GPUS_PER_NODE or 8)")
    up.set_defaults(func=cmd_up)
    sub.add_parser("down", help="stop everything and remove all state").set_defaults(func=cmd_down)
    sub.add_parser("status", help="components, nodes, PIDs (exit 0 all healthy, 1 partly, 2 not running)").set_defaults(
        func=cmd_status
    )
    sub.add_parser("env", help="print the KUBECONFIG and PATH exports").set_defaults(func=cmd_env)
    logs = sub.add_parser("logs", help="tail the component logs")
    logs.add_argument("name", nargs="?", help="only logs whose name contains this")
    logs.add_argument("-n", "--lines", type=int, default=20)
    logs.set_defaults(func=cmd_logs)
    for name, target, text in (
        ("kill-node", "NODE", "SIGKILL a node's agent and every process of it and its pods"),
        ("cut-node", "NODE", "take a node's uplink down"),
        ("heal-node", "NODE", "bring a node's uplink back"),
        ("cut-pod", "NS/POD", "take a pod's veth down"),
        ("heal-pod", "NS/POD", "bring a pod's veth back"),
    ):
        fault = sub.add_parser(name, help=text)
        fault.add_argument("target", metavar=target)
        fault.set_defaults(func=cmd_fault)
    return p


def main() -> int:
    args = parser().parse_args()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
