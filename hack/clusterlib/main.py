"""hack/cluster: bring a local Kubernetes cluster (control plane + real kubelet/containerd nodes) up and down, and
inject faults into it.

Run through the `hack/cluster` wrapper, which picks the project's Python environment.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # makes `clusterlib` importable as a package

from clusterlib import controlplane, faults, lifecycle, settings
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
    settings.check_socket_paths(settings.from_env(REPO, VENV, args.nodes, args.gpus))  # bad input: fail before building
    lifecycle.prepare(REPO)
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
        lifecycle.up(dataclasses.replace(s, repo=str(REPO), venv=str(VENV)), t0)  # images from the caller's checkout
    shape = f"{s.nodes} nodes x {s.gpus_per_node} GPUs"
    print(f"[cluster {time.monotonic() - t0:5.1f}s] cluster up: {shape}, state in {s.root}")
    print(env_lines(s))
    return 0


def cmd_images(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    s = settings.load()
    if s is None or not controlplane.running(s):
        raise SystemExit("error: no cluster is up; `hack/cluster up` builds the images and imports them")
    with cluster_lock():
        print(json.dumps(lifecycle.refresh_images(dataclasses.replace(s, repo=str(REPO), venv=str(VENV)), t0)))
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    with cluster_lock():
        lifecycle.down(current(args), t0)
    print(f"[down {time.monotonic() - t0:4.1f}s] cluster down: no process, mount, cgroup, netns, link or state left")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    s = settings.load()
    if s is None:
        print(f"no cluster in {settings.default_state_dir()}")
        return 2
    return lifecycle.status(s)


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
    elif args.command in ("freeze-pod", "thaw-pod"):
        faults.freeze_pod(s, args.target, freeze=args.command == "freeze-pod")
    else:
        faults.cut_pod(s, args.target, up=args.command == "heal-pod")
    return 0


def cmd_node_grace(args: argparse.Namespace) -> int:
    s = settings.load()
    if s is None:
        raise SystemExit(f"error: no cluster in {settings.default_state_dir()}; run `hack/cluster up` first")
    value = None if args.seconds == "default" else args.seconds
    if value is not None and not (value.isdigit() and int(value) > 0):
        raise SystemExit(f"error: node-grace takes a whole number of seconds or `default`, not {args.seconds!r}")
    with cluster_lock():
        controlplane.set_node_monitor_grace(s, None if value is None else f"{value}s", time.monotonic())
    print(f"kube-controller-manager: --node-monitor-grace-period={controlplane.node_monitor_grace(s)}")
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
    images = sub.add_parser("images", help="rebuild changed images, import them into every node, print their refs")
    images.set_defaults(func=cmd_images)
    logs = sub.add_parser("logs", help="tail the component logs")
    logs.add_argument("name", nargs="?", help="only logs whose name contains this")
    logs.add_argument("-n", "--lines", type=int, default=20)
    logs.set_defaults(func=cmd_logs)
    grace = sub.add_parser(
        "node-grace", help="restart the controller-manager with this node-monitor grace period (seconds | default)"
    )
    grace.add_argument("seconds", metavar="SECONDS|default")
    grace.set_defaults(func=cmd_node_grace)
    for name, target, text in (
        ("kill-node", "NODE", "SIGKILL a node's kubelet, containerd, shims and containers"),
        ("cut-node", "NODE", "take a node's uplink down"),
        ("heal-node", "NODE", "bring a node's uplink back"),
        ("cut-pod", "NS/POD", "take a pod's veth down"),
        ("heal-pod", "NS/POD", "bring a pod's veth back"),
        ("freeze-pod", "NS/POD", "SIGSTOP every process of a pod (a silent failure: no socket reset)"),
        ("thaw-pod", "NS/POD", "SIGCONT every process of a frozen pod"),
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
